"""OSS (optimizer state sharding, ZeRO-1) on 1, 2 and 4 gloo ranks, checked against plain PyTorch.

Spawning a rank costs about two seconds and the runner keeps one pool of ranks per world size, so every spawned
run checks many things. Ranks run the plain torch reference next to OSS and return what they measured (largest
differences, byte counts, flags); the assertions happen here in the parent, where a failure names what differed.
"""

from __future__ import annotations

import copy
import glob
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR

from ddpkit.distributed import comm_stats
from ddpkit.distributed.shared_memory import ENV_VAR as SHARED_MEMORY_ENV
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed

TOL = 1e-6  # largest absolute difference allowed between OSS and the plain torch reference
IN, HIDDEN, OUT = 8, 16, 4
GLOBAL_BATCH = 8  # divisible by every world size used here


# -- shared helpers -------------------------------------------------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    layers = [nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)]
    return nn.Sequential(*layers)


def _two_groups(model, lr_w, lr_b):
    """Weights and biases in two groups: interleaved in the model's parameter order."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "lr": lr_w},
        {"params": [p for n, p in named if n.endswith("bias")], "lr": lr_b},
    ]


def _data(seed, rows=GLOBAL_BATCH, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, IN, generator=g).to(dtype), torch.randn(rows, OUT, generator=g).to(dtype)


def _train_step(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    return opt.step()


def _max_diff(a, b):
    a, b = list(a), list(b)
    assert len(a) == len(b) and a, "parameter lists differ in length"
    return max((x.detach().double() - y.detach().double()).abs().max().item() for x, y in zip(a, b, strict=True))


def _set_grads(params, seed):
    """The same random gradient on every rank (what DDP leaves behind), a different scale per parameter."""
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(params):
        p.grad = (torch.randn(p.shape, generator=g) * (i + 1)).to(p.dtype)


def _state_bytes(state):
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


def _same(a, b):
    """Exact structural equality, tensors included (to show that something was not changed)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _state_diff(a, b):
    """Largest difference between two torch-format optimizer states (same keys required)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for i in a:
        assert a[i].keys() == b[i].keys(), (i, sorted(a[i]), sorted(b[i]))
        for k in a[i]:
            worst = max(worst, (a[i][k].double() - b[i][k].double()).abs().max().item())
    return worst


def _groups_without_params(groups):
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _all_same(value):
    """True when `value` is identical on every rank (a raw torch collective, not counted by comm_stats)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def _assert_small(results, what=""):
    """`results` is a list (one per rank) of {name: largest difference}; all must be within TOL."""
    for rank, diffs in enumerate(results):
        for name, diff in diffs.items():
            assert diff <= TOL, f"{what} rank {rank}: {name} differs by {diff:.3e} (tolerance {TOL:g})"


# -- 1. parity with DDP + plain torch optimizers (and torch's ZeroRedundancyOptimizer) --------------------------------

_PARITY_CASES = {
    "sgd_momentum": (torch.optim.SGD, 0.05, 0.02, {"momentum": 0.9}),
    "adam": (torch.optim.Adam, 1e-2, 3e-3, {}),
    "adamw": (torch.optim.AdamW, 1e-2, 3e-3, {"weight_decay": 0.1}),
}


def _parity(rank, world):
    diffs, info = {}, {}
    for name, (cls, lr_w, lr_b, kwargs) in _PARITY_CASES.items():
        ref_model, oss_model = DDP(_mlp()), DDP(_mlp())
        ref_opt = cls(_two_groups(ref_model.module, lr_w, lr_b), **kwargs)  # torch's default implementation
        oss_opt = OSS(_two_groups(oss_model.module, lr_w, lr_b), optim=cls, **kwargs)
        runs = {
            "ref": (ref_model, ref_opt, StepLR(ref_opt, step_size=5, gamma=0.5)),
            "oss": (oss_model, oss_opt, StepLR(oss_opt, step_size=5, gamma=0.5)),
        }
        if name == "adam":
            from torch.distributed.optim import ZeroRedundancyOptimizer  # here: its import warns about torch.jit

            zero_model = DDP(_mlp())
            zero_opt = ZeroRedundancyOptimizer(
                _two_groups(zero_model.module, lr_w, lr_b), optimizer_class=cls, **kwargs
            )
            runs["zero"] = (zero_model, zero_opt, StepLR(zero_opt, step_size=5, gamma=0.5))
        for step in range(20):
            x, y = _data(1000 * step + rank)  # different data on every rank
            for model, opt, sched in runs.values():
                _train_step(model, opt, x, y)
                sched.step()
        diffs[name] = _max_diff(oss_model.parameters(), ref_model.parameters())
        if "zero" in runs:
            diffs["adam_vs_torch_zero"] = _max_diff(oss_model.parameters(), runs["zero"][0].parameters())
        info[name] = {
            "lrs": [g["lr"] for g in oss_opt.param_groups] == [g["lr"] for g in ref_opt.param_groups],
            "lr_decayed": oss_opt.param_groups[0]["lr"] == lr_w * 0.5**4,
            "owned_with_state": len(oss_opt.optim.state),
        }
    return diffs, info


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_ddp_and_torch_optimizers(world):
    results = run_distributed(_parity, world)
    _assert_small([diffs for diffs, _ in results], f"world {world}:")
    for name in _PARITY_CASES:
        for rank, (_, info) in enumerate(results):
            assert info[name]["lrs"] and info[name]["lr_decayed"], (name, rank, info)
        owned = [info[name]["owned_with_state"] for _, info in results]
        assert sum(owned) == 6 and max(owned) < 6, f"{name}: state not sharded over the ranks: {owned}"


