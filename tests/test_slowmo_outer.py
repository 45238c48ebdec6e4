"""SlowMo over slow links (`ddpkit.algorithms.pseudo_gradient`): compressed pseudo-gradients, fragments, delay;
2 and 4 ranks.

Against a single-process simulation of the nodes written out from the formulas of SlowMoDistributedDataParallel's
docstring, message for message (the quantised chunks each node master sent and owned are those
`simulate_messages` computes from its inputs), through CommStats, with error feedback, across a checkpoint taken
with syncs in flight, without a CUDA call on the CPU path, and on the error paths. Each spawned run covers many
settings and returns numbers; the assertions are made here, in the parent.
"""

import io
import itertools
import warnings
from contextlib import contextmanager

import torch
from test_slowmo import CUDA_FUNCTIONS, _batch, _error, _flat, _local_step, _mlp, _optimizer, _scheduler
from test_slowmo import _wrap as slowmo_wrap
from torch.nn import functional as F

from ddpkit.algorithms import pseudo_gradient as outer_sync
from ddpkit.algorithms.compressed_mean import simulate_messages
from ddpkit.algorithms.pseudo_gradient import fragment_bounds
from ddpkit.algorithms.quantize import dequantize, payload_bytes, quantize, to_bytes
from ddpkit.distributed import comm_stats
from ddpkit.distributed.agreement import RanksDisagree
from ddpkit.nn import SlowMoBaseAlgorithm, SlowMoDDP
from ddpkit.testing import run_distributed

TOL = 1e-6
STEPS = 12


def _cfg(n, lf, sf, compression="int8", k=1, tau=0, **kw):
    cfg = {
        "n": n,
        "lf": lf,
        "sf": sf,
        "compression": compression,
        "block": 8,
        "k": k,
        "tau": tau,
        "ef": False,
        "beta": 0.7,
        "alpha": 0.9,
        "nesterov": False,
        "merge": 0.5,
        "base_momentum": 0.0,
        "sched": False,
    }
    cfg.update(kw)
    return cfg


def _wrap(module, cfg):
    names = ("compression", "compression_block", "error_feedback", "fragments", "sync_delay", "merge_alpha")
    values = (cfg["compression"], cfg["block"], cfg["ef"], cfg["k"], cfg["tau"], cfg["merge"])
    return slowmo_wrap(
        module, {"eff": True, "shards": 32, **cfg}, **{f"slowmo_{k}": v for k, v in zip(names, values, strict=True)}
    )


def _slowmo_on(cfg):
    return cfg["alpha"] != 1.0 or cfg["beta"] != 0.0


def _sizes():
    return [p.numel() for p in _mlp().parameters()]


# -- the single-process reference ---------------------------------------------------------------------------------


def _starts(cfg, t):
    """The documented schedule: fragment j starts a sync after step t when (t + s_j) % H == 0 (or, SlowMo on,
    (t + s_j) % slowmo_frequency == 0, a slow step), s_j = H - (j + 1) H // K."""
    h, k = cfg["lf"], cfg["k"]
    out = []
    for j in range(k):
        clock = t + h - (j + 1) * h // k
        slow = _slowmo_on(cfg) and clock % cfg["sf"] == 0
        if slow or clock % h == 0:
            out.append((j, slow))
    return out


