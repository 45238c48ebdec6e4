"""SGP (stochastic gradient push) under SlowMo: graphs, mixing, gossip rounds and training on 2 and 4 gloo ranks.

The graphs and the mixing are plain Python and are checked directly: their schedules, regularity, the rate at
which their mixing matrices reach the average. The gossip and SlowMo's SGP are checked against a single-process
simulation of the nodes written from SGP's algorithm, through CommStats, across a checkpoint and on the error
paths. Each spawned run covers many settings at once and returns numbers; the assertions are made here.
"""

import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ddpkit.algorithms.gossip_graphs import (
    GRAPHS,
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphManager,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)
from ddpkit.algorithms.gossip_mixing import UniformMixing

GRAPH_CLASSES = list(GRAPHS.values())


# -- 1. graphs and mixing (no processes) -----------------------------------------------------------------------


def _views(cls, nodes, ppi=1):
    return [cls(r, nodes, peers_per_itr=ppi) for r in range(nodes)]


def test_schedules_at_four_nodes():
    """Node 0's out-peers at rounds 0, 1, 2, ...: the schedules the graphs are defined by."""
    expected = {
        (DynamicDirectedExponentialGraph, 1): [[1], [3], [2], [2], [1]],
        (NPeerDynamicDirectedExponentialGraph, 1): [[1], [2], [1], [2], [1]],
        (NPeerDynamicDirectedExponentialGraph, 2): [[1, 2], [3, 2], [1, 2], [3, 2], [1, 2]],
        (NPeerDynamicDirectedExponentialGraph, 3): [[1, 2, 3]] * 5,
        (DynamicBipartiteExponentialGraph, 1): [[1], [3], [3], [1], [1]],
        (DynamicDirectedLinearGraph, 2): [[1, 3], [3, 1], [1, 3], [3, 1], [1, 3]],
        (DynamicBipartiteLinearGraph, 1): [[1], [3], [3], [1], [1]],
        (RingGraph, 1): [[1]] * 5,
        (RingGraph, 2): [[1, 3]] * 5,
    }
    for (cls, ppi), rounds in expected.items():
        graph = cls(0, 4, peers_per_itr=ppi)
        assert [graph.out_peers(t) for t in range(5)] == rounds, cls.__name__
    ring = RingGraph(2, 4)
    assert [ring.in_peers(t) for t in range(3)] == [[1]] * 3 and not ring.is_dynamic_graph()
    assert DynamicDirectedExponentialGraph(0, 4).in_peers(0) == [3]
    assert DynamicDirectedExponentialGraph(0, 4).in_peers(2) == [2]


def test_in_peers_mirror_out_peers_and_declared_regularity_holds():
    """For every graph, size and peers per round it can serve: who hears from whom, and the declared properties."""
    served = 0
    for cls in GRAPH_CLASSES:
        for nodes in range(2, 11):
            for ppi in (1, 2, 3):
                try:
                    views = _views(cls, nodes, ppi)
                except ValueError:
                    continue
                served += 1
                g = views[0]
                assert g.is_regular_graph() == g.computed_regular() is True, (cls, nodes, ppi)
                assert not g.needs_push_sum()
                for t in range(g.period() + 1):
                    for r, view in enumerate(views):
                        outs = view.out_peers(t)
                        assert outs == g.out_peers(t, r) and len(set(outs)) == ppi and r not in outs
                        senders = [s for s in range(nodes) if r in views[s].out_peers(t)]
                        assert view.in_peers(t) == senders, (cls, nodes, ppi, t, r)
                        if g.is_bipartite_graph():
                            assert all(view.is_passive() != g.is_passive(p) for p in outs)
                if g.is_dynamic_graph():  # the schedule repeats after period() rounds, not before
                    p = g.period()
                    assert all(g.out_peers(t + p, r) == g.out_peers(t, r) for t in range(p) for r in range(nodes))
    assert served > 60


class _Star(GraphManager):
    """Every node pushes to node 0 (node 0 to node 1): irregular, so uniform mixing needs push-sum."""

    def _make_graph(self):
        for r in range(self.world_size):
            self._add_peers(r, [0 if r else 1])

    def is_bipartite_graph(self):
        return False

    def is_dynamic_graph(self):
        return False


def test_an_irregular_graph_needs_push_sum():
    star = _Star(0, 4)
    assert star.in_peers(0) == [1, 2, 3] and _Star(2, 4).in_peers(0) == []
    assert not star.is_regular_graph() and star.needs_push_sum()
    assert not UniformMixing(star).is_regular() and UniformMixing(RingGraph(0, 4)).is_regular()