# -- 2. clip_grad_norm ------------------------------------------------------------------------------------------------


def _clip(rank, world):
    model = _mlp()
    frozen = nn.Parameter(torch.randn(5), requires_grad=False)  # no owner, but it will hold a gradient
    opt = OSS([*_two_groups(model, 0.1, 0.1), {"params": [frozen]}], optim=torch.optim.SGD, lr=0.1)
    params = [*model.parameters(), frozen]
    ref = [p.detach().clone() for p in params]

    def weights_only(ps):
        return [p for p in ps if p.dim() > 1]

    cases = [
        (2.0, 0.05, None),
        (2.0, 1e3, None),  # no clipping
        ("inf", 0.01, None),
        (float("inf"), 1e3, None),
        (1.5, 0.1, None),
        (2.0, 0.05, weights_only),
        ("inf", 0.01, weights_only),
    ]
    out, shapes, calls = {}, [], []
    for i, (norm_type, max_norm, fn) in enumerate(cases):
        _set_grads(params, seed=i)
        _set_grads(ref, seed=i)
        with comm_stats.measure() as m:
            total = opt.clip_grad_norm(max_norm, norm_type=norm_type, filter_params_fn=fn)
        calls.append((m.calls(), m.calls("all_reduce"), m.payload_bytes()))
        selected = ref if fn is None else fn(ref)
        expected = torch.nn.utils.clip_grad_norm_(selected, max_norm, norm_type=norm_type)
        tag = f"{norm_type}/{max_norm}/{'filtered' if fn else 'all'}"
        out[f"norm {tag}"] = abs(total.item() - expected.item()) / expected.item()
        out[f"grads {tag}"] = _max_diff([p.grad for p in params], [p.grad for p in ref])
        shapes.append((tuple(total.shape), total.dtype) == (tuple(expected.shape), expected.dtype))
    return out, shapes, calls


@pytest.mark.parametrize("world", [2, 4])
def test_clip_grad_norm_matches_torch_on_the_full_model(world):
    results = run_distributed(_clip, world)
    _assert_small([out for out, _, _ in results], f"world {world}:")
    for _, shapes, calls in results:
        assert all(shapes), "clip_grad_norm must return a 0-d tensor like torch.nn.utils.clip_grad_norm_"
        assert all(c == (1, 1, 4) for c in calls), f"one all-reduce of one float32 per call, got {calls}"


# -- 3. checkpoints across world sizes --------------------------------------------------------------------------------

CKPT_STEPS = 5  # saved after this many steps, then continued for as many again


def _ckpt_setup(optim_cls=OSS, **kwargs):
    model = _mlp()
    groups = _two_groups(model, 1e-2, 3e-3)
    opt = OSS(groups, optim=torch.optim.Adam, **kwargs) if optim_cls is OSS else torch.optim.Adam(groups)
    return model, opt, StepLR(opt, step_size=3, gamma=0.5)