class _Nodes:
    """The nodes of a run in one process: a replica and an optimizer per node, the synchronised copy g, x0, u,
    every node's residual, the syncs in flight; what was meant and sent, per sync."""

    def __init__(self, world, cfg):
        self.cfg, self.n, self.count = cfg, cfg["n"], world // cfg["n"]
        self.models = [_mlp() for _ in range(self.count)]
        self.opts = [_optimizer(m.parameters(), cfg) for m in self.models]
        self.scheds = [_scheduler(o, cfg) for o in self.opts]
        self.bounds = fragment_bounds(_sizes(), cfg["k"])
        self.g = _flat(self.models[0].parameters())
        self.x0, self.u = self.g.clone(), torch.zeros_like(self.g)
        self.residual = [torch.zeros_like(self.g) for _ in range(self.count)]
        self.keep_residual = cfg["ef"] and cfg["compression"] != "none" and self.count > 1
        self.flights, self.syncs, self.starts = {}, [], []

    def train_step(self, step):
        for node, (model, opt) in enumerate(zip(self.models, self.opts, strict=True)):
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for r in range(node * self.n, (node + 1) * self.n):
                model.zero_grad(set_to_none=True)
                x, y = _batch(r, step)
                F.mse_loss(model(x), y).backward()
                for g, p in zip(grads, model.parameters(), strict=True):
                    g.add_(p.grad / self.n)
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            opt.step()

    def sync(self, t):
        cfg = self.cfg
        lr = self.opts[0].param_groups[0]["lr"]
        xs = [_flat(m.parameters()) for m in self.models]
        for j in sorted(j for j, f in self.flights.items() if f[0] + cfg["tau"] == t):
            self._merge(xs, j)
        starts = _starts(cfg, t)
        self.starts.append([j for j, _ in starts])
        for j, slow in starts:
            self._start(xs, j, t, slow, lr)
            if cfg["tau"] == 0:
                self._merge(xs, j)
        with torch.no_grad():
            for model, x in zip(self.models, xs, strict=True):
                torch.nn.utils.vector_to_parameters(x, model.parameters())
        for s in self.scheds:
            s.step()
        return torch.stack(xs)

    def _start(self, xs, j, t, slow, lr):
        a, b = self.bounds[j]
        c, block = self.cfg["compression"], self.cfg["block"]
        meant = [self.g[a:b] - x[a:b] for x in xs]  # each node's pseudo-gradient
        ds = [m + e[a:b] for m, e in zip(meant, self.residual, strict=True)] if self.keep_residual else meant
        if self.keep_residual:
            for d, e in zip(ds, self.residual, strict=True):
                e[a:b] = d - dequantize(quantize(d, c, block))
        if self.count > 1:
            sent, owners = simulate_messages(ds, c, block)
            mean = torch.cat([dequantize(q) for q in owners])
            self.syncs.append({"j": j, "inputs": ds, "meant": meant, "sent": sent})
        else:
            mean = ds[0]
        self.flights[j] = (t, slow, lr, mean)

    def _merge(self, xs, j):
        _, slow, lr, mean = self.flights.pop(j)
        a, b = self.bounds[j]
        g, cfg = self.g[a:b], self.cfg
        g.sub_(mean)
        if slow:  # u = beta u + (x0 - g)/lr; x0 -= alpha lr u (Nesterov: alpha lr (d + beta u)); g = x0
            x0, u = self.x0[a:b], self.u[a:b]
            d = (x0 - g).div_(lr)
            u.mul_(cfg["beta"]).add_(d)
            x0.sub_(d.add_(u, alpha=cfg["beta"]) if cfg["nesterov"] else u, alpha=cfg["alpha"] * lr)
            g.copy_(x0)
        for x in xs:
            if cfg["tau"]:
                x[a:b].mul_(cfg["merge"]).add_(g, alpha=1.0 - cfg["merge"])
            else:
                x[a:b].copy_(g)