def test_graph_errors():
    cases = [
        (lambda: DynamicBipartiteExponentialGraph(0, 5), "even number of nodes"),
        (lambda: DynamicBipartiteLinearGraph(1, 3), "even number of nodes"),
        (lambda: RingGraph(0, 4, peers_per_itr=3), "peers_per_itr=3 cannot be served at world_size=4"),
        (lambda: DynamicDirectedExponentialGraph(0, 4, peers_per_itr=2), "round 1 the peers [2, 2]"),
        (lambda: NPeerDynamicDirectedExponentialGraph(0, 2, peers_per_itr=2), "cannot be served"),
        (lambda: RingGraph(0, 1), "world_size (the number of nodes) must be an int >= 2"),
        (lambda: RingGraph(4, 4), "rank (this node's index) must be an int in [0, 4)"),
        (lambda: RingGraph(0, 4, peers_per_itr=0), "peers_per_itr must be an int >= 1"),
        (lambda: RingGraph(0, 4.0), "world_size"),
        (lambda: RingGraph(0, 4, 2, 2), "local_rank"),
    ]
    for build, text in cases:
        with pytest.raises(ValueError) as info:
            build()
        assert text in str(info.value), (text, str(info.value))
    graph = RingGraph(0, 4)
    with pytest.raises(ValueError, match="cannot be served"):
        graph.peers_per_itr = 3
    graph.peers_per_itr = 2
    assert graph.out_peers(0) == [1, 3]
    with pytest.raises(TypeError, match="GraphManager"):
        UniformMixing("ring")


def test_get_peers_rotates_like_a_phone_book():
    graph = DynamicDirectedExponentialGraph(1, 4)
    assert graph.get_peers() == ([2], [0])
    assert graph.get_peers(rotate=True) == ([0], [2])
    assert graph.get_peers(rotate=True) == ([3], [3]) and graph.phase == 2
    ring = RingGraph(1, 4)
    assert ring.get_peers(rotate=True) == ([2], [0]) and ring.phase == 0


def test_uniform_mixing():
    graph = NPeerDynamicDirectedExponentialGraph(0, 4, peers_per_itr=3)
    mixing = UniformMixing(graph)
    assert mixing.shares([1, 2, 3]) == (0.25, [0.25] * 3)
    weights = mixing.get_mixing_weights(residual_adjusted=False)
    assert sorted(weights, key=str) == [1, 2, 3, "lo", "uniform"]
    assert all(float(w) == 0.25 for w in weights.values())
    assert float(mixing.get_mixing_weights()["uniform"]) == 1.0  # relative to the kept share
    assert mixing.is_uniform() and mixing.is_regular()


def _mixing_matrix(views, mixing_cls, t):
    """Column-stochastic A with A[j, i] the share of node i's mass that lands on node j at round t."""
    n = len(views)
    a = torch.zeros(n, n, dtype=torch.float64)
    for i, view in enumerate(views):
        outs = view.out_peers(t)
        kept, shares = mixing_cls(view).shares(outs)
        a[i, i] += kept
        for j, share in zip(outs, shares, strict=True):
            a[j, i] += share
    return a


def _disagreement(cls, nodes, rounds, ppi=1):
    """After each of `rounds` rounds: the spectral norm of (product of mixing matrices - exact averaging)."""
    views = _views(cls, nodes, ppi)
    product = torch.eye(nodes, dtype=torch.float64)
    average = torch.full_like(product, 1.0 / nodes)
    out = []
    for k in range(rounds):
        product = _mixing_matrix(views, UniformMixing, k) @ product
        assert torch.allclose(product.sum(0), torch.ones(nodes, dtype=torch.float64))  # no mass lost
        out.append(torch.linalg.matrix_norm(product - average, ord=2).item())
    return out


def _rounds_to_average(cls, nodes, ppi=1, limit=12):
    """The first k at which k rounds of the graph's mixing average every node exactly (None: not by `limit`)."""
    exact = [k + 1 for k, d in enumerate(_disagreement(cls, nodes, limit, ppi)) if d < 1e-12]
    return exact[0] if exact else None


def test_rate_of_consensus():
    """The exponential graph averages (p+1)^k nodes exactly in k rounds; the others as their schedules allow."""
    assert [_rounds_to_average(NPeerDynamicDirectedExponentialGraph, n) for n in (2, 4, 8, 16)] == [1, 2, 3, 4]
    assert _rounds_to_average(NPeerDynamicDirectedExponentialGraph, 9, ppi=2) == 2
    assert _rounds_to_average(NPeerDynamicDirectedExponentialGraph, 4, ppi=3) == 1
    assert _rounds_to_average(DynamicDirectedExponentialGraph, 4) == 3  # +1, -1, +2
    assert _rounds_to_average(DynamicDirectedExponentialGraph, 8) == 5  # +1, -1, +2, -2, +4
    assert _rounds_to_average(DynamicDirectedLinearGraph, 4, ppi=2) is None
    assert _rounds_to_average(RingGraph, 4) is None
    # the ones that only contract do so at the rate of their second eigenvalue: |1 + i| / 2 and 1/3 at four nodes
    ring = _disagreement(RingGraph, 4, 6)
    assert all(abs(d - (0.5**0.5) ** (k + 1)) < 1e-9 for k, d in enumerate(ring)), ring
    linear = _disagreement(DynamicDirectedLinearGraph, 4, 6, ppi=2)
    assert all(abs(d - 3.0 ** -(k + 1)) < 1e-9 for k, d in enumerate(linear)), linear
    for cls in GRAPH_CLASSES:
        assert _rounds_to_average(cls, 2) == 1, cls


# -- 2. gossip rounds among 4 processes (one per node) -----------------------------------------------------------

