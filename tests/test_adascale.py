"""AdaScale: the estimator against hand-computed values, and training against single-process accumulation, torch
DDP, OSS and ShardedDataParallel on 2 and 4 gloo ranks."""

import contextlib
import copy
import functools
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from ddpkit.distributed import comm_stats
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS, AdaScale, AdaScaleWrapper
from ddpkit.optim.adascale_math import Observation, SmoothedEstimate, combined_gain, default_smoothing, gain, observe
from ddpkit.testing import run_distributed

TOL = 1e-6
LR, MOMENTUM, BIAS_LR = 0.1, 0.9, 0.05
STEPS = 6


# -- the estimator, by hand ---------------------------------------------------------------------------------------


def _stats(grads):
    """(sum_i ||g_i||^2, ||mean g||^2) of a list of gradient vectors."""
    stacked = torch.stack([torch.as_tensor(g, dtype=torch.float64) for g in grads])
    return float((stacked**2).sum()), float(stacked.mean(0).pow(2).sum())


def test_estimates_and_gain_by_hand():
    # g1 = (3, 0), g2 = (1, 2): sum ||g||^2 = 14, mean = (2, 1), ||mean||^2 = 5, v = (14 - 2 * 5) / 1 = 4,
    # mu2 = 5 - 4 / 2 = 3, sigma2 = v * scale / S.
    assert _stats([[3.0, 0.0], [1.0, 2.0]]) == (14.0, 5.0)
    obs = observe(14.0, 5.0, num_grads=2, scale=2)
    assert (obs.sigma2, obs.mu2) == (4.0, 3.0)
    assert gain(obs.sigma2, obs.mu2, 2) == pytest.approx(7 / 5, abs=1e-15)
    # each micro-gradient averages 2 base batches (scale 4 with S = 2): one base batch is twice as noisy
    obs4 = observe(14.0, 5.0, num_grads=2, scale=4)
    assert (obs4.sigma2, obs4.mu2) == (8.0, 3.0)
    assert gain(obs4.sigma2, obs4.mu2, 4) == pytest.approx(11 / 5, abs=1e-15)
    # identical gradients: no variance (clamped at 1e-6), gain 1
    same = observe(*_stats([[1.0, -2.0, 0.5]] * 4), num_grads=4, scale=4)
    assert same.sigma2 == 1e-6 and same.mu2 == pytest.approx(5.25, rel=1e-12)
    assert gain(same.sigma2, same.mu2, 4) == pytest.approx(1.0, abs=1e-6)
    # orthogonal gradients of equal norm: no signal left (mu2 = 0), the maximal gain S
    for s in (2, 4):
        ortho = observe(*_stats(torch.eye(s) * 3.0), num_grads=s, scale=s)
        assert ortho.mu2 == pytest.approx(0.0, abs=1e-12) and ortho.sigma2 == pytest.approx(9.0, rel=1e-12)
        assert gain(ortho.sigma2, ortho.mu2, s) == pytest.approx(s, rel=1e-12)
    # opposite gradients: mu2 would be negative, clamped at 0
    assert observe(*_stats([[1.0], [-1.0], [0.9], [-1.1]]), num_grads=4, scale=4).mu2 == 0.0
    assert default_smoothing(8) == pytest.approx(0.992) and default_smoothing(1000) == default_smoothing(4096) == 0.0
    # the whole model's gain comes from the sums of the groups' estimates
    a, b = SmoothedEstimate(), SmoothedEstimate()
    a.update(observe(14.0, 5.0, 2, 2), 0.0)
    b.update(observe(*_stats([[1.0, 0.0], [0.0, 1.0]]), 2, 2), 0.0)  # sigma2 1, mu2 0
    assert combined_gain([a, b], 2) == pytest.approx((4 + 1 + 3) / ((4 + 1) / 2 + 3), abs=1e-15)
    assert combined_gain([SmoothedEstimate()], 2) == 1.0


def test_moving_averages_match_their_definitions():
    xs = [(4.0, 3.0), (1.0, 0.5), (9.0, 2.0), (2.5, 7.0), (0.1, 0.2), (6.0, 1.0), (3.0, 3.0)]
    for theta in (0.0, 0.5, 0.8):
        debiased, plain = SmoothedEstimate(debias=True), SmoothedEstimate(debias=False)
        m, history, prev = [0.0, 0.0], [], (0.0, 0.0)
        for t, (s2, u2) in enumerate(xs, start=1):
            observation = Observation(s2, u2)
            debiased.update(observation, theta)
            plain.update(observation, theta)
            history.append((s2, u2))
            # debiased: exponential average from zero divided by its weight 1 - theta^t
            m = [theta * m[k] + (1 - theta) * history[-1][k] for k in range(2)]
            expect = [v / (1 - theta**t) for v in m]
            assert (debiased.sigma2, debiased.mu2) == pytest.approx(expect, rel=1e-12, abs=1e-12), (theta, t)
            # plain: the mean of the first 1 / (1 - theta) observations, then the exponential average
            if t <= 1 / (1 - theta):
                expect = [sum(h[k] for h in history) / t for k in range(2)]
            else:
                expect = [theta * prev[k] + (1 - theta) * history[-1][k] for k in range(2)]
            assert (plain.sigma2, plain.mu2) == pytest.approx(expect, rel=1e-12, abs=1e-12), (theta, t)
            prev = (plain.sigma2, plain.mu2)
    assert debiased.count == len(xs)