def _simulate(world, cfg, steps):
    """Runs with one intra-op thread, as every rank of `run_distributed` does: with more, a matrix product may sum
    in another order (MKL also lowers its thread count when the machine is loaded), and a last-bit difference can
    flip a quantiser's rounding, seen as a bf16 message 4e-6 off under load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        nodes = _Nodes(world, cfg)
        history = []
        for step in range(steps):
            nodes.train_step(step)
            history.append(nodes.sync(step + 1))
    finally:
        torch.set_num_threads(threads)
    return torch.stack(history), nodes  # [steps, nodes, P]


# -- one run on a rank --------------------------------------------------------------------------------------------


class _Recorder:
    """Stands in for `outer_sync.start_compressed_mean`: starts the real one and keeps its input and messages."""

    def __init__(self, start):
        self.start, self.calls = start, []

    def __call__(self, flat, group, compression, block):
        pending = self.start(flat, group, compression, block)
        self.calls.append((flat.clone(), pending))
        return pending

    def messages(self):
        out = []
        for flat, pending in self.calls:
            pending.wait()
            sent = [to_bytes(q) for q in pending.sent]
            scales = torch.cat([q.scales for q in pending.sent]) if pending.sent[0].scales is not None else None
            out.append(
                {
                    "input": flat,
                    "sent": sent,
                    "owner": to_bytes(pending.owner),
                    "scales": scales,
                    "sent_values": pending.sent_values(),
                }
            )
        return out


@contextmanager
def _recording():
    recorder = _Recorder(outer_sync.start_compressed_mean)
    outer_sync.start_compressed_mean = recorder
    try:
        yield recorder
    finally:
        outer_sync.start_compressed_mean = recorder.start


def _counts(delta):
    return {key: (c.calls, c.payload_bytes, c.sent_bytes) for key, c in delta.snapshot().items()}


def _train(model, opt, sched, rank, step):
    """One step and SlowMo's work after it; its CommStats without the gradients' all-reduce inside a node."""
    with comm_stats.measure() as delta:
        params = _local_step(model, opt, sched, rank, step)
    return params, {key: v for key, v in _counts(delta).items() if key[0] != "all_reduce"}


def _run(rank, cfg, steps=STEPS):
    with _recording() as recorder:
        model = _wrap(_mlp(), cfg)
        opt = _optimizer(model.parameters(), cfg)
        sched = _scheduler(opt, cfg)
        history, stats = zip(*(_train(model, opt, sched, rank, step) for step in range(steps)), strict=True)
        return {
            "params": torch.stack(history),
            "stats": list(stats),
            "messages": recorder.messages(),
            "synced": model.averager.synced.clone(),
        }


# -- 1. against the simulation, message for message, and CommStats -------------------------------------------------

CONFIGS = {
    4: [
        _cfg(1, 4, 8, "int8", k=1, tau=0, block=64),
        _cfg(1, 4, 4, "int4", k=2, tau=1, ef=True, nesterov=True, beta=0.9, alpha=0.7),
        _cfg(1, 4, 8, "bf16", k=4, tau=2, beta=0.0, alpha=1.0),  # plain local SGD
        _cfg(2, 4, 8, "int8", k=2, tau=2, ef=True, base_momentum=0.9),  # 2 nodes x 2 processes
        _cfg(2, 3, 6, "none", k=1, tau=1, nesterov=True, sched=True),
        _cfg(1, 4, 6, "int4", k=1, tau=0, nesterov=True, base_momentum=0.9),  # slow steps off the period
        _cfg(1, 4, 4, "none", k=4, tau=0, sched=True, base_momentum=0.9),
        _cfg(1, 4, 4, "int4", k=2, tau=1, nesterov=True, beta=0.9, alpha=0.7),  # the above without error feedback
    ],
    2: [
        _cfg(1, 3, 6, "int4", k=1, tau=2, ef=True, block=16),
        _cfg(1, 4, 8, "int8", k=4, tau=1, nesterov=True, sched=True),
        _cfg(2, 4, 8, "int8", k=2, tau=1),  # one node: nothing between nodes
        _cfg(1, 2, 4, "bf16", k=2, tau=0, ef=True, base_momentum=0.9),
    ],
}
EF_PAIR = (1, 7)  # CONFIGS[4]: the same run with and without error feedback


@contextmanager
def _cuda_forbidden():
    """Every torch.cuda function test_slowmo lists records its name instead of running, for the block."""
    calls, saved = [], {name: getattr(torch.cuda, name) for name in CUDA_FUNCTIONS}
    for name in CUDA_FUNCTIONS:
        setattr(torch.cuda, name, lambda *args, _name=name, **kwargs: calls.append(_name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


def _runs(rank, world):
    with warnings.catch_warnings(), _cuda_forbidden() as cuda_calls:  # the one-node warning: the pool is reused
        warnings.simplefilter("ignore")
        runs = [_run(rank, cfg) for cfg in CONFIGS[world]]
    assert cuda_calls == [], cuda_calls  # the CPU path calls no CUDA function
    return runs


def _check_params(world, cfg, runs, expected, nodes):
    n = cfg["n"]
    params = torch.stack([r["params"] for r in runs])  # [ranks, steps, P]
    for rank in range(world):
        diff = (params[rank] - expected[:, rank // n]).abs().amax(dim=1)
        assert diff.max().item() < TOL, (cfg, rank, diff.tolist())
    for r in range(world):  # the synchronised copy: the same bits everywhere
        assert torch.equal(runs[r]["synced"], runs[0]["synced"]), (cfg, r)
    differ = False
    for t, starts in enumerate(nodes.starts, start=1):
        after = params[:, t - 1]
        if cfg["tau"] == 0:  # a sync replaces a fragment by g, on every rank alike
            for j in starts:
                a, b = nodes.bounds[j]
                assert all(torch.equal(after[r, a:b], after[0, a:b]) for r in range(world)), (cfg, t, j)
        differ |= (after[-1] - after[0]).abs().max().item() > 1e-4
    assert differ or nodes.count == 1, cfg  # the nodes do train apart between syncs


def _check_messages(cfg, runs, nodes):
    """Every node master's messages are `simulate_messages` of the inputs it had, which are the simulation's."""
    masters = range(0, len(runs), cfg["n"])
    for k, rank in enumerate(masters):
        got = runs[rank]["messages"]
        assert len(got) == len(nodes.syncs), (cfg, rank)
        for i, (m, sync) in enumerate(zip(got, nodes.syncs, strict=True)):
            assert (m["input"] - sync["inputs"][k]).abs().max().item() < TOL, cfg
            inputs = [runs[r]["messages"][i]["input"] for r in masters]
            sent, owners = simulate_messages(inputs, cfg["compression"], cfg["block"])
            assert all(torch.equal(x, to_bytes(q)) for x, q in zip(m["sent"], sent[k], strict=True)), cfg
            assert torch.equal(m["owner"], to_bytes(owners[k])), cfg
    for rank in range(len(runs)):
        if rank % cfg["n"]:
            assert runs[rank]["messages"] == [], (cfg, rank)  # only node masters talk between nodes


def _check_bytes(world, cfg, runs, nodes):
    """Per step: between node masters exactly the quantised payload of the fragments started (at most 2(N-1)/N of
    it per master, plus (N-2) blocks' bytes on a master that owns a longer chunk; 2(N-1) of it over the masters);
    inside a node the fp32 broadcast of each fragment merged; no step above 1/K of the model + a tensor + scales."""
    n, count, c, block = cfg["n"], nodes.count, cfg["compression"], cfg["block"]
    master = "world" if n == 1 else "ranks[" + ",".join(str(r) for r in range(0, world, n)) + "]"
    merges = _merges(cfg, nodes)
    biggest, sizes = 0, _sizes()
    for t, starts in enumerate(nodes.starts, start=1):
        quantised = sum(payload_bytes(nodes.bounds[j][1] - nodes.bounds[j][0], c, block) for j in starts)
        biggest = max(biggest, quantised)
        sent_total = 0.0
        for rank, run in enumerate(runs):
            stats = run["stats"][t - 1]
            expected_keys = set()
            if rank % n == 0 and starts and count > 1:
                calls, payload, sent = stats[("all_to_all", master)]
                assert (calls, payload) == (len(starts), quantised), (cfg, t, rank)
                gather = stats[("all_gather", master)]
                sent += gather[2]
                assert sent <= 2 * (count - 1) / count * quantised + (count - 2) * payload_bytes(block, c, block)
                sent_total += sent
                expected_keys |= {("all_to_all", master), ("all_gather", master)}
            if n > 1 and count > 1 and merges[t]:
                node = "ranks[" + ",".join(str(r) for r in range(rank // n * n, rank // n * n + n)) + "]"
                fp32 = sum(4 * (nodes.bounds[j][1] - nodes.bounds[j][0]) for j in merges[t])
                assert stats[("broadcast", node)][:2] == (len(merges[t]), fp32), (cfg, t, rank)
                expected_keys.add(("broadcast", node))
            assert set(stats) == expected_keys, (cfg, t, rank, stats)
        if starts and count > 1:
            assert sent_total == 2 * (count - 1) * quantised, (cfg, t)
    if cfg["k"] > 1 and count > 1:
        whole = payload_bytes(sum(sizes), c, block)
        assert biggest <= whole / cfg["k"] + payload_bytes(max(sizes), c, block) + 4 * cfg["k"], (cfg, biggest)


def _merges(cfg, nodes):
    merges = {t: [] for t in range(1, STEPS + 1)}
    for t, starts in enumerate(nodes.starts, start=1):
        if t + cfg["tau"] <= STEPS:
            merges[t + cfg["tau"]] += starts
    return merges


def _check_world(world):
    results = run_distributed(_runs, world)
    for i, cfg in enumerate(CONFIGS[world]):
        expected, nodes = _simulate(world, cfg, STEPS)
        runs = [results[r][i] for r in range(world)]
        _check_params(world, cfg, runs, expected, nodes)
        _check_messages(cfg, runs, nodes)
        _check_bytes(world, cfg, runs, nodes)
    return results


def test_four_ranks_match_the_simulation_message_for_message():
    results = _check_world(4)
    _check_error_feedback([results[r][EF_PAIR[0]] for r in range(4)], [results[r][EF_PAIR[1]] for r in range(4)])


def test_two_ranks_match_the_simulation_message_for_message():
    _check_world(2)


def _check_error_feedback(with_ef, without):
    """With error feedback, per fragment and node, the running sum of what was sent stays within one quantisation
    step (the last message's block scale) of the running sum of what was meant; without it the gap grows past."""
    cfg_ef, cfg_plain = CONFIGS[4][EF_PAIR[0]], CONFIGS[4][EF_PAIR[1]]
    gaps = {}
    for runs, cfg in ((with_ef, cfg_ef), (without, cfg_plain)):
        _, nodes = _simulate(4, cfg, STEPS)
        worst = 0.0
        for rank, run in enumerate(runs):
            totals = {}
            for m, sync in zip(run["messages"], nodes.syncs, strict=True):
                meant, sent = sync["meant"][rank], m["sent_values"]
                total_meant, total_sent = totals.get(sync["j"], (0.0, 0.0))
                totals[sync["j"]] = (total_meant + meant, total_sent + sent)
                step = m["scales"].repeat_interleave(cfg["block"])[: meant.numel()]
                gap = (totals[sync["j"]][0] - totals[sync["j"]][1]).abs()
                worst = max(worst, (gap - step).max().item())
        gaps[cfg["ef"]] = worst
    assert gaps[True] <= TOL, gaps
    assert gaps[False] > 10 * TOL, gaps  # the same bound fails without error feedback


def test_fragments_are_balanced_whole_tensors_where_possible():
    gpt_like = [65536, 128, 4096, 128, 49152, 384, 16384, 128, 65536, 512, 65536, 128] * 4 + [256 * 128]
    for sizes in (gpt_like, _sizes(), [1000], [3, 5, 7, 11, 13]):
        total, largest = sum(sizes), max(sizes)
        for k in (1, 2, 3, 4, 8):
            if k > total:
                continue
            bounds = fragment_bounds(sizes, k)
            assert bounds[0][0] == 0 and bounds[-1][1] == total and len(bounds) == k
            assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))
            assert max(b - a for a, b in bounds) <= total / k + largest, (sizes, k, bounds)
            assert max(b - a for a, b in bounds) <= 1.5 * total / k + 1, (sizes, k, bounds)
    bounds = fragment_bounds(gpt_like, 4)
    assert all(b in set(itertools.accumulate(gpt_like)) for _, b in bounds)  # whole tensors here
    assert fragment_bounds([1000], 4) == [(0, 250), (250, 500), (500, 750), (750, 1000)]  # one tensor: split


