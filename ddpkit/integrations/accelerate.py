"""Hugging Face accelerate with ddpkit's ZeRO-2: a recipe for `accelerate launch` scripts.

accelerate has no place for a DDP-like wrapper of one's own (it wraps models in torch's DDP itself), but it leaves
a model alone that is marked as prepared. `prepare_sharded` builds `OSS` + `ShardedDataParallel`, registers both
with the accelerator (so ``accelerator.accumulate(model)`` uses the wrapper's ``no_sync``, the optimizer gets
accelerate's own wrapper, and ``save_state``/``load_state`` include them) and adds what accelerate would get wrong::

    from ddpkit.integrations.accelerate import clip_grad_norm_, prepare_sharded

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)  # cpu=True on CPUs: see below
    model, optimizer = prepare_sharded(accelerator, model, optimizer)   # instead of accelerator.prepare
    loader, scheduler = accelerator.prepare(loader, scheduler)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(x), y))
            if accelerator.sync_gradients:
                clip_grad_norm_(accelerator, optimizer, 1.0)          # or accelerator.clip_grad_norm_ (below)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")                                      # works unchanged

What differs from accelerate's own path, and why:

- clipping: accelerate's ``accelerator.clip_grad_norm_(model.parameters(), ...)`` would take the norm of the
  gradients this rank holds, i.e. its shard's only. `prepare_sharded` replaces that method on this accelerator
  (the instance only): given the sharded model's parameters it unscales (fp16) and clips by the norm over all
  shards (`OSS.clip_grad_norm`), as `clip_grad_norm_` here does; given other parameters it is accelerate's own.
- ``save_state`` calls the optimizer's ``state_dict()`` on every rank; a pre-save hook registered here first
  consolidates every OSS onto the rank that writes (rank 0; every rank with ``save_on_each_node``), so the call
  works unchanged and no other rank holds the whole state (the saved state is torch's format, the whole
  optimizer). ``load_state`` gives every rank that whole state; OSS keeps its own shard of it. The model is
  saved as the wrapped module's own state dict (accelerate does not know to unwrap ShardedDataParallel, and
  safetensors dropped tensors whose storage the wrapper shares), so the checkpoint is the one accelerate's DDP
  path writes: either path loads the other's.
- fp16 (``mixed_precision="fp16"``): accelerate's GradScaler is replaced by a `ShardedGradScaler`, so a step whose
  gradients overflowed on one rank's shard is skipped on every rank.

- accelerate must count the processes torch.distributed has: `prepare_sharded` refuses otherwise (under
  ``accelerate launch --multi_gpu`` on a CPU machine accelerate sees one process unless the script builds
  ``Accelerator(cpu=True)`` or runs with ``ACCELERATE_USE_CPU=1``, and would not split the data); it also refuses a
  model or optimizer that went through ``accelerator.prepare`` already.

Communication and memory: those of `ShardedDataParallel` and `OSS`; a checkpoint gathers the whole optimizer
state on the rank that writes it while it is saved.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    from accelerate import Accelerator
except ImportError as exc:  # pragma: no cover - exercised only without accelerate
    raise ImportError('ddpkit.integrations.accelerate needs accelerate: pip install "ddpkit[accelerate]"') from exc

from ddpkit.distributed.env import group_size
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
    """accelerate's pre-save hook: every OSS consolidated on the process(es) that write (global rank 0, or every
    rank with ``save_on_each_node``), the others answering accelerate's ``state_dict()`` call of this save with an
    empty state they never write; each ShardedDataParallel saved as its module's own state dict (the keys of a
    plain model, no storage shared between tensors)."""

    def hook(models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        every_rank = bool(getattr(accelerator.project_configuration, "save_on_each_node", False))
        for optimizer in accelerator._optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)
            if isinstance(inner, OSS):  # a collective: save_state runs on every rank
                inner.consolidate_state_dict(recipient_rank=-1 if every_rank else 0)
                if not every_rank and inner.rank != 0:
                    optimizer.state_dict = _once_not_written(optimizer)
        for i, model in enumerate(models):
            if isinstance(model, ShardedDataParallel) and i < len(weights):
                weights[i] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    return hook


def _once_not_written(optimizer: Any) -> Any:
    """What accelerate's ``state_dict()`` call of one save returns on a rank that does not write: an empty state
    (no copy of the whole state on every rank); the call after is the optimizer's own again."""

    def state_dict() -> dict[str, Any]:
        del optimizer.state_dict  # (the instance attribute: the class's method again)
        return {"state": {}, "param_groups": [], "note": "not written: another rank saves the whole state"}

    return state_dict


