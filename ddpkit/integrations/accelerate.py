"""Hugging Face accelerate with ddpkit's ZeRO-2: a recipe for `accelerate launch` scripts.

accelerate has no place for a DDP-like wrapper of one's own (it wraps models in torch's DDP itself), but it leaves
a model alone that is marked as prepared. `prepare_sharded` builds `OSS` + `ShardedDataParallel`, registers both
with the accelerator (so ``accelerator.accumulate(model)`` uses the wrapper's ``no_sync``, the optimizer gets
accelerate's own wrapper, and ``save_state``/``load_state`` include them) and adds what accelerate would get wrong::

    from ddpkit.integrations.accelerate import clip_grad_norm_, prepare_sharded

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer = prepare_sharded(accelerator, model, optimizer)   # instead of accelerator.prepare
    loader, scheduler = accelerator.prepare(loader, scheduler)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(x), y))
            if accelerator.sync_gradients:
                clip_grad_norm_(accelerator, optimizer, 1.0)          # instead of accelerator.clip_grad_norm_
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")                                      # works unchanged

What differs from accelerate's own path, and why:

- clipping: ``accelerator.clip_grad_norm_(model.parameters(), ...)`` takes the norm of the gradients this rank
  holds, i.e. its shard's only; `clip_grad_norm_` here unscales (fp16) and clips by the norm over all shards
  (`OSS.clip_grad_norm`). This is the one call that cannot stay accelerate's own without patching accelerate.
- ``save_state`` calls the optimizer's ``state_dict()`` on every rank; a pre-save hook registered here first
  consolidates every OSS onto every rank, so the call works unchanged (the saved state is torch's format, the
  whole optimizer). ``load_state`` gives every rank that whole state; OSS keeps its own shard of it. The model is
  saved as the wrapped module's own state dict (accelerate does not know to unwrap ShardedDataParallel, and
  safetensors dropped tensors whose storage the wrapper shares), so the checkpoint is the one accelerate's DDP
  path writes: either path loads the other's.
- fp16 (``mixed_precision="fp16"``): accelerate's GradScaler is replaced by a `ShardedGradScaler`, so a step whose
  gradients overflowed on one rank's shard is skipped on every rank.

Communication and memory: those of `ShardedDataParallel` and `OSS`; a checkpoint gathers the whole optimizer
state on every rank while it is saved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

try:
    from accelerate import Accelerator
except ImportError as exc:  # pragma: no cover - exercised only without accelerate
    raise ImportError('ddpkit.integrations.accelerate needs accelerate: pip install "ddpkit[accelerate]"') from exc

from ddpkit.integrations.sharding import as_oss, check_oss_kwargs, sharded_scaler_like
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS

__all__ = ["clip_grad_norm_", "prepare_sharded"]


def _inner_oss(optimizer: Any) -> OSS:
    """The OSS inside accelerate's optimizer wrapper (or `optimizer` itself)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, OSS):
        raise TypeError(f"expected the optimizer that prepare_sharded returned, got {type(optimizer).__name__}")
    return inner


def _before_save(accelerator: Accelerator) -> Any:
    """accelerate's pre-save hook: every OSS consolidated on every rank; each ShardedDataParallel saved as its
    module's own state dict (the keys of a plain model, no storage shared between tensors)."""

    def hook(models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        for optimizer in accelerator._optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)
            if isinstance(inner, OSS):
                inner.consolidate_state_dict(recipient_rank=-1)  # a collective: save_state runs on every rank
        for i, model in enumerate(models):
            if isinstance(model, ShardedDataParallel) and i < len(weights):
                weights[i] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    return hook


def _before_load(models: list[nn.Module], input_dir: str) -> None:
    """accelerate's pre-load hook: a ShardedDataParallel loads into its module (the keys `_before_save` wrote)."""
    for i, model in enumerate(models):
        if isinstance(model, ShardedDataParallel):
            models[i] = model.module


def prepare_sharded(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    oss_kwargs: dict[str, Any] | None = None,
    **sdp_kwargs: Any,
) -> tuple[ShardedDataParallel, Any]:
    """`model` in `ShardedDataParallel` (with `sdp_kwargs`) and `optimizer` as an `OSS` (with `oss_kwargs`, OSS's
    own arguments such as ``min_split_numel``), registered with `accelerator` (module doc). Call it instead of
    ``accelerator.prepare`` for the model and optimizer, before their first step."""
    sharded = as_oss(optimizer, **check_oss_kwargs(oss_kwargs, "prepare_sharded"))
    wrapped = ShardedDataParallel(model.to(accelerator.device), sharded, **sdp_kwargs)
    wrapped._is_accelerate_prepared = True  # accelerate then registers it and leaves it as it is
    wrapped = accelerator.prepare_model(wrapped)
    if accelerator.scaler is not None:
        accelerator.scaler = sharded_scaler_like(accelerator.scaler, accelerator.device.type)
    # (device placement would round-trip the state through state_dict(), which a sharded state needs consolidated
    # for; the parameters are on the accelerator's device already and the state is empty)
    prepared = accelerator.prepare_optimizer(sharded, device_placement=False)
    if not getattr(accelerator, "_ddpkit_hooks", False):
        accelerator.register_save_state_pre_hook(_before_save(accelerator))
        accelerator.register_load_state_pre_hook(_before_load)
        accelerator._ddpkit_hooks = True
    return wrapped, prepared


def clip_grad_norm_(accelerator: Accelerator, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``accelerator.clip_grad_norm_`` for `prepare_sharded`'s optimizer: unscales (fp16), then clips every
    gradient by the norm over all shards; returns that norm."""
    accelerator.unscale_gradients(optimizer)
    return _inner_oss(optimizer).clip_grad_norm(max_norm, norm_type)