def _library_starts(cfg, t):
    """What `OuterSync.starting` itself says for these settings (the object the wrapper builds, not this file's
    reading of the documented schedule)."""
    from types import SimpleNamespace

    from ddpkit.algorithms.pseudo_gradient import OuterSync, OuterSyncSettings

    settings = OuterSyncSettings(compression=cfg["compression"], block=cfg["block"], fragments=cfg["k"])
    slowmo_frequency = cfg["sf"] if _slowmo_on(cfg) else None
    sync = OuterSync(torch.zeros(64), [64], settings, SimpleNamespace(num_nodes=1), None, (cfg["lf"], slowmo_frequency))
    return sync.starting(t)


def test_the_schedule_staggers_the_fragments():
    # the library's schedule is the documented one (this test used to check its own helper only)
    for cfg in (_cfg(1, 4, 8, k=2), _cfg(1, 4, 4, k=4), _cfg(1, 3, 6, k=1), _cfg(1, 6, 12, k=3)):
        assert [_library_starts(cfg, t) for t in range(1, 25)] == [_starts(cfg, t) for t in range(1, 25)], cfg
    cfg = _cfg(1, 4, 8, k=2)
    assert [t for t in range(1, 13) if _starts(cfg, t)] == [2, 4, 6, 8, 10, 12]
    assert [t for t in range(1, 13) if (0, False) in _starts(cfg, t)] == [2, 10]
    assert [t for t in range(1, 13) if (0, True) in _starts(cfg, t)] == [6]
    assert [t for t in range(1, 13) if (1, True) in _starts(cfg, t)] == [8]
    cfg = _cfg(1, 4, 4, k=4)
    assert [[j for j, _ in _starts(cfg, t)] for t in range(1, 5)] == [[0], [1], [2], [3]]
    assert _starts(_cfg(1, 3, 6, k=1), 3) == [(0, False)] and _starts(_cfg(1, 3, 6, k=1), 6) == [(0, True)]


