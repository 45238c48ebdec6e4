"""ShardedGradScaler: ranks agree on skipped steps and on the scale; parity with torch's GradScaler + DDP."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import comm_stats
from ddpkit.optim import OSS, ShardedGradScaler
from ddpkit.testing import run_distributed

INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 3


def _model(seed=0, sizes=(8, 16, 4)):
    torch.manual_seed(seed)
    layers = []
    for i in range(len(sizes) - 1):
        layers += [torch.nn.Linear(sizes[i], sizes[i + 1]), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _one_param_model():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1, bias=False)


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=g)


def _loss(model, x, dtype=torch.bfloat16):
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    return out.float().pow(2).mean()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _expected_scales(steps, bad_steps, init=INIT_SCALE, interval=GROWTH_INTERVAL):
    """The scale after each update() for the given skipped steps (growth 2, backoff 0.5)."""
    scale, tracker, out = init, 0, []
    for step in range(steps):
        if step in bad_steps:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * 2.0, 0
        out.append(scale)
    return out


# -- an overflow on one rank -------------------------------------------------------------------------------------


def _overflow_scenario(rank, world, kind, drop_non_owned, one_param, bad_rank, poison, steps=6, bad_step=2):
    """Trains `steps` steps; at `bad_step` only `bad_rank` puts `poison` into one of the gradients it holds."""
    model = _one_param_model() if one_param else _model()
    ddp = DDP(model)
    if kind == "fused-adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    else:
        optim = torch.optim.SGD if kind == "oss-sgd" else torch.optim.Adam
        optimizer = OSS(model.parameters(), optim=optim, lr=0.01)
    scaler = ShardedGradScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    scales, changed, held = [], [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(_loss(ddp, _batch(rank, step))).backward()
        if drop_non_owned:  # what ShardedDataParallel leaves: only the gradients of the parameters this rank owns
            for p in model.parameters():
                if optimizer.owner_of(p) != rank:
                    p.grad = None
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        held.append(len(grads))
        if step == bad_step and rank == bad_rank:
            assert grads, "the poisoned rank must hold a gradient"
            grads[-1].view(-1)[0] = poison
        before = _flat(model)
        with comm_stats.measure() as delta:
            scaler.step(optimizer)
        assert delta.calls("all_reduce") == 1 and delta.payload_bytes("all_reduce") == 4
        scaler.update()
        changed.append(not torch.equal(before, _flat(model)))
        scales.append(scaler.get_scale())
    return {"scales": scales, "changed": changed, "held": held, "params": _flat(model), "state": scaler.state_dict()}


def _overflow_suite(rank, world):
    out = {}
    for kind in ("oss-sgd", "oss-adam"):
        for drop in (False, True):
            out[(kind, drop, False)] = _overflow_scenario(rank, world, kind, drop, False, world - 1, math.inf)
    out[("fused-adam", False, False)] = _overflow_scenario(rank, world, "fused-adam", False, False, 0, math.nan)
    if world == 4:  # one parameter: ranks 1-3 own nothing and hold no gradient at all
        out[("oss-adam", True, True)] = _overflow_scenario(rank, world, "oss-adam", True, True, 0, math.nan)
        out[("oss-sgd", True, True)] = _overflow_scenario(rank, world, "oss-sgd", True, True, 0, -math.inf)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_overflow_on_one_rank_skips_everywhere(world):
    results = run_distributed(_overflow_suite, world)
    expected_scales = _expected_scales(6, {2})
    assert set(results[0]) == set(results[-1])
    for key in results[0]:
        per_rank = [r[key] for r in results]
        for rank, r in enumerate(per_rank):
            assert r["scales"] == expected_scales, (key, rank)
            assert r["changed"] == [True, True, False, True, True, True], (key, rank)
            assert torch.equal(r["params"], per_rank[0]["params"]), (key, rank)
            assert r["state"] == per_rank[0]["state"], (key, rank)
        if key[2]:  # the one-parameter model: every rank but the owner held no gradient
            assert per_rank[0]["held"] == [1] * 6
            assert all(r["held"] == [0] * 6 for r in per_rank[1:])


# -- parity with torch.amp.GradScaler + DDP ----------------------------------------------------------------------


def _parity(rank, world, steps=10, overflow_step=None):
    report = {}
    for dtype in (torch.bfloat16, torch.float16):
        for name, optim, kwargs in (("sgd", torch.optim.SGD, {"momentum": 0.9}), ("adam", torch.optim.Adam, {})):
            ours_model, ref_model = _model(), _model()
            ours, ref = DDP(ours_model), DDP(ref_model)
            ours_opt = OSS(ours_model.parameters(), optim=optim, lr=0.01, **kwargs)
            ref_opt = optim(ref_model.parameters(), lr=0.01, **kwargs)
            ours_scaler = ShardedGradScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
            ref_scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
            scales, max_diff = [], 0.0
            for step in range(steps):
                x = _batch(rank, step)
                for model, opt, scaler in ((ours, ours_opt, ours_scaler), (ref, ref_opt, ref_scaler)):
                    opt.zero_grad()
                    scaler.scale(_loss(model, x, dtype)).backward()
                    if step == overflow_step:  # on every rank and in both runs
                        next(model.parameters()).grad.view(-1)[0] = math.inf
                    scaler.step(opt)
                    scaler.update()
                assert ours_scaler.get_scale() == ref_scaler.get_scale()
                assert ours_scaler.state_dict() == ref_scaler.state_dict()
                scales.append(ours_scaler.get_scale())
                max_diff = max(max_diff, (_flat(ours_model) - _flat(ref_model)).abs().max().item())
            report[(str(dtype), name)] = (scales, max_diff, _flat(ours_model))
    return report


@pytest.mark.parametrize("world, overflow_step", [(2, None), (4, None), (2, 5)])
def test_parity_with_torch_grad_scaler_and_ddp(world, overflow_step):
    results = run_distributed(_parity, world, 10, overflow_step)
    expected = _expected_scales(10, set() if overflow_step is None else {overflow_step})
    if overflow_step is None:
        assert expected[-1] == INIT_SCALE * 8  # grew three times
    for key, (scales, max_diff, params) in results[0].items():
        assert scales == expected, key
        assert max_diff <= 1e-6, (key, max_diff)
        for other in results[1:]:
            assert torch.equal(other[key][2], params), key


# -- communication -----------------------------------------------------------------------------------------------


def _counted(rank, world):
    model = _model()
    ddp = DDP(model)
    first, second = list(model[0].parameters()), list(model[2].parameters())
    opt_a = OSS(first, optim=torch.optim.SGD, lr=0.01)
    opt_b = OSS(second, optim=torch.optim.Adam, lr=0.01)
    scaler = ShardedGradScaler(init_scale=INIT_SCALE)
    calls = []
    for step, explicit in enumerate(([], [opt_a], [opt_a, opt_b], [opt_b])):
        for opt in (opt_a, opt_b):
            opt.zero_grad()
        scaler.scale(_loss(ddp, _batch(rank, step))).backward()
        with comm_stats.measure() as unscale_delta:
            for opt in explicit:
                scaler.unscale_(opt)
        with comm_stats.measure() as step_delta:
            scaler.step(opt_a)
            scaler.step(opt_b)
        with comm_stats.measure() as update_delta:
            scaler.update()
        calls.append(
            (
                unscale_delta.calls("all_reduce"),
                step_delta.calls("all_reduce"),
                unscale_delta.payload_bytes("all_reduce") + step_delta.payload_bytes("all_reduce"),
                update_delta.calls(),
            )
        )
        assert step_delta.calls("all_reduce", "world") == step_delta.calls("all_reduce")
    with pytest.raises(RuntimeError, match="already been called"):  # torch's own guard still applies
        scaler.scale(_loss(ddp, _batch(rank, 9))).backward()
        scaler.unscale_(opt_a)
        scaler.unscale_(opt_a)
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()

    # a process group of two ranks: an overflow on rank 0 skips the step on ranks 0 and 1 only
    groups = [dist.new_group(list(range(i, min(i + 2, world)))) for i in range(0, world, 2)]
    mine = groups[rank // 2]
    local = _model(seed=1)
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    sub_scaler = ShardedGradScaler(init_scale=INIT_SCALE, process_group=mine)
    sub_scaler.scale(_loss(local, _batch(0, 0))).backward()
    if rank == 0:
        next(local.parameters()).grad.view(-1)[0] = math.inf
    before = _flat(local)
    with comm_stats.measure() as sub_delta:
        sub_scaler.step(opt)
    sub_scaler.update()
    stepped = not torch.equal(before, _flat(local))
    labels = sorted(group for (_, group) in sub_delta.snapshot())
    dist.destroy_process_group(mine)
    return {"calls": calls, "stepped": stepped, "labels": labels, "scale": sub_scaler.get_scale()}


@pytest.mark.parametrize("world", [2, 4])
def test_one_all_reduce_per_optimizer_per_step(world):
    results = run_distributed(_counted, world)
    for rank, r in enumerate(results):
        # (all-reduces in explicit unscale_, all-reduces in step, their payload bytes, collectives in update)
        assert r["calls"] == [(0, 2, 8, 0), (1, 1, 8, 0), (2, 0, 8, 0), (1, 1, 8, 0)]
        in_first_pair = rank < 2
        assert r["stepped"] is not in_first_pair
        assert r["scale"] == (INIT_SCALE / 2 if in_first_pair else INIT_SCALE)
        pair = f"ranks[{rank // 2 * 2},{rank // 2 * 2 + 1}]" if world > 2 else "world"
        assert r["labels"] == [pair]


# -- single process: construction, errors, state ----------------------------------------------------------------


def _train_locally(scaler, steps=4, poison_step=None):
    model = _model(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, _batch(0, step))).backward()
        if step == poison_step:
            next(model.parameters()).grad.view(-1)[0] = math.nan
        scaler.step(opt)
        scaler.update()
    return _flat(model)


def test_defaults_and_state_dict_round_trip():
    assert not dist.is_initialized()
    scaler = ShardedGradScaler()
    assert scaler._device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**16 and scaler.process_group is None
    assert ShardedGradScaler(device=torch.device("cpu"))._device == "cpu"

    # without a process group in a one-process job it is torch's GradScaler, and sends nothing
    ours = ShardedGradScaler(INIT_SCALE, growth_interval=2, device="cpu")  # fairscale's positional order
    ref = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    with comm_stats.measure() as delta:
        ours_params = _train_locally(ours, steps=5, poison_step=1)
    assert delta.calls() == 0
    assert torch.equal(ours_params, _train_locally(ref, steps=5, poison_step=1))
    assert ours.state_dict() == ref.state_dict()
    assert ours.get_scale() == INIT_SCALE  # backed off once, grew once

    state = ours.state_dict()
    restored = ShardedGradScaler(init_scale=1.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    _train_locally(restored, steps=1)  # the lazily created scale tensors pick up the loaded values
    assert restored.get_scale() == INIT_SCALE * 2  # the loaded tracker was 1; one more clean step grows
    with pytest.raises(RuntimeError, match="empty"):
        restored.load_state_dict(ShardedGradScaler(enabled=False).state_dict())


def test_disabled_scaler_needs_no_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    scaler = ShardedGradScaler(enabled=False)
    assert not scaler.is_enabled() and scaler.state_dict() == {} and scaler.get_scale() == 1.0
    before = _flat(_model(seed=3))
    assert not torch.equal(_train_locally(scaler, steps=2), before)  # plain optimizer steps


def test_enabled_scaler_in_a_multi_rank_job_without_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 but no process group is initialised"):
        _train_locally(ShardedGradScaler(device="cpu"), steps=1)


def test_argument_errors_name_the_argument():
    for kwargs, match in (
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"device": "not-a-device"}, "device"),
    ):
        with pytest.raises(ValueError, match=match):
            ShardedGradScaler(**kwargs)
    with pytest.raises(TypeError, match="process_group"):
        ShardedGradScaler(process_group="world")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="device='cuda' but CUDA is not available"):
            ShardedGradScaler(device="cuda")
        assert not ShardedGradScaler(device="cuda", enabled=False).is_enabled()
    with pytest.raises(TypeError, match=r"pass the device by keyword: device='cpu'"):
        ShardedGradScaler("cpu")