# -- one process accumulating micro-batches ----------------------------------------------------------------------------


def _linear_step(micro_grads, opt_kwargs=None, is_scaled_loss=True, lr=0.1):
    """One AdaScale update of a bias-free linear layer whose loss ``w . x`` has gradient x per micro-batch."""
    n = len(micro_grads)
    layer = nn.Linear(len(micro_grads[0]), 1, bias=False)
    nn.init.zeros_(layer.weight)
    opt = AdaScale(
        torch.optim.SGD(layer.parameters(), lr=lr),
        num_gradients_to_accumulate=n,
        is_scaled_loss=is_scaled_loss,
        **(opt_kwargs or {}),
    )
    for g in micro_grads:
        loss = (layer.weight @ torch.tensor(g)).sum()
        (loss / n if is_scaled_loss else loss).backward()
    if not is_scaled_loss:
        opt.scale_grad_by_num_grads_to_accum()
    opt.step()
    return layer, opt


def test_single_process_accumulation_by_hand():
    for is_scaled in (True, False):
        layer, opt = _linear_step([[3.0, 0.0], [1.0, 2.0]], is_scaled_loss=is_scaled)
        assert opt.estimates() == pytest.approx((4.0, 3.0), rel=1e-7)
        assert opt.gain() == opt.gain(0) == pytest.approx(1.4, rel=1e-7)
        assert opt.scale_invariant_steps == pytest.approx(1.4, rel=1e-7)
        # w = 0 - lr * gain * mean gradient (2, 1); the learning rate is back to 0.1 afterwards
        assert layer.weight.detach().flatten().tolist() == pytest.approx([-0.28, -0.14], rel=1e-6)
        assert opt.param_groups[0]["lr"] == 0.1
    layer, opt = _linear_step([[3.0, 0.0], [0.0, 3.0]])  # orthogonal: gain 2
    assert opt.gain() == pytest.approx(2.0, rel=1e-7)
    layer, opt = _linear_step([[1.0, 2.0]] * 4)  # identical: gain 1
    assert opt.gain() == pytest.approx(1.0, abs=1e-6) and opt.estimates()[0] == 1e-6
    assert opt.scale == 4 and opt.smoothing == pytest.approx(0.996)
    layer, opt = _linear_step([[3.0, 0.0], [1.0, 2.0]], {"scale": 4})  # two base batches per micro-batch
    assert opt.estimates() == pytest.approx((8.0, 3.0), rel=1e-7) and opt.gain() == pytest.approx(2.2, rel=1e-7)
    # a tensor learning rate is scaled and restored too
    layer, opt = _linear_step([[3.0, 0.0], [1.0, 2.0]], lr=torch.tensor(0.1))
    assert layer.weight.detach().flatten().tolist() == pytest.approx([-0.28, -0.14], rel=1e-6)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.1)