GOSSIP_CASES = [
    (NPeerDynamicDirectedExponentialGraph, 1),
    (NPeerDynamicDirectedExponentialGraph, 3),
    (DynamicDirectedExponentialGraph, 1),
    (DynamicBipartiteLinearGraph, 2),
    (RingGraph, 2),
    (_Star, 1),
]
GOSSIP_ROUNDS = 5
P = 37  # parameters in the gossiped buffer


def _start_values(world):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(world, P, generator=g)
    return torch.cat([x, torch.ones(world, 1)], dim=1)  # [x, w] per node


def _gossip_rounds(rank, world):
    from ddpkit.algorithms.push_sum import PushPull, PushSum
    from ddpkit.distributed import comm_stats

    out = {}
    for cls, ppi in GOSSIP_CASES:
        for gossiper_cls in (PushSum, PushPull):
            graph = cls(rank, world, peers_per_itr=ppi)
            try:
                gossiper = gossiper_cls(graph)
            except ValueError as exc:
                out[(cls.__name__, ppi, gossiper_cls.__name__)] = str(exc)
                continue
            buffer = _start_values(world)[rank].clone()
            history, counts, models = [], [], []
            for t in range(GOSSIP_ROUNDS):
                with comm_stats.measure() as delta:
                    before = buffer[:-1] / buffer[-1]
                    pending = gossiper.start(buffer, t)
                    models.append((buffer[:-1] / buffer[-1] - before).abs().max().item())  # x/w unchanged by sending
                    pending.finish(buffer)
                history.append(buffer.clone())
                counts.append({k: (c.calls, c.payload_bytes, c.sent_bytes) for k, c in delta.snapshot().items()})
            out[(cls.__name__, ppi, gossiper_cls.__name__)] = (torch.stack(history), counts, max(models))
    graph = RingGraph(rank, world)
    gossiper = PushSum(graph)
    buffer = _start_values(world)[rank].clone()
    gossiper.start(buffer, 0)
    try:
        gossiper.start(buffer, 1)
        out["twice"] = "no error"
    except RuntimeError as exc:
        out["twice"] = str(exc)
    gossiper._round.finish(buffer)
    out["posting_order"] = _posting_order(rank, world)
    return out


def _posting_order(rank, world):
    """The order in which one round posts its transfers, on a round where two nodes exchange with each other."""
    from ddpkit.algorithms.push_sum import PushSum

    graph = NPeerDynamicDirectedExponentialGraph(rank, world)  # round 1 at 4 nodes: r -> r + 2, pairwise
    assert graph.out_peers(1) == graph.in_peers(1)
    calls = []

    def recording(name, real):
        return lambda *args, **kwargs: calls.append(name) or real(*args, **kwargs)

    with (
        mock.patch.object(dist, "isend", recording("isend", dist.isend)),
        mock.patch.object(dist, "irecv", recording("irecv", dist.irecv)),
    ):
        buffer = _start_values(world)[rank].clone()
        PushSum(graph).start(buffer, 1).finish(buffer)
    return calls


def _simulate_gossip(cls, ppi, world, push_sum):
    """The rounds in one process: each node sends share * [x, w] to its out-peers, keeps kept * [x, w], adds."""
    views = [cls(r, world, peers_per_itr=ppi) for r in range(world)]
    buffers = list(_start_values(world))
    size = P + 1 if push_sum else P
    history = []
    for t in range(GOSSIP_ROUNDS):
        inbox = [[] for _ in range(world)]
        for r, view in enumerate(views):
            outs = view.out_peers(t)
            kept, shares = UniformMixing(view).shares(outs)
            for peer, share in zip(outs, shares, strict=True):
                inbox[peer].append((r, buffers[r][:size] * share))
            buffers[r] = buffers[r] * kept
        for r in range(world):
            received = [m for _, m in sorted(inbox[r], key=lambda item: item[0])]
            if received:
                total = received[0].clone()
                for m in received[1:]:
                    total += m
                buffers[r][:size] += total
            if not push_sum:
                buffers[r][-1] = 1.0
        history.append(torch.stack(buffers))
    return torch.stack(history)  # [rounds, nodes, P + 1]