class _LoadInto(nn.Module):
    """Stands for a ShardedDataParallel's module while accelerate loads a checkpoint into it: its state dict is
    a copy (safetensors refuses tensors that share storage, as OSS's message buffers and the parameters of a model
    that has stepped do), and what is loaded is copied into the module's own tensors."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "target", module)  # not registered: this module holds no tensors itself

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return {k: v.detach().clone() for k, v in self.target.state_dict(*args, **kwargs).items()}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.target.load_state_dict(state_dict, strict=strict)


def _before_load(models: list[nn.Module], input_dir: str) -> None:
    """accelerate's pre-load hook: a ShardedDataParallel loads into its module (the keys `_before_save` wrote),
    through `_LoadInto`, also after the model has trained."""
    for i, model in enumerate(models):
        if isinstance(model, ShardedDataParallel):
            models[i] = _LoadInto(model.module)


def _check_processes(accelerator: Accelerator) -> None:
    """accelerate must count the processes torch.distributed has, or it does not split the data between them."""
    world = group_size() if dist.is_available() and dist.is_initialized() else 1
    if accelerator.num_processes != world:
        raise ValueError(
            f"prepare_sharded: accelerate counts {accelerator.num_processes} process(es) "
            f"({accelerator.distributed_type}) but torch.distributed has {world} ranks, so accelerate would not split "
            "the data between them (every rank would train on the same batches). On CPUs build "
            "Accelerator(cpu=True), or launch with `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
            "--num_processes N` (its --cpu flag alone starts one process); on GPUs, `accelerate launch --multi_gpu`."
        )


def _check_unprepared(model: nn.Module, optimizer: Any) -> None:
    """`prepare_sharded` takes the plain model and torch optimizer: ones accelerate prepared already (wrapped in
    its DDP and its optimizer wrapper) are refused, saying what to do."""
    from accelerate.optimizer import AcceleratedOptimizer

    prepared = []
    if getattr(model, "_is_accelerate_prepared", False) or isinstance(model, nn.parallel.DistributedDataParallel):
        prepared.append("model")
    if isinstance(optimizer, AcceleratedOptimizer):
        prepared.append("optimizer")
    if prepared:
        raise ValueError(
            f"prepare_sharded: the {' and the '.join(prepared)} went through accelerator.prepare already; give "
            "prepare_sharded the plain model and torch optimizer instead of accelerator.prepare (prepare only the "
            "data loader and the scheduler with accelerator.prepare)"
        )


def prepare_sharded(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    oss_kwargs: dict[str, Any] | None = None,
    **sdp_kwargs: Any,
) -> tuple[ShardedDataParallel, Any]:
    """`model` in `ShardedDataParallel` and `optimizer` as an `OSS`, registered with `accelerator` (module doc).
    Call it instead of ``accelerator.prepare`` for the model and optimizer, before their first step.

    Args:
        accelerator: the script's `Accelerator`; it must count the processes torch.distributed has.
        model: the plain model (not prepared by accelerate).
        optimizer: the plain torch optimizer on `model`'s parameters; becomes an OSS of the same class.
        oss_kwargs: OSS's own arguments (``min_split_numel``, ``broadcast_fp16``, ...).
        **sdp_kwargs: ShardedDataParallel's arguments (``reduce_buffer_size``, ...).

    Returns:
        The wrapped model and accelerate's wrapper of the OSS, to use as accelerate's prepared pair.

    Raises:
        ValueError: accelerate counts other processes than torch.distributed, or the model or optimizer went
            through ``accelerator.prepare`` already.
    """
    _check_processes(accelerator)
    _check_unprepared(model, optimizer)
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
        accelerator.clip_grad_norm_ = _clipping_over_shards(accelerator, accelerator.clip_grad_norm_)
        accelerator._ddpkit_hooks = True
    return wrapped, prepared


def _clipping_over_shards(accelerator: Accelerator, own: Any) -> Any:
    """``accelerator.clip_grad_norm_`` for this accelerator: given the parameters of an optimizer `prepare_sharded`
    made, it clips by the norm over all shards (`clip_grad_norm_`); given others, it is accelerate's own (`own`);
    given some of a sharded optimizer's parameters only, it refuses (no rank holds their whole gradients)."""

    def clip(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        given = {id(p) for p in params}
        for optimizer in accelerator._optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)
            if not isinstance(inner, OSS):
                continue
            sharded = {id(p) for group in inner.param_groups for p in group["params"]}
            if given == sharded:
                return clip_grad_norm_(accelerator, optimizer, max_norm, norm_type)
            if given & sharded:
                raise ValueError(
                    "accelerator.clip_grad_norm_: some, not all, of a sharded optimizer's parameters; their norm "
                    "needs every rank's shard: give all of them (model.parameters())"
                )
        return own(params, max_norm, norm_type)

    return clip


def clip_grad_norm_(accelerator: Accelerator, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``accelerator.clip_grad_norm_`` for `prepare_sharded`'s optimizer: unscales (fp16), then clips every
    gradient by the norm over all shards (one all-reduce of one number).

    Args:
        accelerator: the script's `Accelerator`.
        optimizer: the optimizer `prepare_sharded` returned.
        max_norm: the largest norm the gradients keep.
        norm_type: the norm's order (2: Euclidean; ``inf``: the largest element).

    Returns:
        The norm over all shards before clipping.

    Raises:
        TypeError: `optimizer` is not the one `prepare_sharded` returned.
    """
    accelerator.unscale_gradients(optimizer)
    return _inner_oss(optimizer).clip_grad_norm(max_norm, norm_type)