def _toy(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    return model


def _groups(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": BIAS_LR}]


def _batch(step, micro, n=5):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _local_reference(num_micro, steps=STEPS, branchy=False):
    """One process accumulating `num_micro` micro-batches per update, StepLR driven by scale-invariant progress."""
    model = _Branchy() if branchy else _toy()
    opt = AdaScale(_sgd(_groups(model)), world_size=1, num_gradients_to_accumulate=num_micro)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    gains = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(num_micro):
            x, y = _batch(step, micro)
            (nn.functional.mse_loss(_forward(model, x, step, micro, branchy), y) / num_micro).backward()
        opt.step()
        opt.step_scheduler(sched)
        gains.append((opt.gain(0), opt.gain(1), opt.gain()))
    return model, opt, gains


def _forward(model, x, step, micro, branchy):
    return model(x, _uses_extra(step, micro)) if branchy else model(x)


def test_multiple_groups_schedule_and_state_dict_round_trip():
    model, opt, gains = _local_reference(4, steps=8)
    assert all(1.0 <= g <= 4.0 for step in gains for g in step)
    assert len({g[0] for g in gains}) > 1 and gains[0][0] != gains[0][1]  # per-group gains
    # the whole model's gain is the sum of the per-step gains, and the schedule follows floor(progress)
    model = _toy()
    opt = AdaScale(_sgd(_groups(model)), num_gradients_to_accumulate=4)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    progress, saved = 0.0, None
    for step in range(8):
        opt.zero_grad()
        for micro in range(4):
            x, y = _batch(step, micro)
            (nn.functional.mse_loss(model(x), y) / 4).backward()
        lr_used = opt.param_groups[0]["lr"]
        assert lr_used == pytest.approx(LR * 0.5 ** (math.floor(progress) // 2))
        opt.step()
        progress += opt.gain()
        opt.step_scheduler(sched)
        assert opt.scale_invariant_steps == pytest.approx(progress, rel=1e-12)
        assert sched.last_epoch == math.floor(progress)
        if step == 3:  # checkpoint mid-run
            saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    final = [p.detach().clone() for p in model.parameters()]
    assert saved[1]["adascale"]["updates"] == 4
    # resume from the checkpoint: the rest of the run is reproduced exactly
    model2 = _toy(seed=7)
    opt2 = AdaScale(_sgd(_groups(model2)), num_gradients_to_accumulate=4)
    sched2 = StepLR(opt2, step_size=2, gamma=0.5)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    assert opt2.scale_invariant_steps == saved[1]["adascale"]["scale_invariant_steps"]
    assert opt2.estimates(1) == tuple(saved[1]["adascale"]["estimates"][1][k] for k in ("sigma2", "mu2"))
    for step in range(4, 8):
        opt2.zero_grad()
        for micro in range(4):
            x, y = _batch(step, micro)
            (nn.functional.mse_loss(model2(x), y) / 4).backward()
        opt2.step()
        opt2.step_scheduler(sched2)
    assert all(torch.equal(a, b) for a, b in zip(final, model2.parameters(), strict=True))
    assert opt2.scale_invariant_steps == opt.scale_invariant_steps and opt2.gain() == opt.gain()
    # the checkpoint loads into the plain torch optimizer as well (the AdaScale entry is ignored there)
    _sgd(_groups(_toy())).load_state_dict(saved[1])
    with pytest.raises(ValueError, match="parameter groups"):
        AdaScale(_sgd(_toy().parameters()), num_gradients_to_accumulate=2).load_state_dict(saved[1])


def test_closure_zero_grad_frozen_and_unused_parameters():
    model = _toy()
    model[0].weight.requires_grad_(False)  # frozen: no hook, no estimate contribution
    opt = AdaScale(_sgd(_groups(model)), num_gradients_to_accumulate=2)
    x, y = _batch(0, 0)

    def closure():
        opt.zero_grad()
        for micro in range(2):
            xm, ym = _batch(0, micro)
            (nn.functional.mse_loss(model[2](torch.tanh(xm.repeat(1, 3)[:, :16])), ym) / 2).backward()
        return torch.tensor(1.5)

    assert opt.step(closure).item() == 1.5  # model[0] got no gradient at all; model[2] did
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert 1 <= opt.gain(0) <= 2 and 1 <= opt.gain(1) <= 2
    # gradients measured, then cleared by zero_grad: the next update starts afresh
    nn.functional.mse_loss(model(x), y).backward()
    opt.zero_grad()
    assert not opt._meter.pending
    # a group that gets no gradient keeps its estimates (and gain)
    before = opt.estimates(0)
    model[2].weight.requires_grad_(False)
    opt.zero_grad()  # picks up the requires_grad change
    for micro in range(2):
        xm, ym = _batch(1, micro)
        (nn.functional.mse_loss(model(xm), ym) / 2).backward()
    opt.step()
    assert opt.estimates(0) == before


def test_set_scale_and_set_num_gradients_to_accumulate():
    # fairscale's meaning: set_scale(update_estimate=True) multiplies the variance estimate by old / new scale,
    # update_estimate=False keeps it; set_num_gradients_to_accumulate keeps the scale and (by default) resets the
    # smoothing to max(1 - S / 1000, 0), even a smoothing given to the constructor.
    _, opt = _linear_step([[3.0, 0.0], [1.0, 2.0]])  # sigma2 4, mu2 3 at scale 2
    opt.set_scale(8)
    assert opt.scale == 8 and opt.estimates() == pytest.approx((4.0 * 2 / 8, 3.0), rel=1e-7)
    assert opt.gain() == pytest.approx((1 + 3) / (1 / 8 + 3), rel=1e-7)
    opt.set_scale(4, update_estimate=False)
    assert opt.estimates() == pytest.approx((1.0, 3.0), rel=1e-7)
    assert opt.gain() == pytest.approx(4 / (1 / 4 + 3), rel=1e-7)
    opt.set_num_gradients_to_accumulate(16)
    assert opt.scale == 4 and opt.num_gradients_to_accumulate == 16 and opt.smoothing == pytest.approx(0.984)
    _, opt = _linear_step([[3.0, 0.0], [1.0, 2.0]])
    opt.set_num_gradients_to_accumulate(8, update_smoothing=False)
    assert opt.scale == 2 and opt.smoothing == pytest.approx(0.998)
    assert opt.estimates() == pytest.approx((4.0, 3.0), rel=1e-7)
    _, opt = _linear_step([[3.0, 0.0], [1.0, 2.0]], {"smoothing": 0.25})
    opt.set_num_gradients_to_accumulate(500, update_smoothing=False)
    assert opt.smoothing == 0.25 and opt.scale == 2
    # the new count applies to the next update: 4 micro-batches with losses divided by 4, scale still 2
    opt.set_num_gradients_to_accumulate(4)
    assert opt.smoothing == pytest.approx(0.996)
    opt.zero_grad()
    weight = opt.param_groups[0]["params"][0]
    for k, g in enumerate(([1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0])):
        ((weight @ torch.tensor(g)).sum() / 4).backward()
        assert (opt._estimates[0].count, opt._backward_passes) == ((1, k + 1) if k < 3 else (2, 0))
    # zero mean: v = 4/3, sigma2 = v * scale / S = 2/3; debiased average: first update (theta 0.25) weight 0.75
    # holding 4, then theta 0.996: m = 0.996 * 0.75 * 4 + 0.004 * 2/3, w = 0.996 * 0.75 + 0.004
    expected = (0.996 * 0.75 * 4 + 0.004 * 2 / 3) / (0.996 * 0.75 + 0.004)
    assert opt.estimates()[0] == pytest.approx(expected, rel=1e-6)
    opt.step()


def test_clear_errors():
    params = _toy().parameters
    with pytest.raises(ValueError, match="scale must be"):
        AdaScale(_sgd(params()), world_size=1, num_gradients_to_accumulate=2, scale=0.5)
    with pytest.raises(ValueError, match="single worker without gradient accumulation"):
        AdaScale(_sgd(params()))
    with pytest.raises(ValueError, match="single worker without gradient accumulation"):
        AdaScaleWrapper(params(), lr=0.1)
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer instance"):
        AdaScale(torch.optim.SGD, num_gradients_to_accumulate=2)
    with pytest.raises(TypeError, match="optimizer must be"):
        AdaScale(list(params()), num_gradients_to_accumulate=2)
    with pytest.raises(TypeError, match="optim_cls must be"):
        AdaScaleWrapper(params(), num_gradients_to_accumulate=2, optim_cls=_sgd)
    with pytest.raises(ValueError, match="smoothing must be"):
        AdaScale(_sgd(params()), num_gradients_to_accumulate=2, smoothing=1.0)
    with pytest.raises(ValueError, match="num_gradients_to_accumulate must be"):
        AdaScale(_sgd(params()), num_gradients_to_accumulate=0)
    with pytest.raises(ValueError, match="world_size=2 but no process group"):
        AdaScale(_sgd(params()), world_size=2)
    with pytest.raises(TypeError, match="debias_ewma must be a bool"):
        AdaScale(_sgd(params()), num_gradients_to_accumulate=2, debias_ewma="yes")
    _, opt = _linear_step([[3.0, 0.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="scale must be"):
        opt.set_scale(float("nan"))
    with pytest.raises(ValueError, match="expected an int >= 1"):
        opt.set_num_gradients_to_accumulate(1.5)
    with pytest.raises(ValueError, match="single worker needs"):
        opt.set_num_gradients_to_accumulate(1)
    with pytest.raises(RuntimeError, match="already divided"):
        opt.scale_grad_by_num_grads_to_accum()
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        opt.step_scheduler(ReduceLROnPlateau(opt))
    weight = opt.param_groups[0]["params"][0]
    (weight.sum() / 2).backward()
    with pytest.raises(RuntimeError, match="between updates"):
        opt.set_num_gradients_to_accumulate(4)
    unscaled = AdaScale(_sgd([weight]), num_gradients_to_accumulate=2, is_scaled_loss=False)
    weight.sum().backward()
    before = (unscaled.estimates(), unscaled.gain())
    with pytest.warns(UserWarning, match=r"1 backward pass\(es\) in this update .* estimates stay as they are"):
        unscaled.step()  # a shorter last accumulation: the current gain, no new estimate
    assert (unscaled.estimates(), unscaled.gain()) == before and not unscaled._meter.pending
    weight.sum().backward()
    weight.sum().backward()
    with pytest.raises(RuntimeError, match="call scale_grad_by_num_grads_to_accum"):
        unscaled.step()
    unscaled.unhook()
    with pytest.raises(RuntimeError, match="unhook"):
        unscaled.step()


def test_wrapper_passes_each_option_to_its_place():
    model = _toy()
    opt = AdaScaleWrapper(
        _groups(model), num_gradients_to_accumulate=3, debias_ewma=False, smoothing=0.25, scale=5, momentum=0.5, lr=0.2
    )
    assert isinstance(opt.optimizer, torch.optim.SGD) and opt.param_groups is opt.optimizer.param_groups
    assert opt.param_groups[0]["momentum"] == 0.5 and opt.param_groups[0]["lr"] == 0.2
    assert opt.param_groups[1]["lr"] == BIAS_LR
    assert (opt.scale, opt.smoothing, opt.num_gradients_to_accumulate) == (5.0, 0.25, 3)
    assert opt._estimates[0].debias is False and opt._estimates[1].debias is False
    adam = AdaScaleWrapper(model.parameters(), num_gradients_to_accumulate=2, optim_cls=torch.optim.Adam, lr=1e-3)
    assert isinstance(adam.optimizer, torch.optim.Adam)


# -- data parallel, against one process accumulating the same micro-batches --------------------------------------------


class _Branchy(nn.Module):
    """A frozen input layer, and a head used only on even micro-batches of even steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = _toy()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.extra = nn.Linear(3, 3)

    def forward(self, x, use_extra):
        out = self.body(self.frozen(x))
        return self.extra(out) if use_extra else out


def _uses_extra(step, micro):
    return step % 2 == 0 and micro % 2 == 0


def _build(strategy, rank, world, accum, model):
    groups = _groups(model)
    if strategy == "ddp":
        wrapped = DDP(model, find_unused_parameters=isinstance(model, _Branchy))
        return wrapped, AdaScale(_sgd(groups), num_gradients_to_accumulate=accum)
    # "oss_sdp_split": every tensor of at least 16 elements cut over the ranks (the pieces hold their gradients)
    cut = {"split_params": True, "min_split_numel": 16} if strategy == "oss_sdp_split" else {}
    oss = OSS(groups, optim=torch.optim.SGD, lr=LR, momentum=MOMENTUM, **cut)
    opt = AdaScale(oss, num_gradients_to_accumulate=accum)
    if strategy == "oss_ddp":
        return DDP(model, find_unused_parameters=isinstance(model, _Branchy)), opt
    # "oss_sdp": ShardedDataParallel accepts the AdaScale wrapping the OSS wherever it accepts that OSS
    given = opt if accum > 1 else oss
    return ShardedDataParallel(model, given, find_unused_parameters=isinstance(model, _Branchy)), opt


def _train_parallel(rank, world, strategy, accum, branchy, steps=STEPS):
    model = _Branchy() if branchy else _toy()
    wrapped, opt = _build(strategy, rank, world, accum, model)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    gains, all_reduces = [], []
    for step in range(steps):
        opt.zero_grad()
        for k in range(accum):
            micro = rank * accum + k
            x, y = _batch(step, micro)
            sync = wrapped.no_sync() if k < accum - 1 else torch.enable_grad()
            with sync, comm_stats.measure() as in_backward:
                (nn.functional.mse_loss(_forward(wrapped, x, step, micro, branchy), y) / accum).backward()
        before_step = (opt.gain(0), opt.gain(1), opt.gain())  # read between the last backward and step()
        with comm_stats.measure() as in_step:
            opt.step()
        all_reduces.append(
            (in_backward.calls("all_reduce"), in_backward.payload_bytes("all_reduce"), in_step.calls("all_reduce"))
        )
        opt.step_scheduler(sched)
        gains.append((opt.gain(0), opt.gain(1), opt.gain()))
        assert gains[-1] == before_step
    return [p.detach().clone() for p in model.parameters()], gains, all_reduces, opt.estimates()


def _max_diff(values, reference):
    return max(abs(float(a) - float(b)) for a, b in zip(values, reference, strict=True))


def _quietly(fn):
    """`fn` with warnings ignored while it runs only (worker processes are reused by later tests)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)

    return run


@_quietly  # ShardedDataParallel warns about the branch's missing gradients
def _parity(rank, world):
    """Every strategy (x 1 or 2 accumulated micro-batches per rank) against one process accumulating them all."""
    out = {}
    for branchy in (False, True):
        for accum in (1, 2):
            ref_model, ref_opt, ref_gains = _local_reference(world * accum, branchy=branchy)
            ref_params = [p.detach() for p in ref_model.parameters()]
            ref_estimates = ref_opt.estimates()
            for strategy in ("ddp", "oss_ddp", "oss_sdp", "oss_sdp_split"):
                params, gains, all_reduces, estimates = _train_parallel(rank, world, strategy, accum, branchy)
                param_diff = max((a - b).abs().max().item() for a, b in zip(params, ref_params, strict=True))
                gain_diff = max(_max_diff(g, r) for g, r in zip(gains, ref_gains, strict=True))
                est_diff = _max_diff(estimates, ref_estimates) / max(ref_estimates)
                out[(branchy, accum, strategy)] = (param_diff, gain_diff, est_diff, all_reduces, gains)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_matches_single_process_accumulation(world):
    results = run_distributed(_parity, world)
    for rank_results in results:
        for case, (param_diff, gain_diff, est_diff, all_reduces, gains) in rank_results.items():
            assert param_diff < TOL, (case, param_diff)
            assert gain_diff < TOL, (case, gain_diff)
            assert est_diff < TOL, (case, est_diff)
            # one small all-reduce per update, in its last backward: 2 groups x (micro norms, averaged norm) in
            # float64; none in step() (the gain read before step() was already this update's, asserted in the run)
            assert all(a == (1, 2 * 2 * 8, 0) for a in all_reduces), (case, all_reduces)
            assert any(abs(g[2] - 1.0) > 1e-3 for g in gains), case  # the gains were not trivially 1
    for case in results[0]:  # every rank computed the same gains
        assert all(r[case][4] == results[0][case][4] for r in results), case


# -- inside OSS: AdaScaleWrapper as OSS's optimizer class ----------------------------------------------------------


def _paper_gain(micro_grads: list[list[torch.Tensor]], ids: list[int]) -> float:
    """Johnson et al. (2020), first step (no smoothing), scale S = the number of micro-gradients: the unbiased
    variance sigma2 = S/(S-1) (mean_i |g_i|^2 - |mean g|^2), mu2 = |mean g|^2 - sigma2/S (a squared norm: at
    least 0), and the gain (sigma2 + mu2) / (sigma2/S + mu2), between 1 and S, over the parameters `ids`."""
    count = len(micro_grads)
    sum_sq = sum(float(micro_grads[m][i].pow(2).sum()) for m in range(count) for i in ids)
    mean_sq = sum(float(torch.stack([g[i] for g in micro_grads]).mean(0).pow(2).sum()) for i in ids)
    sigma2 = count / (count - 1) * (sum_sq / count - mean_sq)
    mu2 = max(mean_sq - sigma2 / count, 0.0)
    return (sigma2 + mu2) / (sigma2 / count + mu2)


@_quietly
def _wrapper_in_oss(rank, world):
    accum = 2
    model = _toy()
    reference = copy.deepcopy(model)
    oss = OSS(_groups(model), optim=AdaScaleWrapper, lr=LR, momentum=MOMENTUM, num_gradients_to_accumulate=accum)
    sdp = ShardedDataParallel(model, oss)
    inner = oss.optim
    # the expected first gain, from the paper's estimates over every micro-gradient of the whole model (the
    # AdaScale inside OSS measures all parameters, as AdaScale(OSS) does; not only those of its shard)
    num = world * accum
    micro_grads = []
    for micro in range(num):
        reference.zero_grad()
        x, y = _batch(0, micro)
        nn.functional.mse_loss(reference(x), y).backward()
        micro_grads.append([p.grad.clone() for p in reference.parameters()])
    owners = [oss.owner_of(p) for p in model.parameters()]
    index = {id(p): i for i, p in enumerate(model.parameters())}
    expected = [_paper_gain(micro_grads, [index[id(p)] for p in group["params"]]) for group in oss.param_groups]
    assert len(set(owners)) == world  # the shards differ: a shard-only estimate would differ too
    first_gains, losses = None, []
    for step in range(STEPS):
        oss.zero_grad()
        for k in range(accum):
            x, y = _batch(step, rank * accum + k)
            with sdp.no_sync() if k < accum - 1 else torch.enable_grad():
                loss = nn.functional.mse_loss(sdp(x), y)
                (loss / accum).backward()
        oss.step()
        losses.append(loss.item())
        if step == 0:
            first_gains = [inner.gain(i) for i in range(2)]
    return expected, first_gains, [p.detach().clone() for p in model.parameters()], inner.scale_invariant_steps


def test_adascale_wrapper_inside_oss():
    results = run_distributed(_wrapper_in_oss, 2)
    for expected, first_gains, _, _ in results:
        assert first_gains == pytest.approx(expected, rel=1e-6)
        assert all(1 <= g <= 4 for g in first_gains)
    (_, g0, p0, s0), (_, g1, p1, s1) = results
    assert g0 == g1 and s0 == s1  # the same gain on every rank
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))  # replicas equal


@_quietly
def _wrapper_in_oss_owning_nothing(rank, world):
    """4 ranks, 2 parameters: ranks 2 and 3 own nothing but still measure the whole model's micro-gradients."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    oss = OSS(model.parameters(), optim=AdaScaleWrapper, lr=LR, num_gradients_to_accumulate=2)
    sdp = ShardedDataParallel(model, oss)
    gains = []
    for step in range(3):
        oss.zero_grad()
        for k in range(2):
            x, y = _batch(step, 2 * rank + k)
            with sdp.no_sync() if k == 0 else contextlib.nullcontext():
                (nn.functional.mse_loss(sdp(x[:, :6]), y) / 2).backward()
        oss.step()
        gains.append(oss.optim.gain())
    # an OSS over a pair of ranks: its AdaScale follows the OSS's group (world size 2, scale 2 x 2), not the 4 ranks
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    paired = OSS(
        nn.Linear(6, 3).parameters(),
        optim=AdaScaleWrapper,
        group=pairs[rank // 2],
        lr=LR,
        num_gradients_to_accumulate=2,
    )
    pair = (paired.optim.world_size, paired.optim.scale)
    return [p.detach().clone() for p in model.parameters()], gains, oss.optim._meter.watching, pair


def test_adascale_wrapper_inside_oss_on_ranks_owning_nothing():
    results = run_distributed(_wrapper_in_oss_owning_nothing, 4)
    assert [watching for _, _, watching, _ in results] == [True, True, True, True]
    assert [pair for *_, pair in results] == [(2, 4.0)] * 4
    for params, gains, _, _ in results:
        assert gains == results[0][1] and all(1 < g <= 8 for g in gains)
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0], strict=True))


# -- checkpoints and errors across ranks ---------------------------------------------------------------------------


def _oss_checkpoint_and_errors(rank, world):
    def run(model, opt, sdp, steps):
        for step in steps:
            opt.zero_grad()
            x, y = _batch(step, rank)
            nn.functional.mse_loss(sdp(x), y).backward()
            opt.step()

    model = _toy()
    opt = AdaScale(OSS(_groups(model), optim=torch.optim.SGD, lr=LR, momentum=MOMENTUM))
    sdp = ShardedDataParallel(model, opt.optimizer)
    run(model, opt, sdp, range(3))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(all_ranks=True)))
    run(model, opt, sdp, range(3, 6))
    model2 = _toy(seed=3)
    model2.load_state_dict(saved[0])
    opt2 = AdaScale(OSS(_groups(model2), optim=torch.optim.SGD, lr=LR, momentum=MOMENTUM))
    opt2.load_state_dict(saved[1])
    run(model2, opt2, ShardedDataParallel(model2, opt2.optimizer), range(3, 6))
    resumed_equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    errors = {}
    for name, make in {
        "world_size": lambda: AdaScale(_sgd(_toy().parameters()), world_size=3),
        "oss_world": lambda: AdaScale(OSS(_toy().parameters(), lr=0.1), world_size=1, num_gradients_to_accumulate=2),
        "sdp_plain": lambda: ShardedDataParallel(model, AdaScale(_sgd(model.parameters()))),
    }.items():
        try:
            make()
        except (ValueError, TypeError) as exc:
            errors[name] = str(exc)
    return resumed_equal, opt.scale_invariant_steps == opt2.scale_invariant_steps, errors


def test_oss_checkpoint_resumes_exactly_and_world_size_errors():
    for resumed_equal, same_progress, errors in run_distributed(_oss_checkpoint_and_errors, 2):
        assert resumed_equal and same_progress
        assert "world_size=3 but the process group has 2 ranks" in errors["world_size"]
        assert "world_size=1 but the OSS shards over 2 ranks; leave world_size=None" in errors["oss_world"]
        assert "sharded_optimizer must be a ddpkit.optim.OSS (or an AdaScale wrapping one)" in errors["sdp_plain"]
        assert "got AdaScale wrapping SGD" in errors["sdp_plain"]


def test_add_param_group_and_step_hooks():
    model = _toy()
    opt = AdaScale(_sgd([model[0].weight, model[0].bias]), num_gradients_to_accumulate=2)
    calls = []
    opt.register_step_post_hook(lambda optimizer, args, kwargs: calls.append(optimizer is opt))

    def update(step):
        opt.zero_grad()
        for micro in range(2):
            x, y = _batch(step, micro)
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        opt.step()

    update(0)
    frozen_before = model[2].weight.detach().clone()
    opt.add_param_group({"params": [model[2].weight, model[2].bias], "lr": BIAS_LR})
    update(1)
    # the new group is measured (its own estimates) and updated; the first group keeps its estimates' history
    assert opt._estimates[0].count == 2 and opt._estimates[1].count == 1
    assert 1 < opt.gain(1) <= 2 and not torch.equal(frozen_before, model[2].weight)
    assert opt.param_groups[1]["lr"] == BIAS_LR and calls == [True, True]


# -- fairscale's formula by hand: gains after every backward and every step, at 1, 2 and 4 ranks ----------------------


class _TwoGroupLinear(nn.Module):
    """``loss = w1 . x1 + w2 . x2``: the gradient of each micro-batch is its input, whatever the weights are."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(3, dtype=torch.float64))
        self.w2 = nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def forward(self, x):
        return self.w1 @ x[:3] + self.w2 @ x[3:]


def _micro_input(step, rank, k):
    """Micro-batch (step, rank, k)'s input, i.e. its gradient: small integers, different on every rank."""
    g = torch.Generator().manual_seed(7919 * step + 131 * rank + k)
    return torch.randint(-3, 4, (5,), generator=g).to(torch.float64)


def _hand_gains(world, n, steps, is_scaled_loss, debias, smoothing, scale):
    """Per update: the per-group and whole-model gains and the mean gradient, from fairscale's formula written out.

    S = world x n micro-gradients g_i; per group: local = sum_i ||g_i||^2, total = ||mean_i g_i||^2,
    var = local (scale / S) / (S - 1) - total scale / (S - 1), sqr = total - var / scale, clamped at 1e-6 and 0;
    debiased EWMA (biased / unbias) or the paper's plain mean for the first 1 / (1 - smoothing) updates, then the
    EWMA; gain = (var + sqr) / (var / scale + sqr), the whole model's from the sums over groups.
    (`is_scaled_loss` changes what the hooks and .grad hold, not these values.)
    """
    del is_scaled_loss
    cn = world * n
    slices = (slice(0, 3), slice(3, 5))
    avg = {"var": [0.0, 0.0], "sqr": [1.0, 1.0]}  # fairscale starts grad_sqr_avg at 1: gain 1 before any update
    biased = {"var": [0.0, 0.0], "sqr": [0.0, 0.0]}
    unbias = {"var": [0.0, 0.0], "sqr": [0.0, 0.0]}
    totals = {"var": [0.0, 0.0], "sqr": [0.0, 0.0]}
    out = []
    for step in range(steps):
        grads = [_micro_input(step, r, k) for r in range(world) for k in range(n)]
        mean = torch.stack(grads).mean(0)
        values = {"var": [], "sqr": []}
        for sl in slices:
            local = sum(float(g[sl].pow(2).sum()) for g in grads)
            total = float(mean[sl].pow(2).sum())
            var = local * (scale / cn) / (cn - 1) - total * scale / (cn - 1)
            sqr = total - var / scale
            values["var"].append(max(var, 1e-6))
            values["sqr"].append(max(sqr, 0.0))
        for name in ("var", "sqr"):
            for i in range(2):
                x = values[name][i]
                if debias:
                    biased[name][i] = smoothing * biased[name][i] + (1 - smoothing) * x
                    unbias[name][i] = smoothing * unbias[name][i] + (1 - smoothing)
                    avg[name][i] = biased[name][i] / unbias[name][i]
                elif step + 1 < 1 / (1 - smoothing):
                    totals[name][i] += x
                    avg[name][i] = totals[name][i] / (step + 1)
                else:
                    avg[name][i] = smoothing * avg[name][i] + (1 - smoothing) * x

        def ratio(var, sqr):
            return (var + sqr) / (var / scale + sqr)

        per_group = [ratio(avg["var"][i], avg["sqr"][i]) for i in range(2)]
        out.append((per_group[0], per_group[1], ratio(sum(avg["var"]), sum(avg["sqr"])), mean))
    return out


_HAND_CASES = [  # (n, is_scaled_loss, debias_ewma, smoothing or None, scale or None)
    (2, True, True, None, None),
    (3, True, False, 0.5, None),
    (2, False, True, 0.3, 3.0),
    (3, False, False, 0.6, None),
    (1, True, True, 0.5, None),  # no accumulation (needs world_size > 1)
]
_HAND_STEPS, _HAND_LR = 4, 0.1


def _run_hand_case(rank, world, n, is_scaled_loss, debias, smoothing, scale):
    """The case on this rank: (gains after each backward, gains after each step, final weights)."""
    model = _TwoGroupLinear()
    wrapped = DDP(model) if world > 1 else model
    opt = AdaScale(
        torch.optim.SGD([{"params": [model.w1]}, {"params": [model.w2]}], lr=_HAND_LR),
        num_gradients_to_accumulate=n,
        is_scaled_loss=is_scaled_loss,
        debias_ewma=debias,
        smoothing=smoothing,
        scale=scale,
    )
    after_backward, after_step = [], []
    for step in range(_HAND_STEPS):
        opt.zero_grad()
        for k in range(n):
            with wrapped.no_sync() if world > 1 and k < n - 1 else contextlib.nullcontext():
                loss = wrapped(_micro_input(step, rank, k))
                (loss / n if is_scaled_loss else loss).backward()
            after_backward.append((opt.gain(0), opt.gain(1), opt.gain()))
        if not is_scaled_loss and n > 1:
            opt.scale_grad_by_num_grads_to_accum()
        opt.step()
        after_step.append((opt.gain(0), opt.gain(1), opt.gain()))
    return after_backward, after_step, torch.cat([model.w1.detach(), model.w2.detach()])


def _hand_cases_on_ranks(rank, world):
    return [_run_hand_case(rank, world, *case) for case in _HAND_CASES if world * case[0] > 1]


def _check_hand_case(world, case, result):
    n, is_scaled_loss, debias, smoothing, scale = case
    cn = world * n
    expected = _hand_gains(
        world,
        n,
        _HAND_STEPS,
        is_scaled_loss,
        debias,
        max(1 - cn / 1000, 0) if smoothing is None else smoothing,
        cn if scale is None else scale,
    )
    after_backward, after_step, weights = result
    previous, weight = (1.0, 1.0, 1.0), torch.zeros(5, dtype=torch.float64)
    for step, (g0, g1, g, mean) in enumerate(expected):
        for k in range(n):  # unchanged until the last backward of the update, then this update's gain
            assert after_backward[step * n + k] == pytest.approx((g0, g1, g) if k == n - 1 else previous, rel=1e-9)
        assert after_step[step] == pytest.approx((g0, g1, g), rel=1e-9)
        weight = weight - _HAND_LR * torch.cat([g0 * mean[:3], g1 * mean[3:]])  # SGD, lr x the group's gain
        previous = (g0, g1, g)
    assert torch.allclose(weights, weight, rtol=1e-12, atol=1e-12)
    assert any(abs(g - 1) > 1e-3 for _, _, g, _ in expected)  # a case whose gains are not trivially 1


def test_gains_by_hand_one_process():
    for case in _HAND_CASES:
        if case[0] > 1:
            _check_hand_case(1, case, _run_hand_case(0, 1, *case))


@pytest.mark.parametrize("world", [2, 4])
def test_gains_by_hand_data_parallel(world):
    results = run_distributed(_hand_cases_on_ranks, world)
    cases = [case for case in _HAND_CASES if world * case[0] > 1]
    for rank_results in results:
        for case, result in zip(cases, rank_results, strict=True):
            _check_hand_case(world, case, result)


def test_a_constant_loss_scale_leaves_the_gains_unchanged():
    """The norms are taken before unscale_: the scale s multiplies both estimates by s^2, not the gain."""
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=10**6)):
        model = _toy()
        opt = AdaScale(_sgd(_groups(model)), num_gradients_to_accumulate=3)
        gains = []
        for step in range(4):
            opt.zero_grad()
            for micro in range(3):
                x, y = _batch(step, micro)
                loss = nn.functional.mse_loss(model(x), y) / 3
                (scaler.scale(loss) if scaler else loss).backward()
            gains.append((opt.gain(0), opt.gain(1), opt.gain()))
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        runs.append((gains, opt.estimates(), [p.detach().clone() for p in model.parameters()]))
    (gains, estimates, params), (scaled_gains, scaled_estimates, scaled_params) = runs
    flat, scaled_flat = [g for step in gains for g in step], [g for step in scaled_gains for g in step]
    assert scaled_flat == pytest.approx(flat, rel=1e-6) and any(abs(g[2] - 1) > 1e-3 for g in gains)
    assert scaled_estimates == pytest.approx([2.0**16 * e for e in estimates], rel=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(params, scaled_params, strict=True)) < 1e-6


def test_loads_a_fairscale_checkpoint_with_its_estimates():
    """fairscale keeps the estimates as NumPy arrays in the wrapped optimizer's state["adascale"] (sigma2 as
    grad_var_avg, mu2 as grad_sqr_avg, the debiasing weight as *_unbias); written here by hand."""
    import numpy as np

    layer = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(layer.weight)
    saved = torch.optim.SGD(layer.parameters(), lr=0.1).state_dict()
    saved["state"]["adascale"] = {
        "grad_var_avg": np.array([4.0]),
        "grad_sqr_avg": np.array([3.0]),
        "grad_var_avg_biased": np.array([3.0]),
        "grad_var_avg_unbias": np.array([0.75]),
        "grad_sqr_avg_biased": np.array([2.25]),
        "grad_sqr_avg_unbias": np.array([0.75]),
    }
    opt = AdaScale(torch.optim.SGD(layer.parameters(), lr=0.1), num_gradients_to_accumulate=2, smoothing=0.5)
    opt.load_state_dict(saved)
    assert "adascale" not in opt.optimizer.state and opt.gain() == pytest.approx(7 / (4 / 2 + 3), rel=1e-12)
    for g in ([3.0, 0.0], [0.0, 3.0]):  # sigma2 9, mu2 0 for this update
        ((layer.weight @ torch.tensor(g)).sum() / 2).backward()
    weight = 0.5 * 0.75 + 0.5  # fairscale's debiased averages continue: biased / unbias
    expected = ((0.5 * 3.0 + 0.5 * 9) / weight, (0.5 * 2.25 + 0.5 * 0.0) / weight)
    assert opt.estimates() == pytest.approx(expected, rel=1e-9)
    opt.step()
    with pytest.raises(ValueError, match="fairscale AdaScale state has 1 parameter groups"):
        AdaScale(_sgd(_groups(_toy())), num_gradients_to_accumulate=2).load_state_dict(
            {"state": saved["state"], "param_groups": saved["param_groups"] * 2}
        )