def test_gossip_rounds_match_the_simulation_and_count_their_messages():
    from ddpkit.testing import run_distributed

    world = 4
    results = run_distributed(_gossip_rounds, world)
    start = _start_values(world)
    average = start[:, :-1].sum(0) / world
    for cls, ppi in GOSSIP_CASES:
        views = _views(cls, world, ppi)
        for push_sum in (True, False):
            key = (cls.__name__, ppi, "PushSum" if push_sum else "PushPull")
            if not push_sum and cls is _Star:
                assert all("push_sum=False (PushPull) needs a regular graph" in r[key] for r in results)
                continue
            expected = _simulate_gossip(cls, ppi, world, push_sum)
            got = torch.stack([results[r][key][0] for r in range(world)], dim=1)
            assert (got - expected).abs().max().item() < 1e-6, key
            totals = got.sum(1)  # over nodes: the numerators' and the weights' sums never change
            assert (totals[:, :-1] - start[:, :-1].sum(0)).abs().max().item() < 1e-5, key
            assert (totals[:, -1] - world).abs().max().item() < 1e-6, key
            if not push_sum:
                assert (got[:, :, -1] == 1.0).all(), key
            size = 4 * (P + 1 if push_sum else P)
            for r in range(world):
                assert results[r][key][2] < 1e-6, key  # sending leaves x / w as it was
                for t, counts in enumerate(results[r][key][1]):
                    outs, ins = views[r].out_peers(t), views[r].in_peers(t)
                    expected_counts = {("send", "world"): (len(outs), len(outs) * size, float(len(outs) * size))}
                    if ins:
                        expected_counts[("recv", "world")] = (len(ins), len(ins) * size, 0.0)
                    assert counts == expected_counts, (key, r, t, counts)
        rounds = {NPeerDynamicDirectedExponentialGraph: {1: 2, 3: 1}, DynamicDirectedExponentialGraph: {1: 3}}
        if cls in rounds:  # consensus: the exact average after the rounds the graph promises, not before
            k = rounds[cls][ppi]
            got = torch.stack([results[r][(cls.__name__, ppi, "PushSum")][0] for r in range(world)], dim=1)
            models = got[:, :, :-1] / got[:, :, -1:]
            assert (models[k - 1] - average).abs().max().item() < 1e-6, (cls, ppi)
            if k > 1:
                assert (models[k - 2] - average).abs().max().item() > 1e-2, (cls, ppi)
    star = torch.stack([results[r][("_Star", 1, "PushSum")][0] for r in range(world)], dim=1)
    assert (star[:, :, -1] - 1.0).abs().max().item() > 0.5  # irregular: the weights move, the model stays unbiased
    assert all("still in flight" in r["twice"] for r in results)
    # two nodes that send to each other in a round: gloo sends a send's data as soon as the peer's receive is
    # posted, ahead of anything queued after it on the same connection, so a node that posted its send first
    # announced its own receive only after its whole message: the two messages travelled one after the other (a
    # round at 2x the link time on 4 hosts at 100 Mbit/s, benchmarks/README.md#sgp). Receives go first.
    assert all(r["posting_order"] == ["irecv", "isend"] for r in results), [r["posting_order"] for r in results]


# -- 3. SlowMo + SGP against the single-process simulation, every graph, at 2 and 4 nodes and 2 nodes x 2 -------

LR = 0.1
STEPS = 10


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4))


