"""SGP (stochastic gradient push) under SlowMo: graphs, mixing, gossip rounds and training on 2 and 4 gloo ranks.

The graphs and the mixing are plain Python and are checked directly: their schedules, regularity, the rate at
which their mixing matrices reach the average. The gossip and SlowMo's SGP are checked against a single-process
simulation of the nodes written from SGP's algorithm, through CommStats, across a checkpoint and on the error
paths. Each spawned run covers many settings at once and returns numbers; the assertions are made here.
"""

import pytest
import torch

from ddpkit.distributed.gossip_graphs import (
    GRAPHS,
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphManager,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)
from ddpkit.distributed.gossip_mixing import UniformMixing

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
    from ddpkit.distributed import comm_stats
    from ddpkit.distributed.gossip import PushPull, PushSum

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
    return out


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