def _global_step(model, opt, sched, step, rank, world):
    """One step on the same global batch at every world size, split evenly: DDP's average is the full mean."""
    x, y = _data(step)
    rows = GLOBAL_BATCH // world
    _train_step(model, opt, x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
    sched.step()


def _ckpt_save(rank, world, directory):
    info = {}
    modes = {"rank0": ({}, 0), "every_rank": ({}, -1), "object": ({"force_broadcast_object": True}, 1)}
    for mode, (kwargs, recipient) in modes.items():
        model, opt, sched = _ckpt_setup(**kwargs)
        ddp = DDP(model)
        for step in range(CKPT_STEPS):
            _global_step(ddp, opt, sched, step, rank, world)
        with comm_stats.measure() as m:
            opt.consolidate_state_dict(recipient_rank=recipient)
        info[f"{mode} collectives"] = sorted({kind for kind, _ in m.snapshot()})
        if recipient in (-1, rank):
            state = opt.state_dict()
            torch.save(
                {"model": model.state_dict(), "optim": state, "sched": sched.state_dict()},
                f"{directory}/{mode}_rank{rank}.pt",
            )
        else:
            try:
                opt.state_dict()
                info[f"{mode} refused"] = False
            except RuntimeError as exc:
                info[f"{mode} refused"] = "consolidate_state_dict" in str(exc)
        if mode == "every_rank":
            info["all_ranks=True equal"] = _same(opt.state_dict(all_ranks=True), state)
    return info


def _ckpt_resume(rank, world, paths, ref_path):
    ref = torch.load(ref_path, weights_only=False)
    diffs, flags = {}, {}
    for path in paths:
        ckpt = torch.load(path, weights_only=False)
        model, opt, sched = _ckpt_setup()
        model.load_state_dict(ckpt["model"])
        before = copy.deepcopy(ckpt)
        opt.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        wrapped = DDP(model) if world > 1 else model
        for step in range(CKPT_STEPS, 2 * CKPT_STEPS):
            _global_step(wrapped, opt, sched, step, rank, world)
        name = path.rsplit("/", 1)[-1]
        diffs[name] = _max_diff(model.parameters(), ref["params"])
        flags[f"{name} argument unchanged"] = _same(ckpt, before)
        flags[f"{name} lrs"] = [g["lr"] for g in opt.param_groups] == ref["lrs"]
    return diffs, flags


def _plain_run(steps, start=0, model_opt_sched=None):
    model, opt, sched = model_opt_sched or _ckpt_setup(torch.optim.Adam)
    for step in range(start, start + steps):
        _global_step(model, opt, sched, step, 0, 1)
    return model, opt, sched


def test_checkpoints_move_between_world_sizes_and_torch(tmp_path):
    # The uninterrupted reference: plain torch Adam on the whole global batch, one process.
    model, opt, sched = _plain_run(CKPT_STEPS)
    state_at_save = copy.deepcopy(opt.state_dict())
    plain_path = str(tmp_path / "plain_torch.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, plain_path)
    _plain_run(CKPT_STEPS, CKPT_STEPS, (model, opt, sched))
    ref_path = str(tmp_path / "reference.pt")
    torch.save(
        {"params": [p.detach() for p in model.parameters()], "lrs": [g["lr"] for g in opt.param_groups]}, ref_path
    )

    # Save at world size 2, in each consolidation mode.
    infos = run_distributed(_ckpt_save, 2, str(tmp_path))
    for rank, info in enumerate(infos):
        assert info["rank0 collectives"] == ["all_gather", "gather"], info
        assert info["every_rank collectives"] == ["all_gather"], info
        assert info["object collectives"] == ["broadcast"], info
        assert info["all_ranks=True equal"], info
        assert info[f"{'object' if rank == 0 else 'rank0'} refused"], f"rank {rank}: state_dict() must refuse: {info}"
    paths = [str(tmp_path / f) for f in ("rank0_rank0.pt", "every_rank_rank1.pt", "object_rank1.pt")]
    saved = [torch.load(p, weights_only=False) for p in paths]
    assert _same(saved[1]["optim"], torch.load(tmp_path / "every_rank_rank0.pt", weights_only=False)["optim"])
    for path, ckpt in zip(paths, saved, strict=True):
        # torch's own format, the same as the plain optimizer's, but for the fused kernel OSS chose (fairscale's
        # rule: the state dict's param groups are OSS.param_groups, key for key)
        fused = [{**group, "fused": True} for group in state_at_save["param_groups"]]
        assert ckpt["optim"]["param_groups"] == fused, path
        assert _state_diff(ckpt["optim"]["state"], state_at_save["state"]) <= TOL, path

    # A plain torch optimizer continues from OSS's checkpoint.
    for path in paths:
        ckpt = torch.load(path, weights_only=False)
        model, opt, sched = _ckpt_setup(torch.optim.Adam)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        assert all(g["fused"] is True and g["foreach"] is None for g in opt.param_groups), opt.param_groups
        _plain_run(CKPT_STEPS, CKPT_STEPS, (model, opt, sched))
        reference = torch.load(ref_path, weights_only=False)
        assert _max_diff(model.parameters(), reference["params"]) <= TOL, path

    # OSS continues at world sizes 1 and 4, from its own checkpoints and from the plain optimizer's.
    for world in (1, 4):
        results = run_distributed(_ckpt_resume, world, [*paths, plain_path], ref_path)
        _assert_small([diffs for diffs, _ in results], f"resumed at world {world}:")
        for rank, (_, flags) in enumerate(results):
            assert all(flags.values()), f"world {world} rank {rank}: {flags}"


# -- 4 and 5. memory per rank and broadcast traffic --------------------------------------------------------------------


def _mixed_params():
    """Float64 and float32 parameters of equal and different sizes, with two frozen ones among them."""
    torch.manual_seed(1)
    shapes = [(40,)] * 12 + [(9, 7), (64,), (5, 5), (3,)]
    params = [
        nn.Parameter(torch.randn(shape, dtype=torch.float64 if i % 2 == 0 else torch.float32))
        for i, shape in enumerate(shapes)
    ]
    params.insert(3, nn.Parameter(torch.randn(50), requires_grad=False))
    params.insert(9, nn.Parameter(torch.randn(6, dtype=torch.float64), requires_grad=False))
    return params


def _clone_params(params):
    return [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params]


def _steps_measured(opt, ref_opt, trainable, ref, seeds):
    """Steps OSS and the reference once per seed; CommStats of OSS's last step (the first one builds messages)."""
    for seed in seeds:
        _set_grads(trainable, seed=seed)
        _set_grads(ref, seed=seed)
        with comm_stats.measure() as m:
            opt.step()
        ref_opt.step()
    return m


def _transport_traffic(rank, opt, trainable, m, wire_bytes_of):
    """Per transport: (measured, expected) calls and payload of one steady-state step on this rank."""
    messages = {(opt.owner_of(p), p.device.type, p.dtype) for p in trainable}
    if os.environ[SHARED_MEMORY_ENV] == "0":
        return {
            "kinds": (sorted({kind for kind, _ in m.snapshot()}), ["broadcast"]),
            "calls": (m.calls("broadcast"), len(messages)),
            "payload": (m.payload_bytes("broadcast"), sum(wire_bytes_of(p) for p in trainable)),
        }
    theirs = [p for p in trainable if opt.owner_of(p) != rank]
    return {
        "kinds": (sorted({kind for kind, _ in m.snapshot()}), ["barrier", "shared_memory"]),
        "calls": ((m.calls("barrier"), m.calls("shared_memory")), (2, len({k for k in messages if k[0] != rank}))),
        "payload": (m.payload_bytes("shared_memory"), sum(wire_bytes_of(p) for p in theirs)),
        "sent": (m.sent_bytes(), 0.0),
    }


def _memory_and_traffic(rank, world):
    out = {}
    try:
        for transport in ("0", "1"):  # DDPKIT_SHARED_MEMORY: broadcast over gloo, then shared memory (one host)
            os.environ[SHARED_MEMORY_ENV] = transport
            out[transport] = _memory_and_traffic_of_transport(rank)
    finally:
        os.environ.pop(SHARED_MEMORY_ENV, None)  # the worker processes serve the next tests too
    return out


def _memory_and_traffic_of_transport(rank):
    out = {}
    params = _mixed_params()
    trainable = [p for p in params if p.requires_grad]
    ref = _clone_params(trainable)
    opt = OSS(params, optim=torch.optim.Adam, lr=0.1)
    ref_opt = torch.optim.Adam(ref, lr=0.1)
    frozen_before = [p.detach().clone() for p in params if not p.requires_grad]
    m = _steps_measured(opt, ref_opt, trainable, ref, seeds=(3, 5))

    # Memory: this rank's optimizer state against the plain optimizer's.
    out["state_bytes"] = _state_bytes(opt.optim.state)
    out["full_state_bytes"] = _state_bytes(ref_opt.state)
    out["largest_param_state"] = max(_state_bytes({0: s}) for s in ref_opt.state.values())

    # Traffic: per (owner, device type, dtype) of the trainable parameters one broadcast, or one copy out of
    # shared memory on the ranks that do not own it (and two barriers), nothing else.
    out["traffic"] = _transport_traffic(rank, opt, trainable, m, lambda p: p.numel() * p.element_size())
    out["frozen untouched"] = all(
        torch.equal(p, before) and opt.owner_of(p) is None
        for p, before in zip([p for p in params if not p.requires_grad], frozen_before, strict=True)
    )
    out["diff"] = _max_diff(trainable, ref)
    segments = opt._broadcaster._segments
    dist.barrier()
    out["segment files left"] = [] if segments is None else glob.glob(f"/dev/shm/ddpkit-{segments.token}-*")

    # broadcast_fp16: half the fp32 payload; owners keep their exact fp32 values, receivers get them rounded.
    params = _mixed_params()
    trainable = [p for p in params if p.requires_grad]
    ref = _clone_params(trainable)
    opt = OSS(params, optim=torch.optim.Adam, lr=0.1, broadcast_fp16=True)
    ref_opt = torch.optim.Adam(ref, lr=0.1)
    m = _steps_measured(opt, ref_opt, trainable, ref, seeds=(4, 6))
    out["fp16 traffic"] = _transport_traffic(
        rank, opt, trainable, m, lambda p: p.numel() * (2 if p.dtype == torch.float32 else p.element_size())
    )
    owner_exact, receivers_rounded, owner_not_rounded = [], [], []
    for p, r in zip(trainable, ref, strict=True):
        owner = opt.owner_of(p)
        owners_value = p.detach().clone()
        dist.broadcast(owners_value, owner)  # raw torch: what the owner holds, at full precision
        if rank == owner:
            owner_exact.append((p - r).abs().max().item())
            if p.dtype == torch.float32:
                owner_not_rounded.append(not torch.equal(p, p.half().float()))
        elif p.dtype == torch.float32:
            receivers_rounded.append(torch.equal(p, owners_value.half().float()))
        else:
            receivers_rounded.append(torch.equal(p, owners_value))
    out["fp16 owner diff"] = max(owner_exact, default=0.0)
    out["fp16 receivers rounded"] = all(receivers_rounded)
    out["fp16 owner not rounded"] = owner_not_rounded
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_memory_is_sharded_and_each_parameter_is_sent_once(world):
    """Over gloo (DDPKIT_SHARED_MEMORY=0) and through shared memory (the default on one host)."""
    everything = run_distributed(_memory_and_traffic, world)
    for transport in ("0", "1"):
        results = [r[transport] for r in everything]
        full = results[0]["full_state_bytes"]
        largest = results[0]["largest_param_state"]
        per_rank = [r["state_bytes"] for r in results]
        assert sum(per_rank) == full, f"the shards must add up to the full state: {per_rank} vs {full}"
        assert max(per_rank) <= full / world + largest, f"unbalanced: {per_rank}, full {full}, largest {largest}"
        for rank, r in enumerate(results):
            where = f"{SHARED_MEMORY_ENV}={transport}, rank {rank}"
            for name in ("traffic", "fp16 traffic"):
                for key, (measured, expected) in r[name].items():
                    assert measured == expected, f"{where}: {name} {key}: measured {measured}, expected {expected}"
            assert r["frozen untouched"], f"{where}: a frozen parameter was changed or given an owner"
            assert r["diff"] <= TOL and r["fp16 owner diff"] <= TOL, r
            assert r["fp16 receivers rounded"], f"{where}: receivers must get the owner's fp16-rounded values"
            assert not r["segment files left"], f"{where}: shared-memory files not unlinked: {r['segment files left']}"
        not_rounded = [flag for r in results for flag in r["fp16 owner not rounded"]]
        assert not_rounded and all(not_rounded), "owners must keep their own fp32 values (not rounded to fp16)"


# -- 5b. parameters live in the broadcast messages -------------------------------------------------------------------


def _storages(params):
    return [p.untyped_storage().data_ptr() for p in params]


def _in_place_messages(rank, world):
    """OSS against torch Adam, gradients averaged by hand, while the parameters' storage is tampered with between
    steps (not under DDP: DDP computes wrong gradients once a parameter's strides changed after its construction)."""
    out = {}
    ref_net, net = _mlp(), _mlp()
    ref_opt = torch.optim.Adam(ref_net.parameters(), lr=1e-2)
    opt = OSS(net.parameters(), optim=torch.optim.Adam, lr=1e-2)
    params = list(net.parameters())
    step = 0

    def steps(n):
        nonlocal step
        for _ in range(n):
            x, y = _data(1000 * step + rank)
            for model, optimizer in ((ref_net, ref_opt), (net, opt)):
                optimizer.zero_grad()
                F.mse_loss(model(x), y).backward()
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad /= world
                optimizer.step()
            step += 1

    steps(2)
    owners = {opt.owner_of(p) for p in params}
    out["one storage per owner"] = len(set(_storages(params))) == len(owners)
    pointers = [p.data_ptr() for p in params]
    steps(2)
    out["no new storage per step"] = pointers == [p.data_ptr() for p in params]
    # The user gives a parameter storage of its own, and makes another one non-contiguous (same values).
    net[0].weight.data = net[0].weight.data.clone()
    net[2].weight.data = net[2].weight.data.t().contiguous().t()
    steps(3)
    out["diff after storage changes"] = _max_diff(net.parameters(), ref_net.parameters())
    out["clone adopted again"] = net[0].weight.data_ptr() in pointers
    out["non-contiguous kept"] = not net[2].weight.is_contiguous()
    # Freezing a parameter takes it out of the messages: it gets storage of its own and stays as it is.
    net[4].weight.requires_grad_(False)
    ref_net[4].weight.requires_grad_(False)
    frozen = net[4].weight.detach().clone()
    steps(3)
    others = [p for p in params if p is not net[4].weight]
    w = net[4].weight
    out["frozen has own storage"] = w.untyped_storage().data_ptr() not in _storages(others)
    out["old message freed"] = w.untyped_storage().nbytes() == w.numel() * w.element_size()
    out["frozen unchanged"] = torch.equal(net[4].weight, frozen)
    out["diff after freezing"] = _max_diff(net.parameters(), ref_net.parameters())
    out["replicas equal"] = _all_same([p.detach().tolist() for p in net.parameters()])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_parameters_live_in_the_broadcast_messages(world):
    """OSS broadcasts each owner's parameters in place (they are views of one flat buffer per owner) and stays exact
    when the user replaces a parameter's storage, makes it non-contiguous or freezes it."""
    for rank, r in enumerate(run_distributed(_in_place_messages, world)):
        for name in ("diff after storage changes", "diff after freezing"):
            assert r[name] <= TOL, f"rank {rank}: {name}: {r[name]:.3e}"
        failed = [name for name, value in r.items() if value is False]
        assert not failed, f"rank {rank}: {failed}"


# -- 6. partition ------------------------------------------------------------------------------------------------------


def _owners_and_loads(opt, params, world):
    owners = [opt.owner_of(p) for p in params]
    loads = [0] * world
    for p, owner in zip(params, owners, strict=True):
        if owner is not None:
            loads[owner] += p.numel() * p.element_size()
    return owners, loads


def _partition(rank, world):
    out = {}
    params = _mixed_params()
    trainable = [p for p in params if p.requires_grad]
    groups = [{"params": params[:7], "lr": 0.1}, {"params": params[7:], "lr": 0.2, "momentum": 0.5}]
    opt = OSS(groups, optim=torch.optim.SGD, lr=0.1)
    owners, loads = _owners_and_loads(opt, params, world)
    again = OSS([{**g, "params": list(g["params"])} for g in groups], optim=torch.optim.SGD, lr=0.1)
    out["deterministic"] = owners == [again.owner_of(p) for p in params]
    out["same on every rank"] = _all_same(owners)
    out["frozen have no owner"] = [o is None for o in owners] == [not p.requires_grad for p in params]
    largest = max(p.numel() * p.element_size() for p in trainable)
    out["balanced"] = max(loads) - min(loads) <= largest and max(loads) <= sum(loads) / world + largest

    # partition_parameters(): per rank, the groups with their hyper-parameters and the parameters it optimizes:
    # every parameter in exactly one rank's, as in fairscale; a trainable one in its owner's.
    parts = opt.partition_parameters()
    shape_ok = len(parts) == world and all(len(rank_groups) == len(groups) for rank_groups in parts)
    holder = {id(p): r for r, rank_groups in enumerate(parts) for part in rank_groups for p in part["params"]}
    shape_ok &= all(holder.get(id(p)) == opt.owner_of(p) for p in trainable)
    for r, rank_groups in enumerate(parts):
        for g, (part, group) in enumerate(zip(rank_groups, opt.param_groups, strict=True)):
            expected = [p for p in group["params"] if holder[id(p)] == r]
            shape_ok &= [id(p) for p in part["params"]] == [id(p) for p in expected]
            shape_ok &= {k: v for k, v in part.items() if k != "params"} == {
                k: v for k, v in group.items() if k != "params"
            }
            if r == rank:
                shape_ok &= [id(p) for p in part["params"]] == [id(p) for p in opt.optim.param_groups[g]["params"]]
    covered = sorted(id(p) for rank_groups in parts for part in rank_groups for p in part["params"])
    out["partition_parameters"] = shape_ok and covered == sorted(id(p) for p in params)

    # A model with one parameter on every rank: empty shards elsewhere, and every rank can still step.
    p = nn.Parameter(torch.randn(3, 3))
    r = nn.Parameter(p.detach().clone())
    one, ref = OSS([p], optim=torch.optim.Adam, lr=0.1), torch.optim.Adam([r], lr=0.1)
    for step in range(3):
        _set_grads([p], step)
        _set_grads([r], step)
        one.step()
        ref.step()
    one_parts = one.partition_parameters()
    out["one param"] = (
        one.owner_of(p) == 0
        and len(one.optim.state) == (1 if rank == 0 else 0)
        and [len(rank_groups[0]["params"]) for rank_groups in one_parts] == [1] + [0] * (world - 1)
        and len(one.state_dict(all_ranks=True)["state"]) == 1
    )
    out["one param diff"] = _max_diff([p], [r])

    # add_param_group: earlier parameters keep their owner; the new ones go to the least-loaded ranks.
    model, ref_model = _mlp(), _mlp()
    head, ref_head = nn.Linear(OUT, 3), nn.Linear(OUT, 3)
    ref_head.load_state_dict(head.state_dict())
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    x, y = _data(7)
    y = y[:, :3]
    for _ in range(2):
        for net, o in ((nn.Sequential(model, head), opt), (nn.Sequential(ref_model, ref_head), ref_opt)):
            _train_step(net, o, x, y)
    before, _ = _owners_and_loads(opt, list(model.parameters()), world)
    loads_before = list(opt._loads)
    opt.add_param_group({"params": head.parameters(), "lr": 5e-3})
    ref_opt.add_param_group({"params": ref_head.parameters(), "lr": 5e-3})
    after, _ = _owners_and_loads(opt, list(model.parameters()), world)
    new_owners = [opt.owner_of(q) for q in head.parameters()]
    least = min(range(world), key=lambda i: (loads_before[i], i))
    out["add_param_group keeps owners"] = before == after and None not in new_owners and new_owners[0] == least
    out["add_param_group groups"] = len(opt.param_groups) == 2 == len(opt.optim.param_groups)
    for _ in range(3):
        for net, o in ((nn.Sequential(model, head), opt), (nn.Sequential(ref_model, ref_head), ref_opt)):
            _train_step(net, o, x, y)
    out["add_param_group diff"] = _max_diff(
        [*model.parameters(), *head.parameters()], [*ref_model.parameters(), *ref_head.parameters()]
    )

    # requires_grad changes: refresh_trainable() explicitly, then step() on its own; then a reload of the state.
    model, ref_model = _mlp(), _mlp()
    for net in (model, ref_model):
        net[0].weight.requires_grad_(False)
        net[4].bias.requires_grad_(False)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    x, y = _data(8)
    flags = [opt.owner_of(model[0].weight) is None]

    def train(steps):
        for _ in range(steps):
            _train_step(model, opt, x, y)
            _train_step(ref_model, ref_opt, x, y)

    train(2)
    model[0].weight.requires_grad_(True)
    ref_model[0].weight.requires_grad_(True)
    opt.refresh_trainable()
    owner = opt.owner_of(model[0].weight)
    flags.append(owner is not None)
    flags.append(any(q is model[0].weight for q in opt.optim.param_groups[0]["params"]) == (owner == rank))
    train(2)
    model[4].bias.requires_grad_(True)
    ref_model[4].bias.requires_grad_(True)
    train(2)  # step() notices the newly trainable parameter itself
    flags.append(opt.owner_of(model[4].bias) is not None)
    flags.append(_all_same([opt.owner_of(q) for q in model.parameters()]))
    saved = opt.state_dict(all_ranks=True)
    opt.load_state_dict(copy.deepcopy(saved))  # loading its own state must change nothing
    train(3)
    out["refresh_trainable"] = all(flags)
    out["refresh_trainable diff"] = _max_diff(model.parameters(), ref_model.parameters())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_partition(world):
    results = run_distributed(_partition, world)
    for rank, out in enumerate(results):
        for name, value in out.items():
            if name.endswith("diff"):
                assert value <= TOL, f"rank {rank}: {name} = {value:.3e}"
            else:
                assert value is True, f"rank {rank}: {name} failed"


def test_partition_balances_bytes_not_elements():
    """Mixed dtypes: balancing element counts would put all the float64 tensors on one rank."""
    from ddpkit.optim.partition import assign_owners

    sizes = [40 * (8 if i % 2 == 0 else 4) for i in range(12)]
    loads = [0, 0]
    owners = assign_owners(sizes, loads)
    assert loads == [sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(2)]
    assert max(loads) - min(loads) <= max(sizes)
    assert assign_owners([5, 5, 5], [0, 0, 0]) == [0, 1, 2]  # ties: lowest rank, in input order
    assert assign_owners([1], [10, 0, 3]) == [1]  # existing loads are respected
    with pytest.raises(ValueError, match="one entry per rank"):
        assign_owners([1], [])


# -- 7. the optimizer API --------------------------------------------------------------------------------------------


class _Recorder(torch.optim.Optimizer):
    """A minimal SGD that records the keyword arguments of step(), keeps a per-group counter in its groups and a
    list (a mutable non-tensor value) in each parameter's state."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            group["born"] = "in the inner optimizer"
        self.kwargs_seen = []

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        self.kwargs_seen.append(kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["steps_taken"] = group.get("steps_taken", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * kwargs.get("scale", 1.0))
                    self.state[p].setdefault("norms", []).append(p.grad.norm().item())
        return loss


class _MixedNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.a = nn.Linear(IN, HIDDEN)
        self.b = nn.Linear(HIDDEN, OUT).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).double()).float()


def _api(rank, world):
    out = {}

    # step(closure) returns the closure's loss; keyword arguments reach the inner step; inner group keys show up.
    for optim, kwargs in ((_Recorder, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
        model, ref_model = _mlp(), _mlp()
        opt = OSS(model.parameters(), optim=optim, **kwargs)
        ref_opt = torch.optim.SGD(ref_model.parameters(), **kwargs)
        step_kwargs = {"scale": 0.5} if optim is _Recorder else {}
        if optim is _Recorder:
            ref_opt.param_groups[0]["lr"] = 0.05
        returned, expected = [], []
        for step in range(3):
            x, y = _data(step)

            def closure(model=model, opt=opt, x=x, y=y, expected=expected):
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                expected.append(loss)
                return loss

            returned.append(opt.step(closure, **step_kwargs))
            _train_step(ref_model, ref_opt, x, y)
        name = optim.__name__
        out[f"{name} closure loss returned"] = all(r is e for r, e in zip(returned, expected, strict=True))
        out[f"{name} diff"] = _max_diff(model.parameters(), ref_model.parameters())
        if optim is _Recorder:
            out["kwargs reach the inner step"] = opt.optim.kwargs_seen == [{"scale": 0.5}] * 3
            out["inner keys appear"] = (
                opt.param_groups[0]["born"] == "in the inner optimizer" and opt.param_groups[0]["steps_taken"] == 3
            )

    # Mixed float32 + float64 parameters, with DDP and different data per rank.
    model, ref_model = DDP(_MixedNet()), DDP(_MixedNet())
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    with comm_stats.measure() as m:
        for step in range(10):
            x, y = _data(50 + 10 * step + rank)
            _train_step(model, opt, x, y)
            _train_step(ref_model, ref_opt, x, y)
    out["mixed dtypes diff"] = _max_diff(model.parameters(), ref_model.parameters())
    # On one host the messages go through shared memory: each rank copies those it does not own.
    out["mixed dtypes payload"] = m.payload_bytes("broadcast") == 0 and m.payload_bytes("shared_memory") == 10 * sum(
        p.numel() * p.element_size() for p in model.parameters() if opt.owner_of(p) != rank
    )

    # A model cast after the optimizer was built.
    model, ref_model = _mlp(), _mlp()
    opt = OSS(_two_groups(model, 1e-2, 3e-3), optim=torch.optim.Adam)
    model.double()
    ref_model.double()
    ref_opt = torch.optim.Adam(_two_groups(ref_model, 1e-2, 3e-3))
    model, ref_model = DDP(model), DDP(ref_model)
    for step in range(10):
        x, y = _data(90 + 10 * step + rank, dtype=torch.float64)
        with comm_stats.measure() as m:
            _train_step(model, opt, x, y)
        _train_step(ref_model, ref_opt, x, y)
    out["cast after build diff"] = _max_diff(model.parameters(), ref_model.parameters())
    out["cast after build dtype"] = all(p.dtype == torch.float64 for p in model.parameters()) and m.payload_bytes(
        "shared_memory"
    ) == sum(p.numel() * 8 for p in model.parameters() if opt.owner_of(p) != rank)

    # A tensor learning rate and a scheduler: loading a state dict must not tie it to the argument.
    model = _mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=torch.tensor(0.1), momentum=0.9)
    x, y = _data(3)
    _train_step(model, opt, x, y)
    loaded = copy.deepcopy(opt.state_dict(all_ranks=True))
    kept = copy.deepcopy(loaded)
    opt2 = OSS(model.parameters(), optim=torch.optim.SGD, lr=torch.tensor(0.1), momentum=0.9)
    opt2.load_state_dict(loaded)
    sched = StepLR(opt2, step_size=1, gamma=0.5)
    for _ in range(2):
        _train_step(model, opt2, x, y)
        sched.step()
    out["tensor lr argument unchanged"] = _same(loaded, kept) and abs(float(opt2.param_groups[0]["lr"]) - 0.025) < 1e-8

    # Non-tensor state (a list that the optimizer appends to): neither consolidation nor loading may share it.
    for force in (False, True):
        model = _mlp()
        opt = OSS(model.parameters(), optim=_Recorder, lr=0.1, force_broadcast_object=force)
        _train_step(model, opt, x, y)
        consolidated = opt.state_dict(all_ranks=True)
        snapshot = copy.deepcopy(consolidated)
        _train_step(model, opt, x, y)
        loaded = copy.deepcopy(consolidated)
        kept_loaded = copy.deepcopy(loaded)
        opt.load_state_dict(loaded)
        _train_step(model, opt, x, y)
        out[f"list state not shared (force_broadcast_object={force})"] = (
            _same(consolidated, snapshot)
            and _same(loaded, kept_loaded)
            and all(len(s["norms"]) == 2 for s in opt.optim.state.values())
            and len(opt.optim.state) > 0
        )
    return out


def _world_one_exact(rank, world):
    """At world size 1 OSS is the wrapped optimizer with the same implementation: bit-for-bit equal."""
    cases = {
        "Adam auto (fused) vs Adam(fused=True)": (torch.optim.Adam, {}, {"fused": True}),
        "Adam(fused=False) vs Adam(fused=False)": (torch.optim.Adam, {"fused": False}, {"fused": False}),
        "Adam(foreach=False) vs Adam(foreach=False)": (torch.optim.Adam, {"foreach": False}, {"foreach": False}),
        "AdamW auto vs AdamW(fused=True)": (
            torch.optim.AdamW,
            {"weight_decay": 0.1},
            {"weight_decay": 0.1, "fused": True},
        ),
        "SGD auto vs SGD(fused=True)": (torch.optim.SGD, {"momentum": 0.9}, {"momentum": 0.9, "fused": True}),
        "SGD(foreach=True) vs SGD(foreach=True)": (
            torch.optim.SGD,
            {"momentum": 0.9, "foreach": True},
            {"momentum": 0.9, "foreach": True},
        ),
    }
    out = {}
    for name, (cls, oss_kwargs, ref_kwargs) in cases.items():
        model, ref_model = _mlp(), _mlp()
        opt = OSS(_two_groups(model, 1e-2, 3e-3), optim=cls, **oss_kwargs)
        ref_opt = cls(_two_groups(ref_model, 1e-2, 3e-3), **ref_kwargs)
        scheds = [StepLR(opt, step_size=4, gamma=0.5), StepLR(ref_opt, step_size=4, gamma=0.5)]
        with comm_stats.measure() as m:
            for step in range(10):
                x, y = _data(step)
                _train_step(model, opt, x, y)
                _train_step(ref_model, ref_opt, x, y)
                for sched in scheds:
                    sched.step()
        out[f"{name}: parameters"] = all(
            torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters(), strict=True)
        )
        out[f"{name}: groups"] = _groups_without_params(opt.param_groups) == _groups_without_params(
            ref_opt.param_groups
        )
        out[f"{name}: no collectives"] = m.calls() == 0
    return out


def test_optimizer_api():
    for rank, out in enumerate(run_distributed(_api, 2)):
        for name, value in out.items():
            if name.endswith("diff"):
                assert value <= TOL, f"rank {rank}: {name} = {value:.3e}"
            else:
                assert value is True, f"rank {rank}: {name} failed"
    (exact,) = run_distributed(_world_one_exact, 1)
    assert all(exact.values()), [name for name, ok in exact.items() if not ok]


# -- 8. errors, raised before any collective ---------------------------------------------------------------------------


def _errors(rank, world):
    out = {}

    def expect(name, exc_type, match, fn):
        with comm_stats.measure() as m:
            try:
                fn()
                out[name] = "no error"
            except exc_type as exc:
                out[name] = True if match in str(exc) and m.calls() == 0 else f"{exc} ({m.calls()} collectives)"

    model = _mlp()
    expect(
        "optim instance",
        TypeError,
        "torch.optim.Optimizer subclass",
        lambda: OSS(model.parameters(), optim=torch.optim.SGD(model.parameters(), lr=0.1)),
    )
    expect(
        "optim not a class", TypeError, "torch.optim.Optimizer subclass", lambda: OSS(model.parameters(), optim=dict)
    )
    expect("lr a string", TypeError, "lr must be a number, got '0.1'", lambda: OSS(model.parameters(), lr="0.1"))
    expect(
        "betas not numbers",
        TypeError,
        "betas must be a pair of numbers",
        lambda: OSS(model.parameters(), optim=torch.optim.Adam, betas=("0.9", "0.99")),
    )
    meta = nn.Parameter(torch.empty(3, device="meta"))
    expect("mixed devices", ValueError, "several device types", lambda: OSS([*model.parameters(), meta]))

    opt = OSS(_two_groups(model, 0.1, 0.1), optim=torch.optim.Adam)
    expect("add_param_group meta", ValueError, "several device types", lambda: opt.add_param_group({"params": [meta]}))
    out["rejected group not added"] = len(opt.param_groups) == 2 == len(opt.optim.param_groups)
    for bad in (world, -2, "0", 0.0, True):
        expect(f"recipient_rank {bad!r}", ValueError, "recipient_rank", lambda bad=bad: opt.consolidate_state_dict(bad))
    expect("state_dict before consolidation", RuntimeError, "consolidate_state_dict", opt.state_dict)

    x, y = _data(rank)
    _train_step(DDP(model), opt, x, y)  # every rank is still in step: a collective after the errors works
    good = opt.state_dict(all_ranks=True)
    one_group = {"state": good["state"], "param_groups": good["param_groups"][:1]}
    short_group = copy.deepcopy(good)
    short_group["param_groups"][1]["params"] = short_group["param_groups"][1]["params"][:-1]
    before = copy.deepcopy(opt.optim.state_dict())
    expect("load fewer groups", ValueError, "parameter groups", lambda: opt.load_state_dict(one_group))
    expect("load fewer params", ValueError, "parameters in the state dict", lambda: opt.load_state_dict(short_group))
    expect(
        "load not a state dict", ValueError, "'state' and 'param_groups'", lambda: opt.load_state_dict({"state": {}})
    )
    out["failed loads changed nothing"] = _same(opt.optim.state_dict(), before)
    _train_step(DDP(model), opt, x, y)
    out["still in step"] = _all_same([p.sum().item() for p in model.parameters()])
    return out


def _without_process_group(rank, world):
    try:
        OSS(_mlp().parameters(), optim=torch.optim.SGD, lr=0.1)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_errors_are_raised_before_any_collective():
    (message,) = run_distributed(_without_process_group, 1, init=False)
    assert "OSS needs an initialised process group" in message and "init_process_group" in message, message
    for rank, out in enumerate(run_distributed(_errors, 2)):
        failed = {name: value for name, value in out.items() if value is not True}
        assert not failed, f"rank {rank}: {failed}"
