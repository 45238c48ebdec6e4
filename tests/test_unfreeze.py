"""Gradual unfreezing with OSS, with and without ShardedDataParallel: parameters frozen when the optimizer is built
and made trainable later (and frozen again), combined with gradient accumulation, manual reduce(), clipping,
reduce_fp16, mixed precision and several forwards before one backward, equal at every step to one process training
on all ranks' data (each rank computes that reference itself), at 2 and 4 gloo ranks.

Many combinations run inside each spawned call (spawning is the expensive part); each returns its largest
parameter difference over all steps."""

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS, ShardedGradScaler
from ddpkit.testing import run_distributed

LR, CLIP, STEPS = 0.01, 0.05, 6
# requires_grad of (layer 0, layer 1, layer 2) at each step: 0 and 1 frozen when OSS is built, unfrozen at steps 1
# and 3; layer 2 frozen at step 4 and trainable again at step 5.
SCHEDULE = [(0, 0, 1), (0, 1, 1), (0, 1, 1), (1, 1, 1), (1, 1, 0), (1, 1, 1)]


class Combo(dict):
    """One combination: wrapper 'sdp' (ShardedDataParallel) or 'ddp' (torch DDP, rebuilt when the trainable set
    changes, as a DDP user must); accum (micro-batches per step under no_sync); manual (every micro-batch under
    no_sync, then sdp.reduce()); clip (OSS.clip_grad_norm); amp None, 'bf16' (autocast) or 'fp16' (autocast and
    ShardedGradScaler); reduce_fp16; forwards (forwards summed into one backward); optim 'adam' or 'sgd'."""

    def __init__(
        self, wrapper, accum=1, manual=False, clip=False, amp=None, reduce_fp16=False, forwards=1, optim="adam"
    ):
        super().__init__(
            wrapper=wrapper,
            accum=accum,
            manual=manual,
            clip=clip,
            amp=amp,
            reduce_fp16=reduce_fp16,
            forwards=forwards,
            optim=optim,
        )

    @property
    def tolerance(self):
        return 5e-4 if self["reduce_fp16"] or self["amp"] == "fp16" else 2e-5


GROUPS = {
    "sdp_basic": [
        Combo("sdp"),
        Combo("sdp", optim="sgd"),
        Combo("sdp", accum=2),
        Combo("sdp", accum=2, manual=True),
        Combo("sdp", clip=True),
        Combo("sdp", forwards=2),
        Combo("sdp", accum=2, clip=True, forwards=2, optim="sgd"),
    ],
    "sdp_precision": [
        Combo("sdp", reduce_fp16=True),
        Combo("sdp", amp="bf16"),
        Combo("sdp", amp="fp16"),
        Combo("sdp", amp="fp16", accum=2, manual=True, clip=True),
        Combo("sdp", amp="bf16", accum=2, forwards=2, reduce_fp16=True),
    ],
    "oss_ddp": [
        Combo("ddp"),
        Combo("ddp", accum=2, clip=True),
        Combo("ddp", amp="fp16", forwards=2, optim="sgd"),
        Combo("ddp", amp="bf16", accum=2),
    ],
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _layers(model):
    return [model[0], model[2], model[4]]


def _apply_schedule(model, step):
    for layer, trainable in zip(_layers(model), SCHEDULE[step], strict=True):
        layer.requires_grad_(bool(trainable))


def _batch(step, rank, k):
    g = torch.Generator().manual_seed(10007 * step + 101 * rank + k)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _autocast(combo):
    if combo["amp"] is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if combo["amp"] == "bf16" else torch.float16)


def _loss(model, combo, step, rank, k):
    """The micro-batch's loss, divided by the number of micro-batches: `forwards` forwards, one loss."""
    x, y = _batch(step, rank, k)
    with _autocast(combo):
        parts = torch.chunk(torch.arange(len(x)), combo["forwards"])
        loss = sum(nn.functional.mse_loss(model(x[i]).float(), y[i], reduction="sum") for i in parts) / len(x)
    return loss / combo["accum"]