# -- 2. resume with syncs in flight ---------------------------------------------------------------------------------

RESUME_CONFIGS = [  # stop after step 5: fragment 0 started at 5 / fragment 1 started at 4 and merges at 6
    _cfg(1, 4, 4, "int4", k=4, tau=1, ef=True, nesterov=True, base_momentum=0.9),
    _cfg(2, 4, 8, "int8", k=2, tau=2, ef=True, base_momentum=0.9, sched=True),
]


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loaded(data):  # a fresh copy per use: a loaded optimizer state shares its tensors with the dict it came from
    return torch.load(io.BytesIO(data), weights_only=False)


def _resume(rank, world, cfg, total=10, stop=5):
    model = _wrap(_mlp(), cfg)
    opt = _optimizer(model.parameters(), cfg)
    sched = _scheduler(opt, cfg)
    straight = []
    for step in range(total):
        if step == stop:
            in_flight = sorted(model.averager.in_flight)
            saved = {"model": model.state_dict(), "slowmo": model.slowmo_state_dict()}
            checkpoint = _saved(
                {**saved, "module": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
            )
        straight.append(_train(model, opt, sched, rank, step)[0])
    out = {"in_flight": in_flight}
    for via in ("state_dict", "slowmo_state_dict"):
        saved = _loaded(checkpoint)
        model2 = _wrap(_mlp(seed=7), cfg)
        if via == "state_dict":
            model2.load_state_dict(saved["model"])
        else:
            model2.module.load_state_dict(saved["module"])
            model2.load_slowmo_state_dict(saved["slowmo"])
        opt2 = _optimizer(model2.parameters(), cfg)
        sched2 = _scheduler(opt2, cfg)  # (it sets the lr: built before the optimizer's state is loaded)
        opt2.load_state_dict(saved["opt"])
        sched2.load_state_dict(saved["sched"])
        resumed = [_train(model2, opt2, sched2, rank, step)[0] for step in range(stop, total)]
        out[via] = all(torch.equal(a, b) for a, b in zip(straight[stop:], resumed, strict=True))
    return out


def _resumes(rank, world):
    return [_resume(rank, world, cfg) for cfg in RESUME_CONFIGS]


def test_resume_with_syncs_in_flight_continues_bit_for_bit():
    for rank, outs in enumerate(run_distributed(_resumes, 4)):
        assert outs[0]["in_flight"] == [0] and outs[1]["in_flight"] == [1], (rank, outs)
        for out in outs:
            assert out["state_dict"] and out["slowmo_state_dict"], (rank, out)


# -- 3. errors ----------------------------------------------------------------------------------------------------


def _errors(rank, world):
    def build(**kw):
        return lambda: SlowMoDDP(_mlp(), nprocs_per_node=1, localsgd_frequency=4, slowmo_frequency=8, **kw)

    cases = {
        "unknown_compression": build(slowmo_compression="fp8"),
        "block_zero": build(slowmo_compression="int8", slowmo_compression_block=0),
        "int4_odd_block": build(slowmo_compression="int4", slowmo_compression_block=7),
        "fragments_zero": build(slowmo_fragments=0),
        "fragments_above_period": build(slowmo_fragments=5),
        "delay_at_period": build(slowmo_sync_delay=4),
        "delay_negative": build(slowmo_sync_delay=-1),
        "delay_off_period": lambda: SlowMoDDP(
            _mlp(), nprocs_per_node=1, localsgd_frequency=4, slowmo_frequency=6, slowmo_sync_delay=1
        ),
        "alpha_above_one": build(slowmo_sync_delay=1, slowmo_merge_alpha=1.5),
        "feedback_not_bool": build(slowmo_error_feedback="yes"),
        "with_sgp": build(slowmo_compression="int8", slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP),
    }
    out = {label: _error(fn) for label, fn in cases.items()}
    try:
        SlowMoDDP(_mlp(), nprocs_per_node=1, slowmo_compression="int8" if rank == 0 else "int4")
        out["disagree"] = ""
    except RanksDisagree as exc:
        out["disagree"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SlowMoDDP(_mlp(), nprocs_per_node=1, localsgd_frequency=4, slowmo_error_feedback=True)
    out["idle"] = [str(w.message) for w in caught]
    return out


def test_bad_settings_fail_before_any_collective():
    expected = {
        "unknown_compression": ("ValueError", "slowmo_compression must be one of none, bf16, int8, int4"),
        "block_zero": ("ValueError", "slowmo_compression_block"),
        "int4_odd_block": ("ValueError", "even"),
        "fragments_zero": ("ValueError", "slowmo_fragments must be an int >= 1"),
        "fragments_above_period": ("ValueError", "slowmo_fragments=5 must be at most localsgd_frequency=4"),
        "delay_at_period": ("ValueError", "slowmo_sync_delay=4 must be smaller than the period"),
        "delay_negative": ("ValueError", "slowmo_sync_delay must be an int >= 0"),
        "delay_off_period": ("ValueError", "multiple of localsgd_frequency"),
        "alpha_above_one": ("ValueError", "slowmo_merge_alpha must be in [0, 1]"),
        "feedback_not_bool": ("TypeError", "slowmo_error_feedback must be a bool"),
        "with_sgp": ("ValueError", "LOCALSGD"),
    }
    for out in run_distributed(_errors, 2):
        for label, (kind, text) in expected.items():
            got_kind, message, collectives = out[label]
            assert got_kind == kind and text in message, (label, out[label])
            assert collectives == [], (label, collectives)
        assert "slowmo_compression: int8 on rank 0; int4 on rank 1" in out["disagree"], out["disagree"]
        assert any("slowmo_error_feedback" in m and "no effect" in m for m in out["idle"]), out["idle"]


def test_the_simulation_tells_the_settings_apart():
    """Each setting changes the trajectory the runs are compared with (so the comparisons above can fail)."""
    base = _cfg(1, 4, 8, "int4", k=2, tau=1, ef=True, nesterov=True)
    reference = _simulate(4, base, STEPS)[0]
    for change in ({"merge": 0.0}, {"ef": False}, {"compression": "none"}, {"k": 1}, {"tau": 0}, {"nesterov": False}):
        other = _simulate(4, {**base, **change}, STEPS)[0]
        assert (other - reference).abs().max().item() > 1e-4, change
