"""Callbacks that make a torchbearer `Trial` train data-parallel over CPU (or GPU) processes and machines.

Install the extra first: ``pip install "ddpkit[torchbearer]"`` (torchbearer 0.5.5 plus the `packaging` module it
uses without declaring it). Typical use, with the process group initialised on every rank::

    from ddpkit.integrations.torchbearer import distributed_callbacks, rank_zero_verbosity

    trial = Trial(model, optimizer, loss, metrics=["acc"], callbacks=distributed_callbacks(model),
                  verbose=rank_zero_verbosity())
    trial.with_generators(train_loader)  # a loader with a DistributedSampler
    trial.run(epochs)

What is communicated: one broadcast of every parameter and buffer from rank 0 when the trial starts; after every
backward, one all-reduce per dtype of the flattened gradients of a plain module (a model already wrapped in DDP,
ShardedDataParallel or SlowMo averages its own gradients, so nothing is added: gradients are averaged once);
SlowMo's averaging after each step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

try:
    import torchbearer
    from torchbearer.callbacks import Callback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('ddpkit.integrations.torchbearer needs torchbearer: pip install "ddpkit[torchbearer]"') from exc

from torch.nn.parallel import DistributedDataParallel

from ddpkit.distributed import comm
from ddpkit.distributed.buckets import broadcast_coalesced, flatten, unflatten_into
from ddpkit.distributed.env import group_rank, group_size, require_initialized
from ddpkit.nn import ShardedDataParallel, SlowMoDistributedDataParallel

__all__ = [
    "AverageGradients",
    "PerformSlowMo",
    "SetSamplerEpoch",
    "SyncParameters",
    "distributed_callbacks",
    "rank_zero_verbosity",
]

_SELF_REDUCING = (DistributedDataParallel, ShardedDataParallel, SlowMoDistributedDataParallel)


def _module(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, _SELF_REDUCING) else model


class SyncParameters(Callback):
    """When the trial starts, every rank takes rank 0's parameters and buffers (one flat broadcast per dtype)."""

    def on_init(self, state: dict[Any, Any]) -> None:
        require_initialized("SyncParameters")
        module = _module(state[torchbearer.MODEL])
        broadcast_coalesced([p.detach() for p in module.parameters()] + list(module.buffers()), 0)


class AverageGradients(Callback):
    """After every backward, averages the gradients over all ranks: one all-reduce per dtype of the flat grads.

    Does nothing for models that average their own gradients (DDP, ShardedDataParallel, SlowMo), so gradients
    are never averaged twice. Parameters without a gradient on a rank count as zero there, so every rank joins
    the same collectives.
    """

    @torch.no_grad()
    def on_backward(self, state: dict[Any, Any]) -> None:
        model = state[torchbearer.MODEL]
        if isinstance(model, _SELF_REDUCING) or group_size() == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = flatten(grads)
            comm.all_reduce(flat)
            flat.div_(group_size())
            unflatten_into(flat, grads)


class SetSamplerEpoch(Callback):
    """Sets the training sampler's epoch each epoch, so a DistributedSampler shuffles differently every epoch."""

    def on_start_epoch(self, state: dict[Any, Any]) -> None:
        loader = state[torchbearer.TRAIN_GENERATOR]
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(state[torchbearer.EPOCH])


class PerformSlowMo(Callback):
    """After each optimizer step of a SlowMo model: free the gradients, then `perform_slowmo(optimizer)`."""

    def on_step_training(self, state: dict[Any, Any]) -> None:
        model = state[torchbearer.MODEL]
        if isinstance(model, SlowMoDistributedDataParallel):
            model.zero_grad(set_to_none=True)
            model.perform_slowmo(state[torchbearer.OPTIMIZER])


def distributed_callbacks(model: nn.Module) -> list[Callback]:
    """The callbacks a Trial needs to train `model` data-parallel (SlowMo's step only for SlowMo models).

    Args:
        model: the wrapped model the Trial trains.
    """
    callbacks: list[Callback] = [SyncParameters(), AverageGradients(), SetSamplerEpoch()]
    if isinstance(model, SlowMoDistributedDataParallel):
        callbacks.append(PerformSlowMo())
    return callbacks


def rank_zero_verbosity(level: int = 2) -> int:
    """`level` on rank 0 and 0 elsewhere, for ``Trial(verbose=...)``: only rank 0 prints progress.

    Args:
        level: the verbosity rank 0 shows.
    """
    return level if group_rank() == 0 else 0