def _optimizer_class(combo):
    return torch.optim.Adam if combo["optim"] == "adam" else torch.optim.SGD


def _optim_kwargs(combo):
    return {"lr": LR} if combo["optim"] == "adam" else {"lr": LR, "momentum": 0.9}


def _scaler(combo, sharded):
    if combo["amp"] != "fp16":
        return None
    if sharded:  # powers of two: scaling is exact
        return ShardedGradScaler(init_scale=2.0**10, growth_interval=2, device="cpu")
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def _reference_step(model, opt, scaler, combo, step, world):
    """One step of one process on every rank's micro-batches: the average of the ranks' losses."""
    opt.zero_grad()
    for rank in range(world):
        for k in range(combo["accum"]):
            loss = _loss(model, combo, step, rank, k) / world
            (scaler.scale(loss) if scaler else loss).backward()
    clip = torch.nn.utils.clip_grad_norm_
    _unscale_clip_step(opt, scaler, lambda: clip([p for p in model.parameters() if p.grad is not None], CLIP), combo)


def _unscale_clip_step(opt, scaler, clip, combo):
    if scaler:
        scaler.unscale_(opt)
    if combo["clip"]:
        clip()
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def _wrap(model, opt, combo):
    if combo["wrapper"] == "sdp":
        return ShardedDataParallel(model, opt, reduce_fp16=combo["reduce_fp16"], warn_on_trainable_params_changed=False)
    return DDP(model, find_unused_parameters=True)


def _distributed_step(model, wrapped, opt, scaler, combo, step, rank):
    opt.zero_grad()
    for k in range(combo["accum"]):
        local = combo["manual"] or k < combo["accum"] - 1
        with wrapped.no_sync() if local else contextlib.nullcontext():
            loss = _loss(wrapped, combo, step, rank, k)
            (scaler.scale(loss) if scaler else loss).backward()
    if combo["manual"]:
        wrapped.reduce()
    _unscale_clip_step(opt, scaler, lambda: opt.clip_grad_norm(CLIP), combo)


def _run_combo(rank, world, combo):
    """The largest difference between this rank's parameters and the reference's, over every step."""
    model, reference = _model(), _model()
    _apply_schedule(model, 0)
    _apply_schedule(reference, 0)
    opt = OSS(model.parameters(), optim=_optimizer_class(combo), **_optim_kwargs(combo))
    ref_opt = _optimizer_class(combo)(reference.parameters(), **_optim_kwargs(combo))
    scaler, ref_scaler = _scaler(combo, True), _scaler(combo, False)
    wrapped, trainable = _wrap(model, opt, combo), SCHEDULE[0]
    worst = 0.0
    for step in range(STEPS):
        _apply_schedule(model, step)
        _apply_schedule(reference, step)
        if combo["wrapper"] == "ddp" and SCHEDULE[step] != trainable:
            wrapped = _wrap(model, opt, combo)  # torch DDP only reduces what was trainable when it was built
        trainable = SCHEDULE[step]
        _distributed_step(model, wrapped, opt, scaler, combo, step, rank)
        _reference_step(reference, ref_opt, ref_scaler, combo, step, world)
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters(), strict=True))
        worst = max(worst, diff)
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), _model().parameters(), strict=True))
    return worst, moved


def _run_group(rank, world, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [_run_combo(rank, world, combo) for combo in GROUPS[name]]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_unfreezing_matches_one_process(world, group):
    results = run_distributed(_run_group, world, group)
    for rank, per_combo in enumerate(results):
        for combo, (worst, moved) in zip(GROUPS[group], per_combo, strict=True):
            assert worst < combo.tolerance, (world, rank, combo, worst)
            assert moved > 1e-3 and worst < moved / 10, (combo, moved)  # they did train (the check can fail)