def _batch(rank, step, n=6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _flat(params):
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def _cfg(graph, push_sum=True, overlap=False, slowmo=True, **kw):
    cfg = {"graph": graph, "ppi": 1, "push_sum": push_sum, "overlap": overlap, "synch": 0, "slowmo": slowmo}
    cfg.update(lf=3, sf=4, eff=True, avg=False, momentum=0.0)
    cfg.update(kw)
    return cfg


def _configs():
    """Every graph class x push_sum x overlap x SlowMo, with the other switches varied along the way."""
    out = []
    for i, cls in enumerate(GRAPH_CLASSES):
        for push_sum in (True, False):
            for overlap in (False, True):
                for slowmo in (False, True):
                    k = len(out)
                    extra = {"synch": 2 if overlap and k % 4 == 1 else 0, "eff": k % 3 != 0, "avg": k % 5 == 2}
                    extra["momentum"] = 0.5 if i % 2 else 0.0
                    out.append(_cfg(cls, push_sum, overlap, slowmo, **extra))
    out.append(_cfg(NPeerDynamicDirectedExponentialGraph, ppi=3, overlap=True))  # three peers (4 nodes only)
    out.append(_cfg(RingGraph, ppi=2, push_sum=False, avg=True))
    out.append(_cfg(None, overlap=True, synch=3))  # the default graph
    return out


SIM_CONFIGS = _configs()
LAYOUTS = [(2, 1), (4, 1), (4, 2)]  # (processes, processes per node)


def _served(cfg, nodes):
    return cfg["graph"] is None or _can_build(cfg["graph"], nodes, cfg["ppi"])


def _can_build(cls, nodes, ppi):
    try:
        cls(0, nodes, peers_per_itr=ppi)
    except ValueError:
        return False
    return True


def _wrap(module, cfg, n, groups=None):
    from ddpkit.nn import SlowMoDDP

    nodes = dist.get_world_size() // n
    graph = None
    if cfg["graph"] is not None:
        graph = cfg["graph"](dist.get_rank() // n, nodes, n, dist.get_rank() % n, peers_per_itr=cfg["ppi"])
    local, master = groups if groups is not None else (None, None)
    return SlowMoDDP(
        module,
        nprocs_per_node=n,
        slowmo_base_algorithm="sgp",
        graph=graph,
        push_sum=cfg["push_sum"],
        overlap=cfg["overlap"],
        synch_freq=cfg["synch"],
        slowmo_sgp_average_params=cfg["avg"],
        localsgd_frequency=cfg["lf"],
        slowmo_frequency=cfg["sf"],
        slowmo_momentum=0.7 if cfg["slowmo"] else 0.0,
        slowmo_lr=0.9 if cfg["slowmo"] else 1.0,
        slowmo_memory_efficient=cfg["eff"],
        local_node_group=local,
        master_group=master,
    )


def _node_groups(rank, world, n):
    """Every node's group and the masters' group, made once and reused by every configuration of a run."""
    locals_ = [dist.new_group(list(range(k * n, (k + 1) * n))) for k in range(world // n)]
    return locals_[rank // n], dist.new_group(list(range(0, world, n)))


def _counts(delta):
    return {key: (c.calls, c.payload_bytes) for key, c in delta.snapshot().items()}


def _step(model, opt, rank, step, traffic=None):
    """One training step and SlowMo's work after it (its CommStats appended to `traffic`); returns the model."""
    from ddpkit.distributed import comm_stats

    x, y = _batch(rank, step)
    F.mse_loss(model(x), y).backward()
    opt.step()
    model.zero_grad(set_to_none=True)
    with comm_stats.measure() as delta:
        model.perform_slowmo(opt)
    if traffic is not None:
        traffic.append(_counts(delta))
    return _flat(model.parameters())


def _train(rank, cfg, n, groups, steps=STEPS):
    """`steps` steps of SlowMo + SGP: the model and the push-sum weight after each, and each step's traffic."""
    model = _wrap(_mlp(), cfg, n, groups)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=cfg["momentum"])
    models, weights, counts = [], [], []
    for step in range(steps):
        models.append(_step(model, opt, rank, step, counts))
        weights.append(model.averager.weight)
    model.average_parameters()
    return torch.stack(models), torch.tensor(weights), counts, _flat(model.parameters())


def _simulation_runs(rank, world):
    out = {}
    for processes, n in LAYOUTS:
        if processes != world:
            continue
        groups = _node_groups(rank, world, n)
        for i, cfg in enumerate(SIM_CONFIGS):
            if _served(cfg, world // n):
                out[(n, i)] = _train(rank, cfg, n, groups)
    return out


def _simulate(cfg, world, n, steps=STEPS, variant=None):
    """SlowMo + SGP in one process, written from SGP's algorithm (Assran et al., Alg. 1 and overlap SGP).

    Node k holds one buffer [x, w] (numerators and push-sum weight) and trains the model x / w, its gradient the
    average of its ranks' gradients, its own base optimizer. After the optimizer's step the change of the model
    goes into the numerator (x += model - x / w). On an exact step (a slow step, or every lf steps with `avg`)
    the round in flight is mixed in, x becomes sum(x) / nodes (then slow momentum on a slow step) and w one;
    otherwise a gossip round of the next phase: each node sends share * [x, w] (PushPull: share * x) to its
    out-peers and keeps kept * [x, w]; the messages are added (in node order) at once, or with overlap `delay`
    steps later, the next round starting then. Returns the models and weights after every step, the phase each
    step started (None: no round) and the final average. `variant` shows that the comparison would catch another
    algorithm: "scaled" (the optimizer's step applied to x / w, not to x) or "phase" (the schedule one round ahead).
    """
    nodes, numel = world // n, sum(p.numel() for p in _mlp().parameters())
    cls, ppi = (cfg["graph"], cfg["ppi"]) if cfg["graph"] is not None else (NPeerDynamicDirectedExponentialGraph, 1)
    views = [cls(r, nodes, peers_per_itr=ppi) for r in range(nodes)] if nodes > 1 else []
    models = [_mlp() for _ in range(nodes)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=cfg["momentum"]) for m in models]
    bufs = [torch.cat([_flat(m.parameters()), torch.ones(1)]) for m in models]
    x0, u = bufs[0][:-1].clone(), torch.zeros(numel)
    size = numel + 1 if cfg["push_sum"] else numel
    delay, phase, age, inbox, flying = max(1, cfg["synch"]), 0, None, None, 0.0

    def finish():
        nonlocal flying
        flying = 0.0
        for r in range(nodes):
            received = [m for _, m in sorted(inbox[r], key=lambda item: item[0])]
            total = received[0].clone()
            for m in received[1:]:
                total += m
            bufs[r][:size] += total
            if not cfg["push_sum"]:
                bufs[r][-1] = 1.0

    def exact_average(slow):
        nonlocal x0, u, age
        if age is not None:
            finish()
            age = None
        mean = sum(b[:-1] for b in bufs) / nodes
        if slow:
            d = (x0 - mean) / LR
            u = 0.7 * u + d
            x0 = x0 - 0.9 * LR * u
            mean = x0.clone()
        for b in bufs:
            b[:-1], b[-1] = mean, 1.0

    history, weights, started, mass = [], [], [], []
    for step in range(steps):
        for node, (model, opt) in enumerate(zip(models, opts, strict=True)):
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for r in range(node * n, (node + 1) * n):
                model.zero_grad(set_to_none=True)
                F.mse_loss(model(_batch(r, step)[0]), _batch(r, step)[1]).backward()
                for g, p in zip(grads, model.parameters(), strict=True):
                    g.add_(p.grad / n)
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            opt.step()
            x, w = bufs[node][:-1], bufs[node][-1:]
            if variant == "scaled":
                x.copy_(_flat(model.parameters()) * w)
            else:
                x.add_(_flat(model.parameters()) - x / w)
        t, this_phase = step + 1, None
        slow = cfg["slowmo"] and t % cfg["sf"] == 0
        if slow or (cfg["avg"] and t % cfg["lf"] == 0):
            exact_average(slow)
        elif nodes > 1:
            if age is not None:
                age += 1
                if age >= delay:
                    finish()
                    age = None
            if age is None:
                inbox = [[] for _ in range(nodes)]
                for r, view in enumerate(views):
                    outs = view.out_peers(phase + 1 if variant == "phase" else phase)
                    kept, shares = UniformMixing(view).shares(outs)
                    for peer, share in zip(outs, shares, strict=True):
                        inbox[peer].append((r, bufs[r][:size] * share))
                        flying += share * bufs[r][-1].item()
                    bufs[r].mul_(kept)
                this_phase, phase, age = phase, phase + 1, 0
                if not cfg["overlap"]:
                    finish()
                    age = None
        started.append(this_phase)
        with torch.no_grad():
            for model, b in zip(models, bufs, strict=True):
                z, offset = b[:-1] / b[-1], 0
                for p in model.parameters():
                    p.copy_(z[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        history.append(torch.stack([b[:-1] / b[-1] for b in bufs]))
        weights.append(torch.stack([b[-1] for b in bufs]))
        mass.append(sum(b[-1].item() for b in bufs) + flying)
    exact_average(False)
    return torch.stack(history), torch.stack(weights), started, mass, bufs[0][:-1].clone()


def _check_against_simulation(results, world, n):
    nodes, checked = world // n, 0
    numel = sum(p.numel() for p in _mlp().parameters())
    for i, cfg in enumerate(SIM_CONFIGS):
        if not _served(cfg, nodes):
            continue
        checked += 1
        expected, weights, started, mass, final = _simulate(cfg, world, n)
        for rank in range(world):
            models, got_weights, counts, got_final = results[rank][(n, i)]
            node = rank // n
            assert (models - expected[:, node]).abs().max().item() < 1e-6, (cfg, world, n, rank)
            assert (got_weights - weights[:, node]).abs().max().item() < 1e-6, (cfg, world, n, rank)
            assert (got_final - final).abs().max().item() < 1e-6, (cfg, world, n, rank)
            assert torch.equal(got_final, results[0][(n, i)][3]), (cfg, rank)  # average_parameters: one model
            assert torch.equal(models, results[node * n][(n, i)][0]), (cfg, rank)  # one replica per node
            _check_traffic(cfg, counts, started, rank, n, world, numel)
        # push-sum mass: the nodes' weights and the weights in flight sum to the number of nodes, every step
        assert all(abs(m - nodes) < 1e-5 for m in mass), (cfg, mass)
        assert any(p is not None for p in started), cfg
        if cfg["overlap"]:  # a round in flight after some step: weights below one there
            assert weights.min().item() < 0.9, cfg
    return checked


def _check_traffic(cfg, counts, started, rank, n, world, numel):
    """Between nodes: each started round sends (out-degree) messages of P + 1 floats (PushPull: P), and on a
    gossip step nothing else crosses between nodes; inside a node, one broadcast of the buffer after a round."""
    nodes = world // n
    cls, ppi = (cfg["graph"], cfg["ppi"]) if cfg["graph"] is not None else (NPeerDynamicDirectedExponentialGraph, 1)
    view = cls(rank // n, nodes, peers_per_itr=ppi)
    local = (
        "world"
        if n == world
        else "ranks[" + ",".join(str(r) for r in range((rank // n) * n, (rank // n + 1) * n)) + "]"
    )
    message = 4 * (numel + 1 if cfg["push_sum"] else numel)
    for t, step_counts in enumerate(counts):
        between = {k: v for k, v in step_counts.items() if k[1] != local or n == 1}
        exact = (cfg["slowmo"] and (t + 1) % cfg["sf"] == 0) or (cfg["avg"] and (t + 1) % cfg["lf"] == 0)
        if exact:
            assert not any(kind in ("send", "recv") for kind, _ in between), (cfg, t, between)
            continue
        expected = {}
        if started[t] is not None and rank % n == 0:
            master = "world" if n == 1 else "ranks[" + ",".join(str(r) for r in range(0, world, n)) + "]"
            outs, ins = view.out_peers(started[t]), view.in_peers(started[t])
            expected = {("send", master): (len(outs), len(outs) * message)}
            expected[("recv", master)] = (len(ins), len(ins) * message)
        assert between == expected, (cfg, rank, t, between, expected)
        if n > 1:  # a started round (and the mixing of the previous one) changed the buffer: shared in the node
            inside = {k: v for k, v in step_counts.items() if k[1] == local}
            shared = {("broadcast", local): (1, 4 * (numel + 1))} if started[t] is not None else {}
            assert inside == shared, (cfg, rank, t, inside)


def test_the_simulation_tells_the_variants_apart():
    """The comparison above would catch the optimizer's step applied to x / w and a schedule off by one round."""
    cfg = _cfg(NPeerDynamicDirectedExponentialGraph, overlap=True, slowmo=False)
    expected = _simulate(cfg, 4, 1)[0]
    for variant in ("scaled", "phase"):
        assert (_simulate(cfg, 4, 1, variant=variant)[0] - expected).abs().max().item() > 1e-4, variant


@pytest.mark.parametrize("world", [4, 2])
def test_sgp_matches_the_simulation_at_every_step(world):
    from ddpkit.testing import run_distributed

    results = run_distributed(_simulation_runs, world)
    checked = sum(_check_against_simulation(results, world, n) for w, n in LAYOUTS if w == world)
    # at 2 nodes a graph cannot serve three peers, and a ring cannot serve two
    assert checked == (len(SIM_CONFIGS) - 2 if world == 2 else 2 * len(SIM_CONFIGS) - 2)


# -- 4. consensus, checkpoints, errors and no CUDA, on 4 processes ----------------------------------------------


def _consensus(rank, groups):
    """No gradient: each node's replica moved by (its node index) squared; gossip alone must reach the exact average."""
    out = {}
    for ppi in (1, 3):
        for overlap in (False, True):
            cfg = _cfg(NPeerDynamicDirectedExponentialGraph, ppi=ppi, overlap=overlap, slowmo=False)
            model = _wrap(_mlp(), cfg, 1, groups)
            opt = torch.optim.SGD(model.parameters(), lr=LR)  # no gradients: its steps change nothing
            start = _flat(model.parameters())
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(float(rank**2))
            models, weights = [], []
            for _ in range(4):
                model.perform_slowmo(opt)
                models.append(_flat(model.parameters()) - start)
                weights.append(model.averager.weight)
            out[(ppi, overlap)] = torch.stack(models), weights
    return out


def _checkpoint(model, opt):
    """The bytes torch.save writes (a snapshot: state dicts hold the live tensors)."""
    from test_slowmo import _saved

    return _saved({"model": model.state_dict(), "optimizer": opt.state_dict(), "slowmo": model.slowmo_state_dict()})


def _resume(rank, cfg, n, groups, total=11, stop=5):
    """`total` steps straight, against `stop` steps, a checkpoint, fresh objects and the remaining steps."""
    model = _wrap(_mlp(), cfg, n, groups)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=cfg["momentum"])
    straight, saved = [], None
    for step in range(total):
        if step == stop:
            saved = _checkpoint(model, opt)
        straight.append(_step(model, opt, rank, step))
    model2 = _wrap(_mlp(seed=7), cfg, n, groups)  # other initial values: everything must come from the checkpoint
    opt2 = torch.optim.SGD(model2.parameters(), lr=LR, momentum=cfg["momentum"])
    from test_slowmo import _loaded

    saved = _loaded(saved)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    model2.load_slowmo_state_dict(saved["slowmo"])
    resumed = [_step(model2, opt2, rank, step) for step in range(stop, total)]
    model.load_slowmo_state_dict(saved["slowmo"])  # into a model with a round in flight: it goes on gossiping
    _step(model, opt, rank, total)
    same = all(torch.equal(a, b) for a, b in zip(straight[stop:], resumed, strict=True))
    return same, sorted(saved["slowmo"]), saved["slowmo"]["sgp_phase"], saved["slowmo"]["sgp_buffer"][-1].item()


RESUME_CONFIGS = [
    _cfg(NPeerDynamicDirectedExponentialGraph, overlap=True, synch=2, sf=6, momentum=0.5),  # a round in flight
    _cfg(DynamicDirectedExponentialGraph, push_sum=False, overlap=True, sf=3, eff=False),
    _cfg(RingGraph, avg=True, lf=2, sf=7),
]


def _sgp_errors(rank, world):
    from test_slowmo import _error

    from ddpkit.nn import SlowMoDDP

    def sgp(n=1, **kwargs):
        return SlowMoDDP(_mlp(), nprocs_per_node=n, slowmo_base_algorithm="sgp", **kwargs)

    cases = {
        "graph_type": lambda: sgp(graph="ring"),
        "mixing_type": lambda: sgp(mixing=object()),
        "graph_for_4_nodes": lambda: sgp(n=2, graph=RingGraph(rank // 2, 4)),
        "graph_of_another_node": lambda: sgp(graph=RingGraph((rank + 1) % world, world)),
        "graph_on_one_node": lambda: sgp(n=4, graph=RingGraph(0, 2)),
        "mixing_of_another_graph": lambda: sgp(graph=RingGraph(rank, world), mixing=UniformMixing(RingGraph(rank, 4))),
        "push_pull_needs_push_sum": lambda: sgp(graph=_Star(rank, world), push_sum=False),
        "peers_per_itr": lambda: sgp(graph=RingGraph(rank, world, peers_per_itr=3)),
        "synch_freq_negative": lambda: sgp(synch_freq=-1),
        "synch_freq_float": lambda: sgp(synch_freq=1.5),
        "push_sum_not_bool": lambda: sgp(push_sum="yes"),
        "overlap_not_bool": lambda: sgp(overlap=1),
        "use_streams_not_bool": lambda: sgp(use_streams=None),
        "average_params_not_bool": lambda: sgp(slowmo_sgp_average_params="no"),
    }
    out = {label: _error(build) for label, build in cases.items()}
    model = sgp(slowmo_momentum=0.0)
    localsgd = SlowMoDDP(_mlp(), nprocs_per_node=1, slowmo_momentum=0.0)
    out["base_properties"] = [(m.sgp, m.localsgd) for m in (model, localsgd)]
    out["checkpoint_of_localsgd"] = _error(lambda: model.load_slowmo_state_dict(localsgd.slowmo_state_dict()))
    state = dict(model.slowmo_state_dict(), sgp_buffer=torch.ones(5))
    out["checkpoint_of_another_model"] = _error(lambda: model.load_slowmo_state_dict(state))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sgp(synch_freq=2)
    out["synch_without_overlap"] = [str(w.message) for w in caught]
    return out


def _no_cuda(rank, n, groups):
    """Trains overlap SGP with every torch.cuda entry point (and Tensor.cuda) replaced by one recording its call."""
    from test_slowmo import CUDA_FUNCTIONS

    calls = []

    def recorder(name):
        return lambda *args, **kwargs: calls.append(name)

    record = {name: recorder(name) for name in [*CUDA_FUNCTIONS, "Tensor"]}
    with mock.patch.multiple(torch.cuda, **{name: record[name] for name in CUDA_FUNCTIONS}):
        with mock.patch.object(torch.Tensor, "cuda", record["Tensor"]):
            _train(rank, _cfg(DynamicBipartiteExponentialGraph, overlap=True, sf=3), n, groups, steps=5)
    return calls


def _four_process_checks(rank, world):
    out = {"errors": _sgp_errors(rank, world)}
    for n in (1, 2):
        groups = _node_groups(rank, world, n)
        out[("resume", n)] = [_resume(rank, cfg, n, groups) for cfg in RESUME_CONFIGS]
        out[("cuda", n)] = _no_cuda(rank, n, groups)
        if n == 1:
            out["consensus"] = _consensus(rank, groups)
    return out


@pytest.fixture(scope="module")
def four_process_checks():
    from ddpkit.testing import run_distributed

    return run_distributed(_four_process_checks, 4)


def test_gossip_alone_reaches_the_exact_average(four_process_checks):
    shift = sum(r**2 for r in range(4)) / 4  # node r moved by r**2: no node is at the average early by chance
    for rank, out in enumerate(four_process_checks):
        for (ppi, overlap), (models, weights) in out["consensus"].items():
            rounds = 2 if ppi == 1 else 1  # log_{ppi + 1}(4)
            at = rounds + (1 if overlap else 0)  # overlap mixes each round one step later
            errors = (models - shift).abs().amax(dim=1)
            assert errors[at - 1].item() < 1e-6, (ppi, overlap, rank, errors)
            if at > 1:  # and not a step before
                assert errors[at - 2].item() > 0.1, (ppi, overlap, rank, errors)
            if overlap:  # the node keeps its share while the rest is in flight
                assert weights == [1.0 / (ppi + 1)] * 4, weights


def test_resume_continues_bit_for_bit(four_process_checks):
    for rank, out in enumerate(four_process_checks):
        for n in (1, 2):
            for cfg, (same, keys, phase, weight) in zip(RESUME_CONFIGS, out[("resume", n)], strict=True):
                assert same, (cfg, n, rank)
                assert {"num_updates", "sgp_age", "sgp_buffer", "sgp_phase"} <= set(keys), keys
                assert phase > 0
                if cfg is RESUME_CONFIGS[0]:  # the checkpoint holds a round in flight, on node masters its messages
                    assert ("sgp_received" in keys) == (rank % n == 0), (n, rank, keys)
                    assert weight == 0.5


def test_clear_errors_before_any_collective(four_process_checks):
    expected = {
        "graph_type": ("TypeError", "graph must be a ddpkit GraphManager"),
        "mixing_type": ("TypeError", "mixing must be a ddpkit MixingManager"),
        "graph_for_4_nodes": ("ValueError", "built for node"),
        "graph_of_another_node": ("ValueError", "but this rank is on node"),
        "graph_on_one_node": ("ValueError", "of 2 nodes, but this rank is on node 0 of 1"),
        "mixing_of_another_graph": ("ValueError", "mixing was built for another graph"),
        "push_pull_needs_push_sum": ("ValueError", "push_sum=False (PushPull) needs a regular graph"),
        "peers_per_itr": ("ValueError", "peers_per_itr=3 cannot be served"),
        "synch_freq_negative": ("ValueError", "synch_freq must be an int >= 0"),
        "synch_freq_float": ("ValueError", "synch_freq must be an int >= 0"),
        "push_sum_not_bool": ("TypeError", "push_sum must be a bool"),
        "overlap_not_bool": ("TypeError", "overlap must be a bool"),
        "use_streams_not_bool": ("TypeError", "use_streams must be a bool"),
        "average_params_not_bool": ("TypeError", "slowmo_sgp_average_params must be a bool"),
        "checkpoint_of_localsgd": ("ValueError", "has no SGP state"),
        "checkpoint_of_another_model": ("ValueError", "SGP buffer has 5 elements"),
    }
    for out in four_process_checks:
        errors = out["errors"]
        for label, (kind, text) in expected.items():
            got_kind, message, collectives = errors[label]
            assert (got_kind, collectives) == (kind, []), (label, errors[label])
            assert text in message, (label, message)
        assert errors["base_properties"] == [(True, False), (False, True)]  # (sgp, localsgd) of SGP, local SGD
        assert errors["synch_without_overlap"] == [
            "SlowMoDistributedDataParallel: synch_freq only takes effect with overlap=True"
        ]


def test_no_cuda_call_on_the_cpu_path(four_process_checks):
    assert all(out[("cuda", n)] == [] for out in four_process_checks for n in (1, 2))
