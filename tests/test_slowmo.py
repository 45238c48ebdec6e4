"""SlowMoDistributedDataParallel on 2 and 4 gloo ranks.

Against torch's DDP, against a single-process simulation of the workers (local SGD + slow momentum written out
from the paper's formulas), through the CommStats counts, across a checkpoint, and on the error paths. Each
spawned run covers many settings at once and returns numbers; the assertions are made here, in the parent.
"""

import copy
import io
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import comm_stats
from ddpkit.nn import SlowMoBaseAlgorithm, SlowMoDDP, SlowMoDistributedDataParallel
from ddpkit.testing import run_distributed

TOL = 1e-6  # against torch's DDP and against the simulation
EXACT = 1e-7  # replicas of one another, resumed run against the uninterrupted one
LR = 0.1
STEPS = 12


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))


def _with_norm(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _batch(rank, step, n=6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _flat(params):
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def _param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- settings ---------------------------------------------------------------------------------------------------


def _cfg(n, lf, sf, **kw):
    """One SlowMo setting. `base_momentum`: SGD momentum of the base optimizer; `sched`: an lr changing each step."""
    cfg = {
        "n": n,
        "lf": lf,
        "sf": sf,
        "beta": 0.7,
        "alpha": 0.9,
        "eff": True,
        "shards": 32,
        "nesterov": False,
        "base_momentum": 0.0,
        "sched": False,
        "dtype": None,
    }
    cfg.update(kw)
    return cfg


def _slowmo_on(cfg):
    return cfg["alpha"] != 1.0 or cfg["beta"] != 0.0


def _wrap(module, cfg, **extra):
    return SlowMoDistributedDataParallel(
        module,
        nprocs_per_node=cfg["n"],
        localsgd_frequency=cfg["lf"],
        slowmo_frequency=cfg["sf"],
        slowmo_momentum=cfg["beta"],
        slowmo_lr=cfg["alpha"],
        slowmo_memory_efficient=cfg["eff"],
        slowmo_num_shards=cfg["shards"],
        slowmo_nesterov=cfg["nesterov"],
        **extra,
    )


def _optimizer(params, cfg):
    return torch.optim.SGD(params, lr=LR, momentum=cfg["base_momentum"])


def _scheduler(optimizer, cfg):
    """A learning rate that changes every step (so a stale lr in the slow step shows), or a constant one."""
    factor = (lambda t: 1.0 / (1.0 + 0.3 * t)) if cfg["sched"] else (lambda t: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# -- the single-process reference ---------------------------------------------------------------------------------


def _simulate(world, cfg, steps, lr_override=None, nesterov=None):
    """Parameters of every node after every step, computed in one process from the paper's formulas.

    Node k holds one replica; its gradient is the average of its ranks' gradients (DDP inside the node); each node
    keeps its own base optimizer (and momentum). After step t: if a slow step is due (t % sf == 0, SlowMo on), the
    nodes are averaged and ``u = beta u + (x0 - x)/lr; x0 -= alpha lr u`` (Nesterov: ``alpha lr (d + beta u)``)
    with lr the optimizer's current one; otherwise the nodes are averaged when t % lf == 0. With `cfg["dtype"]`
    the node's model is in that dtype and the optimizer steps an fp32 master copy. `lr_override` and `nesterov`
    exist to show that the comparison would catch a stale lr or the other formula.
    """
    n, num_nodes = cfg["n"], world // cfg["n"]
    nesterov = cfg["nesterov"] if nesterov is None else nesterov
    beta, alpha = cfg["beta"], cfg["alpha"]
    models = [_mlp() for _ in range(num_nodes)]
    if cfg["dtype"] is not None:
        models = [m.to(cfg["dtype"]) for m in models]
    masters = [[nn.Parameter(p.detach().float().clone()) for p in m.parameters()] for m in models]
    opts = [_optimizer(ps, cfg) for ps in masters]
    scheds = [_scheduler(o, cfg) for o in opts]
    x0 = _flat(masters[0]).double()
    u = torch.zeros_like(x0)
    history = []
    for step in range(steps):
        for node, (model, ps, opt) in enumerate(zip(models, masters, opts, strict=True)):
            grads = [torch.zeros_like(p) for p in ps]
            for r in range(node * n, (node + 1) * n):
                model.zero_grad(set_to_none=True)
                x, y = _batch(r, step)
                dtype = cfg["dtype"] or torch.float32
                F.mse_loss(model(x.to(dtype)).float(), y).backward()
                for g, p in zip(grads, model.parameters(), strict=True):
                    g.add_(p.grad.float() / n)
            for p, g in zip(ps, grads, strict=True):
                p.grad = g
            opt.step()
        t = step + 1
        lr = opts[0].param_groups[0]["lr"] if lr_override is None else lr_override
        slow = _slowmo_on(cfg) and t % cfg["sf"] == 0
        flats = [_flat(ps).double() for ps in masters]
        if slow or t % cfg["lf"] == 0:
            mean = sum(flats) / num_nodes
            flats = [mean.clone() for _ in flats]
        if slow:
            d = (x0 - flats[0]) / lr
            u = beta * u + d
            x0 = x0 - alpha * lr * ((d + beta * u) if nesterov else u)
            flats = [x0.clone() for _ in flats]
        with torch.no_grad():
            for ps, model, f in zip(masters, models, flats, strict=True):
                offset = 0
                for p, q in zip(ps, model.parameters(), strict=True):
                    p.copy_(f[offset : offset + p.numel()].view_as(p))
                    q.copy_(p)
                    offset += p.numel()
        history.append(torch.stack([f.float() for f in flats]))
        for s in scheds:
            s.step()
    return torch.stack(history)  # [steps, nodes, P]


# -- one training run on a rank -----------------------------------------------------------------------------------


def _run(rank, cfg, steps, record_stats=False):
    """`steps` steps of SlowMo; returns the flat parameters after each step (and per-step CommStats deltas)."""
    model = _wrap(_mlp(), cfg)
    opt = _optimizer(model.parameters(), cfg)
    sched = _scheduler(opt, cfg)
    history, stats = [], []
    for step in range(steps):
        x, y = _batch(rank, step)
        with comm_stats.measure() as d_fwd_bwd:
            F.mse_loss(model(x), y).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        with comm_stats.measure() as d_slowmo:
            model.perform_slowmo(opt)
        history.append(_flat(model.parameters()))
        stats.append({"fwd_bwd": _counts(d_fwd_bwd), "slowmo": _counts(d_slowmo)})
        sched.step()
    return (torch.stack(history), stats) if record_stats else torch.stack(history)


def _counts(delta):
    return {key: (c.calls, c.payload_bytes) for key, c in delta.snapshot().items()}


def _master_run(rank, cfg, steps):
    """A bf16/fp16 module trained through an fp32 master copy passed as `fp32_params`: a list of tensors, or with
    ``cfg["flat"]`` one flat tensor (fairseq's layout, as fairscale takes it)."""
    module = _mlp().to(cfg["dtype"])
    model = _wrap(module, cfg)
    master = [nn.Parameter(p.detach().float().clone()) for p in module.parameters()]
    if cfg.get("flat"):
        master = [nn.Parameter(torch.cat([p.detach().reshape(-1) for p in master]))]
    opt = _optimizer(master, cfg)
    sched = _scheduler(opt, cfg)
    masters, modules = [], []
    for step in range(steps):
        x, y = _batch(rank, step)
        F.mse_loss(model(x.to(cfg["dtype"])).float(), y).backward()
        grads = [q.grad.float() for q in module.parameters()]
        if cfg.get("flat"):
            grads = [torch.cat([g.reshape(-1) for g in grads])]
        for p, g in zip(master, grads, strict=True):
            p.grad = g
        opt.step()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            values = torch.cat([p.detach().reshape(-1) for p in master])
            offset = 0
            for q in module.parameters():
                q.copy_(values[offset : offset + q.numel()].view_as(q))
                offset += q.numel()
        model.perform_slowmo(opt, fp32_params=master[0] if cfg.get("flat") else master)
        masters.append(_flat(master))
        modules.append(torch.cat([q.detach().reshape(-1) for q in module.parameters()]))
        sched.step()
    # fairscale's _init_global_momentum_buffers (its tests call it before training): x0 := the parameters, u := 0
    model._init_global_momentum_buffers(opt)
    buffers, now = model.slow_buffers, torch.cat([q.detach().float().reshape(-1) for q in module.parameters()])
    start, end = model._my_bounds()
    reset = buffers.x0 is None or (torch.equal(buffers.x0, now[start:end]) and not buffers.u.any())
    return torch.stack(masters), torch.stack(modules), reset and end > start


# -- 1. DDP parity -------------------------------------------------------------------------------------------------


def _ddp_parity(rank, world):
    """SlowMo off, one process per node, averaging every step: plain SGD on the average, as DDP does."""
    ref = DDP(_mlp())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    model = _wrap(_mlp(), _cfg(1, 1, 5, beta=0.0, alpha=1.0))
    assert not model.slowmo
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    diffs = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        F.mse_loss(model(x), y).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        model.perform_slowmo(opt)
        diffs.append((_flat(ref.parameters()) - _flat(model.parameters())).abs().max().item())
    return diffs


def test_one_process_per_node_averaging_every_step_equals_ddp():
    for diffs in run_distributed(_ddp_parity, 2):
        assert len(diffs) == STEPS
        assert max(diffs) < TOL, diffs


def _grad_diff(a, b):
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _node_gradients(rank, world):
    """2 nodes x 2 processes: after each backward the gradients are those of a torch DDP over the node's ranks."""
    cfg = _cfg(2, 2, 3, base_momentum=0.5)
    model = _wrap(_mlp(), cfg)
    node_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ref = DDP(_mlp(seed=5), process_group=node_groups[rank // 2])
    opt = _optimizer(model.parameters(), cfg)
    grad_diffs, local_diffs = [], []
    for step in range(8):
        with torch.no_grad():  # the reference starts every step from SlowMo's parameters
            for p, q in zip(ref.module.parameters(), model.parameters(), strict=True):
                p.copy_(q)
        x, y = _batch(rank, step)
        ref.zero_grad()
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(model(x), y).backward()
        grad_diffs.append(_grad_diff(ref, model))
        own = _mlp()  # this rank's own gradient, to show the average differs from it
        with torch.no_grad():
            for p, q in zip(own.parameters(), model.parameters(), strict=True):
                p.copy_(q)
        F.mse_loss(own(x), y).backward()
        local_diffs.append(_grad_diff(own, model))
        opt.step()
        model.zero_grad(set_to_none=True)
        model.perform_slowmo(opt)
    return grad_diffs, local_diffs


def test_gradients_are_averaged_inside_each_node_like_ddp():
    for grad_diffs, local_diffs in run_distributed(_node_gradients, 4):
        assert max(grad_diffs) < TOL, grad_diffs
        assert min(local_diffs) > 1e-4  # the node average is not just this rank's gradient


# -- 2. the slow-momentum update against the simulation, and 3. replicas -----------------------------------------

REFERENCE_CONFIGS = {
    4: [
        _cfg(1, 1, 3, eff=False),
        _cfg(1, 3, 4, shards=1),  # slowmo_frequency not a multiple of localsgd_frequency
        _cfg(1, 3, 4, shards=3, base_momentum=0.9, sched=True),
        _cfg(1, 2, 5, shards=32, nesterov=True, beta=0.9, alpha=0.7),  # more shards than ranks
        _cfg(1, 2, 6, eff=False, base_momentum=0.9, sched=True, nesterov=True),
        _cfg(1, 4, 2, shards=32, alpha=1.5),  # slow steps more often than averaging
        _cfg(2, 3, 4, eff=False, base_momentum=0.9, sched=True),
        _cfg(2, 3, 4, shards=3),
        _cfg(2, 2, 5, shards=32, nesterov=True, base_momentum=0.9, beta=0.9, alpha=0.7),
        _cfg(2, 1, 2, shards=1, sched=True),
        _cfg(2, 3, 6, eff=False, nesterov=True, sched=True),
        _cfg(2, 3, 4, beta=0.0, alpha=1.0),  # SlowMo off: plain local SGD
    ],
    2: [
        _cfg(1, 2, 3, shards=32, base_momentum=0.9, sched=True),
        _cfg(1, 3, 5, eff=False, nesterov=True),
        _cfg(2, 2, 3, shards=32, sched=True),  # one node: only the slow step acts between ranks
        _cfg(2, 2, 3, eff=False),
    ],
}


def _reference_runs(rank, world):
    with warnings.catch_warnings():  # the one-node warning, tested on its own; the pool's processes are reused
        warnings.simplefilter("ignore")
        return [_run(rank, cfg, STEPS) for cfg in REFERENCE_CONFIGS[world]]


def _averaged_after(cfg, t):
    return t % cfg["lf"] == 0 or (_slowmo_on(cfg) and t % cfg["sf"] == 0)


@pytest.mark.parametrize("world", [4, 2])
def test_slow_momentum_matches_the_simulation_and_replicas_agree(world):
    results = run_distributed(_reference_runs, world)
    for i, cfg in enumerate(REFERENCE_CONFIGS[world]):
        expected = _simulate(world, cfg, STEPS)  # [steps, nodes, P]
        n, num_nodes = cfg["n"], world // cfg["n"]
        runs = torch.stack([results[r][i] for r in range(world)])  # [ranks, steps, P]
        for rank in range(world):
            diff = (runs[rank] - expected[:, rank // n]).abs().amax(dim=1)
            assert diff.max().item() < TOL, (cfg, rank, diff.tolist())
        for t in range(1, STEPS + 1):
            after = runs[:, t - 1]
            for node in range(num_nodes):  # a node's processes hold one replica, always
                for r in range(node * n, (node + 1) * n):
                    assert (after[r] - after[node * n]).abs().max().item() <= EXACT, (cfg, t, r)
            if _averaged_after(cfg, t):
                assert (after - after[0]).abs().max().item() <= EXACT, (cfg, t)
            elif num_nodes > 1:
                for node in range(1, num_nodes):
                    assert (after[node * n] - after[0]).abs().max().item() > 1e-4, (cfg, t, node)


def test_the_simulation_tells_the_variants_apart():
    """The comparisons above would catch a stale lr and the wrong outer formula (they are not all the same)."""
    cfg = _cfg(2, 3, 4, eff=False, base_momentum=0.9, sched=True)
    assert (_simulate(4, cfg, STEPS) - _simulate(4, cfg, STEPS, lr_override=LR)).abs().max() > 1e-4
    cfg = _cfg(1, 2, 6, eff=False, nesterov=True)
    assert (_simulate(4, cfg, STEPS) - _simulate(4, cfg, STEPS, nesterov=False)).abs().max() > 1e-4
    cfg = _cfg(1, 3, 4)
    assert (_simulate(4, cfg, STEPS) - _simulate(4, _cfg(1, 3, 4, beta=0.0, alpha=1.0), STEPS)).abs().max() > 1e-4


MASTER_CONFIGS = [
    _cfg(1, 2, 3, dtype=torch.bfloat16, sched=True),
    _cfg(1, 2, 3, dtype=torch.float16, eff=False, base_momentum=0.9),
    _cfg(1, 2, 3, dtype=torch.bfloat16, sched=True, flat=True),
]


def _master_runs(rank, world):
    return [_master_run(rank, cfg, 8) for cfg in MASTER_CONFIGS]


def test_fp32_master_copy_for_a_half_precision_module():
    results = run_distributed(_master_runs, 2)
    for i, cfg in enumerate(MASTER_CONFIGS):
        expected = _simulate(2, cfg, 8)
        for rank, runs in enumerate(results):
            masters, modules, reset = runs[i]
            assert reset, (cfg, rank)
            assert masters.dtype == torch.float32 and modules.dtype == cfg["dtype"]
            assert (masters - expected[:, rank]).abs().max().item() < TOL, cfg
            assert torch.equal(modules, masters.to(cfg["dtype"]))  # the module follows its master copy
        for t in range(1, 9):
            if _averaged_after(cfg, t):
                assert torch.equal(results[0][i][0][t - 1], results[1][i][0][t - 1]), (cfg, t)


# -- 4. CommStats --------------------------------------------------------------------------------------------------

COMM_CONFIGS = [
    _cfg(2, 3, 4, shards=3),
    _cfg(2, 3, 4, eff=False),
    _cfg(2, 3, 4, beta=0.0, alpha=1.0),
    _cfg(1, 2, 3, shards=32),
    _cfg(1, 2, 3, eff=False),
]


def _comm_runs(rank, world):
    return [_run(rank, cfg, STEPS, record_stats=True)[1] for cfg in COMM_CONFIGS], _param_bytes(_mlp())


def test_communication_per_step():
    results = run_distributed(_comm_runs, 4)
    world = 4
    for i, cfg in enumerate(COMM_CONFIGS):
        n = cfg["n"]
        masters = list(range(0, world, n))
        master_label = "world" if n == 1 else "ranks[" + ",".join(map(str, masters)) + "]"
        for rank, (all_stats, nbytes) in enumerate(results):
            node = rank // n
            node_label = "ranks[" + ",".join(map(str, range(node * n, node * n + n))) + "]"
            for t, stats in enumerate(all_stats[i], start=1):
                where = (cfg, rank, t)
                fwd_bwd, slowmo = stats["fwd_bwd"], stats["slowmo"]
                if n > 1:  # the node's gradient all-reduce, counted by DDP's hook: every parameter, every step
                    assert set(fwd_bwd) == {("all_reduce", node_label)}, where
                    assert fwd_bwd[("all_reduce", node_label)][0] >= 1
                    assert fwd_bwd[("all_reduce", node_label)][1] == nbytes, where
                else:
                    assert fwd_bwd == {}, where
                slow = _slowmo_on(cfg) and t % cfg["sf"] == 0
                if slow and cfg["eff"]:  # averaging folded into one reduce + one broadcast per shard, no all-reduce
                    shards = min(world, cfg["shards"])
                    assert slowmo == {
                        ("reduce", "world"): (shards, nbytes),
                        ("broadcast", "world"): (shards, nbytes),
                    }, where
                elif slow or t % cfg["lf"] == 0:
                    expected = {}
                    if rank in masters:  # only node masters talk between nodes
                        expected[("all_reduce", master_label)] = (1, nbytes)
                    if n > 1:  # then share the average inside the node
                        expected[("broadcast", node_label)] = (1, nbytes)
                    assert slowmo == expected, where
                else:
                    assert slowmo == {}, where


# -- 5. resume -----------------------------------------------------------------------------------------------------

RESUME_CONFIGS = [
    _cfg(2, 2, 3, shards=3, base_momentum=0.9, sched=True),
    _cfg(2, 2, 3, eff=False, base_momentum=0.9, sched=True, nesterov=True),
    _cfg(1, 3, 4, shards=32, base_momentum=0.9),
]


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loaded(data):
    return torch.load(io.BytesIO(data), weights_only=False)


def _same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _local_step(model, opt, sched, rank, step):
    x, y = _batch(rank, step)
    F.mse_loss(model(x), y).backward()
    opt.step()
    model.zero_grad(set_to_none=True)
    model.perform_slowmo(opt)
    sched.step()
    return _flat(model.parameters())


def _resume(rank, world, cfg, total, stop):
    """`total` steps straight, against `stop` steps, a checkpoint, fresh objects and the remaining steps."""
    model = _wrap(_mlp(), cfg)
    opt = _optimizer(model.parameters(), cfg)
    sched = _scheduler(opt, cfg)
    straight, checkpoint = [], None
    for step in range(total):
        if step == stop:
            checkpoint = {
                "model": _saved(model.state_dict()),
                "optimizer": _saved(opt.state_dict()),
                "scheduler": _saved(sched.state_dict()),
                "slowmo": _saved(model.slowmo_state_dict()),
            }
        straight.append(_local_step(model, opt, sched, rank, step))
    diffs, slow_state, untouched = [], None, None
    for via in ("slowmo_state_dict", "state_dict"):  # the complete buffers, or each rank's own state_dict()
        model2 = _wrap(_mlp(seed=7), cfg)  # other initial values: everything must come from the checkpoint
        opt2 = _optimizer(model2.parameters(), cfg)
        sched2 = _scheduler(opt2, cfg)
        model2.load_state_dict(_loaded(checkpoint["model"]))
        opt2.load_state_dict(_loaded(checkpoint["optimizer"]))
        sched2.load_state_dict(_loaded(checkpoint["scheduler"]))
        if via == "slowmo_state_dict":
            slow_state = _loaded(checkpoint["slowmo"])
            untouched = copy.deepcopy(slow_state)
            model2.load_slowmo_state_dict(slow_state)
        assert model2.num_updates == stop
        resumed = [_local_step(model2, opt2, sched2, rank, step) for step in range(stop, total)]
        diffs.append((torch.stack(straight[stop:]) - torch.stack(resumed)).abs().max().item())
    return max(diffs), _same_state(slow_state, untouched), sorted(untouched)


def _resume_runs(rank, world):
    return [_resume(rank, world, cfg, 11, 5) for cfg in RESUME_CONFIGS]


def test_resume_continues_exactly():
    for rank_results in run_distributed(_resume_runs, 4):
        for cfg, (diff, unchanged, keys) in zip(RESUME_CONFIGS, rank_results, strict=True):
            assert diff <= EXACT, (cfg, diff)
            assert unchanged, cfg  # load_slowmo_state_dict neither changed nor kept its argument
            assert keys == ["num_updates", "u", "x0"], cfg


# -- 6. buffers ----------------------------------------------------------------------------------------------------


def _buffers(rank, world):
    out = {}
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))  # the same input on every rank
    for broadcast in (True, False):
        module = _with_norm()
        model = SlowMoDDP(module, nprocs_per_node=2, broadcast_buffers=broadcast, localsgd_frequency=2)
        bn = module[1]
        with torch.no_grad():  # after construction (which syncs everything once): every rank's own statistics
            bn.running_mean.fill_(float(rank))
            bn.running_var.fill_(float(rank + 1))
        model.eval()
        with comm_stats.measure() as d:
            y_eval = model(x)
        eval_mean = bn.running_mean.clone()
        model.train()
        xt = x + rank
        model(xt)
        expected_train = 0.9 * eval_mean + 0.1 * (module[0](xt)).detach().mean(0)
        buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
        out[broadcast] = {
            "eval_out": y_eval.detach(),
            "eval_mean": eval_mean,
            "train_error": (bn.running_mean - expected_train).abs().max().item(),
            "world_broadcast": d.total("broadcast", "world"),
            "buffer_bytes": buffer_bytes,
            "training": model.training and module.training,
        }
    return out


def test_buffers_are_broadcast_from_rank_zero_before_forward():
    results = run_distributed(_buffers, 4)
    for rank, out in enumerate(results):
        on, off = out[True], out[False]
        assert torch.equal(on["eval_mean"], torch.zeros(16))  # rank 0's statistics, taken before the forward
        assert torch.equal(on["eval_out"], results[0][True]["eval_out"])  # ... and used by it
        assert on["world_broadcast"].payload_bytes == on["buffer_bytes"]
        assert on["train_error"] < TOL  # in training, rank 0's statistics updated with this rank's batch
        assert torch.equal(off["eval_mean"], torch.full((16,), float(rank)))
        assert off["world_broadcast"].calls == 0
        assert off["train_error"] < TOL
        assert on["training"] and off["training"]
        if rank:
            assert not torch.equal(off["eval_out"], results[0][False]["eval_out"])


# -- 7. errors, warnings, API ------------------------------------------------------------------------------------


@contextmanager
def _watch_collectives():
    """Records every torch.distributed collective or group creation in the block (and still performs it)."""
    names = ["new_group", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "reduce_scatter", "barrier"]
    saved = {name: getattr(dist, name) for name in names}
    seen = []

    def watch(name):
        def call(*args, **kwargs):
            seen.append(name)
            return saved[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, watch(name))
    try:
        with comm_stats.measure() as counted:
            yield seen
        seen.extend(f"counted {kind}" for kind, _ in counted.snapshot())
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _error(fn):
    with _watch_collectives() as seen:
        try:
            fn()
        except Exception as exc:
            return type(exc).__name__, str(exc), list(seen)
    return "no error", "", list(seen)


def _errors(rank, world):
    cases = {
        "nprocs_not_dividing": lambda: SlowMoDDP(_mlp(), nprocs_per_node=3),
        "nprocs_zero": lambda: SlowMoDDP(_mlp(), nprocs_per_node=0),
        "localsgd_zero": lambda: SlowMoDDP(_mlp(), nprocs_per_node=1, localsgd_frequency=0),
        "localsgd_negative": lambda: SlowMoDDP(_mlp(), nprocs_per_node=1, localsgd_frequency=-3),
        "slowmo_zero": lambda: SlowMoDDP(_mlp(), nprocs_per_node=1, slowmo_frequency=0),
        "shards_zero": lambda: SlowMoDDP(_mlp(), nprocs_per_node=1, slowmo_num_shards=0),
        "shards_negative": lambda: SlowMoDDP(_mlp(), nprocs_per_node=1, slowmo_num_shards=-1),
        "unknown_base": lambda: SlowMoDDP(_mlp(), nprocs_per_node=1, slowmo_base_algorithm="gossip"),
        "not_a_module": lambda: SlowMoDDP("model", nprocs_per_node=1),
    }
    out = {label: _error(build) for label, build in cases.items()}

    def step(model, opt, **kwargs):
        F.mse_loss(model(torch.randn(2, 8).to(next(model.parameters()).dtype)).float(), torch.zeros(2, 4)).backward()
        opt.step()
        model.perform_slowmo(opt, **kwargs)

    half = SlowMoDDP(_mlp().to(torch.bfloat16), nprocs_per_node=1, localsgd_frequency=1)
    out["bf16_without_master"] = _error(lambda: step(half, torch.optim.SGD(half.parameters(), lr=LR)))
    master = [nn.Parameter(p.detach().float()) for p in half.parameters()]
    out["master_not_in_optimizer"] = _error(
        lambda: step(half, torch.optim.SGD(half.parameters(), lr=LR), fp32_params=master)
    )
    model = SlowMoDDP(_mlp(), nprocs_per_node=1, localsgd_frequency=1)
    out["foreign_optimizer"] = _error(lambda: step(model, torch.optim.SGD(_mlp().parameters(), lr=LR)))
    out["partial_optimizer"] = _error(lambda: step(model, torch.optim.SGD(model.module[0].parameters(), lr=LR)))
    out["not_an_optimizer"] = _error(lambda: model.perform_slowmo("sgd"))
    slow = SlowMoDDP(_mlp(), nprocs_per_node=1, slowmo_momentum=0.5)
    out["checkpoint_without_buffers"] = _error(lambda: slow.load_slowmo_state_dict({"num_updates": 3}))
    wrong = {"num_updates": 3, "x0": torch.zeros(5), "u": torch.zeros(5)}
    out["checkpoint_of_another_model"] = _error(lambda: slow.load_slowmo_state_dict(wrong))
    out["num_updates_after_errors"] = model.num_updates
    return out


def test_clear_errors_before_any_collective():
    for out in run_distributed(_errors, 2):
        expected = {
            "nprocs_not_dividing": ("ValueError", "must divide the world size 2"),
            "nprocs_zero": ("ValueError", "nprocs_per_node"),
            "localsgd_zero": ("ValueError", "localsgd_frequency"),
            "localsgd_negative": ("ValueError", "localsgd_frequency"),
            "slowmo_zero": ("ValueError", "slowmo_frequency"),
            "shards_zero": ("ValueError", "slowmo_num_shards"),
            "shards_negative": ("ValueError", "slowmo_num_shards"),
            "unknown_base": ("ValueError", "'gossip' is not a valid SlowMoBaseAlgorithm"),
            "not_a_module": ("TypeError", "torch.nn.Module"),
            "bf16_without_master": ("ValueError", "fp32_params"),
            "master_not_in_optimizer": ("ValueError", "does not hold"),
            "foreign_optimizer": ("ValueError", "does not hold"),
            "partial_optimizer": ("ValueError", "does not hold 4 of"),
            "not_an_optimizer": ("TypeError", "torch.optim.Optimizer"),
            "checkpoint_without_buffers": ("ValueError", "no slow buffers"),
            "checkpoint_of_another_model": ("ValueError", "have 5 elements"),
        }
        for label, (kind, text) in expected.items():
            got_kind, message, collectives = out[label]
            assert got_kind == kind, (label, out[label])
            assert text in message, (label, message)
            assert collectives == [], (label, collectives)
        assert "torch.bfloat16" in out["bf16_without_master"][1]
        assert out["num_updates_after_errors"] == 0


FAIRSCALE_ATTRIBUTES = [  # read by fairscale users' code
    "process_rank",
    "process_world_size",
    "local_rank",
    "localsgd",
    "sgp",
    "slowmo_num_shards",
    "is_current_node_a_slowmo_shard",
    "slowmo_memory_efficient",
    "broadcast_buffers",
]


def _warnings_and_api(rank, world):
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_node = SlowMoDDP(_mlp(), nprocs_per_node=2, localsgd_frequency=2, slowmo_frequency=3)
    out["one_node"] = [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = SlowMoDDP(_mlp(), nprocs_per_node=1, slowmo_momentum=0.5)
    out["two_nodes"] = [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sgp_args = SlowMoDDP(
            _mlp(),
            nprocs_per_node=1,
            graph=object(),
            mixing=object(),
            push_sum=False,
            overlap=True,
            synch_freq=2,
            use_streams=False,
            slowmo_sgp_average_params=True,
            verbose=True,
            profile_mode=True,
            process_rank=rank,
            process_world_size=world,
            comm_device=torch.device("cpu"),
        )
    out["sgp_args"] = [str(w.message) for w in caught]
    x = torch.randn(3, 8)
    module = model.module
    module_keys = module.state_dict()
    out["api"] = {
        "alias": SlowMoDDP is SlowMoDistributedDataParallel,
        "enum": (SlowMoBaseAlgorithm.LOCALSGD.value, SlowMoBaseAlgorithm.SGP.value),
        "slowmo": (model.slowmo, one_node.slowmo, sgp_args.slowmo),
        "settings": (model.slowmo_lr, model.slowmo_momentum, model.slowmo_frequency, model.localsgd_frequency),
        "nodes": (model.nprocs_per_node, model.logical_rank, model.logical_world_size, one_node.logical_world_size),
        "one_node_rank": one_node.logical_rank,
        "num_updates": model.num_updates,
        "forward": torch.equal(model(x), module(x)),
        "groups": all(g is not None for g in (model.global_group, model.local_node_group, model.master_group)),
        "state_keys": sorted(model.state_dict()) == sorted(["_extra_state", *("module." + k for k in module_keys)]),
        "eval": not model.eval().training and not module.training and not one_node.eval()._node_ddp.training,
        "train": model.train().training and module.training and one_node.train()._node_ddp.training,
        "fairscale_attributes": (*(getattr(model, a) for a in FAIRSCALE_ATTRIBUTES), one_node.local_rank),
        "process_group": model.process_group is model.global_group,
    }
    # a module state dict without the extra state (fairscale's, which carries no slow buffers) loads strictly
    model.num_updates = 4
    plain = {k: v for k, v in model.state_dict().items() if k != "_extra_state"}
    loaded = model.load_state_dict(plain)
    out["plain_load"] = (list(loaded.missing_keys), list(loaded.unexpected_keys), model.num_updates)
    try:
        model.load_state_dict({**plain, "module.extra": torch.zeros(1)})
        out["strict"] = ""
    except RuntimeError as exc:
        out["strict"] = str(exc)
    # each rank keeps half of the slow buffers: its own slice or whole buffers load, another rank's slice does not
    state = model.state_dict()
    slow = state["_extra_state"]["slow"]
    numel, (start, end) = slow["numel"], slow["bounds"]
    whole = {"x0": torch.arange(numel, dtype=torch.float32), "u": -torch.arange(numel, dtype=torch.float32)}
    model.load_state_dict(
        {**state, "_extra_state": {"num_updates": 2, "slow": {**whole, "bounds": (0, numel), "numel": numel}}}
    )
    mine = model.state_dict()["_extra_state"]["slow"]
    out["whole_sliced"] = torch.equal(mine["x0"], whole["x0"][start:end]) and torch.equal(
        mine["u"], whole["u"][start:end]
    )
    other = (end, numel) if start == 0 else (0, start)
    try:
        model.load_state_dict({**state, "_extra_state": {"num_updates": 2, "slow": {**slow, "bounds": other}}})
        out["other_slice"] = ""
    except ValueError as exc:
        out["other_slice"] = str(exc)
    off = SlowMoDDP(_mlp(), nprocs_per_node=1, slowmo_momentum=0.0, slowmo_lr=1.0)
    out["off"] = (off.slowmo, sorted(off.slowmo_state_dict()))
    return out


def test_warnings_and_api():
    for rank, out in enumerate(run_distributed(_warnings_and_api, 2)):
        assert sum("one node" in m for m in out["one_node"]) == 1, out["one_node"]
        assert not any("one node" in m for m in out["two_nodes"]), out["two_nodes"]
        assert len(out["sgp_args"]) == 1 and all(w in out["sgp_args"][0] for w in ("graph", "mixing", "SGP"))
        api = out["api"]
        assert api["alias"] and api["enum"] == ("localsgd", "sgp")
        assert api["slowmo"] == (True, True, True)  # default slowmo_momentum=0.5
        assert api["settings"] == (1.0, 0.5, 48, 3)
        assert api["nodes"] == (1, rank, 2, 1) and api["one_node_rank"] == 0
        assert api["num_updates"] == 0
        for key in ("forward", "groups", "state_keys", "eval", "train"):
            assert api[key], key
        assert api["fairscale_attributes"] == (rank, 2, 0, True, False, 2, True, True, True, rank)
        assert api["process_group"]
        assert out["plain_load"] == ([], [], 4) and "unexpected keys ['module.extra']" in out["strict"]
        assert out["whole_sliced"] and "load each rank's own state_dict()" in out["other_slice"]
        assert out["off"] == (False, ["num_updates"])


# -- 8. no CUDA on the CPU path ------------------------------------------------------------------------------------

CUDA_FUNCTIONS = [
    "is_available",
    "device_count",
    "current_device",
    "set_device",
    "synchronize",
    "Stream",
    "Event",
    "stream",
    "current_stream",
    "default_stream",
    "get_device_properties",
    "get_device_name",
    "memory_allocated",
    "empty_cache",
    "_lazy_init",
]


def _without_cuda(rank, world):
    calls = []
    saved = {name: getattr(torch.cuda, name) for name in CUDA_FUNCTIONS}
    saved_tensor_cuda = torch.Tensor.cuda

    def forbidden(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"torch.cuda.{name} called on the CPU path")

        return call

    for name in CUDA_FUNCTIONS:
        setattr(torch.cuda, name, forbidden(name))
    torch.Tensor.cuda = forbidden("Tensor.cuda")
    try:
        for cfg in (_cfg(2, 2, 3, shards=3, base_momentum=0.9), _cfg(1, 1, 2, eff=False, nesterov=True)):
            module = _with_norm()
            model = _wrap(module, cfg)
            opt = _optimizer(model.parameters(), cfg)
            for step in range(6):
                x, y = _batch(rank, step)
                F.mse_loss(model(x), y).backward()
                opt.step()
                model.zero_grad(set_to_none=True)
                model.perform_slowmo(opt)
            model.load_slowmo_state_dict(model.slowmo_state_dict())
            model.load_state_dict(model.state_dict())
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        torch.Tensor.cuda = saved_tensor_cuda
    return calls


def test_no_cuda_call_on_the_cpu_path():
    for calls in run_distributed(_without_cuda, 4):
        assert calls == []
