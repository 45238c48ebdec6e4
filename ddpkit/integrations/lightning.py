"""Lightning strategies that train with ddpkit: ``Trainer(strategy="ddpkit_sharded")``, also for Fabric.

Install the extra first (``pip install "ddpkit[lightning]"``), import this module once (it registers the names),
then pass a name or an instance to Lightning::

    import ddpkit.integrations.lightning  # registers ddpkit_sharded, ddpkit_oss, ddpkit_slowmo
    trainer = lightning.Trainer(strategy="ddpkit_sharded", accelerator="cpu", devices=2)
    fabric = lightning.Fabric(strategy="ddpkit_sharded", accelerator="cpu", devices=2)  # the same names

For Fabric, `fabric.setup(model, optimizer)` (module and optimizers together: ShardedDataParallel needs them)
replaces the optimizers by OSS and wraps the module; `fabric.clip_gradients(model, optimizer, max_norm=...)`
clips by the norm over all shards; `fabric.no_backward_sync(model)` uses the wrapper's ``no_sync``; with
``ddpkit_slowmo`` every `optimizer.step()` is followed by ``perform_slowmo``.

What each strategy does around Lightning's own DDP strategy (same launchers, process group, samplers, logging):

- ``ddpkit_sharded`` (`DDPKitShardedStrategy`): ZeRO-2 as fairscale's ``ddp_sharded`` had it. Each optimizer of
  `configure_optimizers` is rebuilt as an `OSS` over the same param groups (the learning-rate schedulers keep
  working: they now drive the OSS), and the module is wrapped in `ShardedDataParallel`, which reduces each
  gradient to the rank that owns it. Communication per step: a reduce of every gradient to its owner (DDP's
  all-reduce volume halved) and a broadcast of the updated parameters from their owners. Memory: each rank
  keeps 1/N of the optimizer state and only its own gradients after backward.
- ``ddpkit_oss`` (`DDPKitOSSStrategy`): ZeRO-1: torch's DDP all-reduces the gradients as ``strategy="ddp"``
  does, the optimizers are `OSS` (1/N of the optimizer state per rank, a broadcast of the parameters per step).
- ``ddpkit_slowmo`` (`DDPKitSlowMoStrategy`): `SlowMoDistributedDataParallel` (local SGD or SGP under slow
  momentum) with ``perform_slowmo`` after every optimizer step. Its own state (`slowmo_state_dict`: slow momentum,
  the last synced copy, the step count) goes into the checkpoint under ``"ddpkit_slowmo"`` (rank 0's) and is
  restored on resume; Lightning saves rank 0's optimizer state only, so local optimizer state that differs
  between SlowMo nodes (Adam's moments) resumes as rank 0's on every rank.

What Lightning's DDP strategy would get wrong with these wrappers, and what they do instead:

1. Lightning wraps the module before it creates the optimizers; ShardedDataParallel needs its OSS first, so the
   sharded strategy creates the optimizers inside ``configure_ddp``, before wrapping.
2. Gradient clipping by norm (``gradient_clip_val``) clips each rank's gradients by the norm of what that rank
   holds; with a sharded optimizer the strategies clip by the norm over the whole model (`OSS.clip_grad_norm`),
   as DDP's clipping does.
3. fp16 (``precision="16-mixed"`` on a GPU, or a `MixedPrecision` plug-in given on the CPU): torch's GradScaler
   finds an inf in one rank's shard only, so that rank alone would skip its step and the others wait for it;
   the scaler is replaced by `ShardedGradScaler`, which agrees on the skip across ranks. (Lightning itself turns
   ``precision="16-mixed"`` on the CPU into bf16; pass ``plugins=[MixedPrecision("16-mixed", "cpu")]`` for fp16.)
4. Gradient accumulation (``accumulate_grad_batches``) reduces every micro-batch unless the wrapper's
   ``no_sync`` is used: the strategies use it, as Lightning does for torch's DDP.
5. Teardown unwraps these wrappers too (so ``validate``/``test``/``predict`` after ``fit`` see the module).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.fabric.strategies.strategy import Strategy as FabricStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.strategies.strategy import Strategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('ddpkit.integrations.lightning needs lightning: pip install "ddpkit[lightning]"') from exc

from ddpkit.integrations.sharding import (
    SDP_OPTIONS,
    as_oss,
    check_oss_kwargs,
    refuse_unknown_kwargs,
    sharded_scaler_like,
    take_sdp_kwargs,
)
from ddpkit.nn import ShardedDataParallel, SlowMoDistributedDataParallel
from ddpkit.optim import OSS

__all__ = ["DDPKitOSSStrategy", "DDPKitShardedStrategy", "DDPKitSlowMoStrategy", "as_oss"]
__all__ += ["DDPKitFabricOSSStrategy", "DDPKitFabricShardedStrategy", "DDPKitFabricSlowMoStrategy"]


def _own_arguments(strategy: type) -> frozenset[str]:
    """The named arguments of a Lightning strategy's constructor (its ``**kwargs`` go to torch DDP, which the
    ShardedDataParallel and SlowMo strategies never build: what is left there would be dropped)."""
    parameters = inspect.signature(strategy.__init__).parameters.values()
    named = (p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return frozenset(named) - {"self"}


class _GlobalNormClip:
    """`Precision.clip_grad_by_norm` for sharded optimizers: the norm over every rank's shard (point 2 of the module
    doc). A callable object held by the plug-in rather than a method bound onto it, so that the plug-in survives
    pickling (Lightning's spawn launcher sends the strategy to each process).

    Args:
        plugin: the precision plug-in whose gradients it clips (its `main_params`).
    """

    def __init__(self, plugin: Precision) -> None:
        self.plugin = plugin

    def __call__(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if isinstance(optimizer, OSS):
            optimizer.clip_grad_norm(clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(list(self.plugin.main_params(optimizer)), clip_val)


def _for_sharded_optimizers(plugin: Precision) -> Precision:
    """`plugin`, changed in place for sharded optimizers: global-norm clipping, and a ShardedGradScaler instead
    of torch's GradScaler (points 2 and 3 of the module doc)."""
    plugin.clip_grad_by_norm = _GlobalNormClip(plugin)  # type: ignore[method-assign]
    return _with_sharded_scaler(plugin)


def _with_sharded_scaler(plugin: Any) -> Any:
    """A Lightning or Fabric mixed-precision `plugin` with torch's GradScaler replaced by a ShardedGradScaler of
    the same settings (its skip agreed by every rank); any other plug-in as it is."""
    if isinstance(plugin, MixedPrecision | FabricMixedPrecision) and plugin.scaler is not None:
        plugin.scaler = sharded_scaler_like(plugin.scaler, plugin.device)
    return plugin


def _adjusting_setter(base: property, adjust: Callable[[Any], Any]) -> property:
    """Property `base` whose setter passes every value but None through `adjust` first (a plug-in a strategy is
    given, changed for sharded optimizers)."""

    def setter(strategy: Any, value: Any) -> None:
        base.fset(strategy, adjust(value) if value is not None else None)  # type: ignore[misc]

    return property(base.fget, setter)


class _DDPKitStrategy(DDPStrategy):
    """What the three strategies share: the precision plug-in adjusted for sharded optimizers, ``no_sync`` for
    any wrapper that has it, and teardown that unwraps ddpkit's wrappers."""

    wrappers: tuple[type[nn.Module], ...] = (ShardedDataParallel, SlowMoDistributedDataParallel)

    precision_plugin = _adjusting_setter(Strategy.precision_plugin, _for_sharded_optimizers)  # type: ignore[assignment]

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        no_sync: Callable[[], Any] | None = getattr(self.model, "no_sync", None)
        if no_sync is None:
            yield None
            return
        with no_sync():
            yield None

    def teardown(self) -> None:
        if isinstance(self.model, self.wrappers):
            self.model = self.lightning_module
        super().teardown()


class DDPKitOSSStrategy(_DDPKitStrategy):
    """ZeRO-1 in Lightning: torch DDP for the gradients, every optimizer an `OSS` (module doc). OSS's own
    arguments (``min_split_numel``, ``split_params``, ...) go in `oss_kwargs`.

    Args:
        *args: Lightning's DDPStrategy's positional arguments.
        oss_kwargs: OSS's own arguments, for every optimizer (None: OSS's defaults).
        **kwargs: DDPStrategy's keyword arguments (torch DDP's too: ``bucket_cap_mb``, ...).
    """

    strategy_name = "ddpkit_oss"

    def __init__(self, *args: Any, oss_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._oss_kwargs = check_oss_kwargs(oss_kwargs, type(self).__name__)
        super().__init__(*args, **kwargs)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self.optimizers = [as_oss(optimizer, **self._oss_kwargs) for optimizer in self.optimizers]
        _repoint_schedulers(self)


class DDPKitShardedStrategy(_DDPKitStrategy):
    """ZeRO-2 in Lightning (fairscale's ``ddp_sharded``): `OSS` optimizers and `ShardedDataParallel` (module
    doc). Keyword arguments of ShardedDataParallel (``reduce_buffer_size``, ``broadcast_buffers``, ...) may be
    given to the constructor with DDPStrategy's own; OSS's own arguments (``min_split_numel``, ...) go in
    `oss_kwargs`.

    Args:
        *args: Lightning's DDPStrategy's positional arguments.
        oss_kwargs: OSS's own arguments, for every optimizer (None: OSS's defaults).
        **kwargs: DDPStrategy's keyword arguments and ShardedDataParallel's; any other (a misspelt one, torch
            DDP's) is refused by name.
    """

    strategy_name = "ddpkit_sharded"

    def __init__(self, *args: Any, oss_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._sdp_kwargs = take_sdp_kwargs(kwargs)
        refuse_unknown_kwargs(kwargs, _own_arguments(DDPStrategy), type(self).__name__, SDP_OPTIONS)
        self._oss_kwargs = check_oss_kwargs(oss_kwargs, type(self).__name__)
        super().__init__(*args, **kwargs)
        self._optimizers_ready = False

    def configure_ddp(self) -> None:
        trainer = self.lightning_module.trainer
        self._make_sharded_optimizers(trainer)
        self.model = ShardedDataParallel(self.model, self.optimizers, **self._sdp_kwargs)

    def _make_sharded_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self.optimizers = [as_oss(optimizer, **self._oss_kwargs) for optimizer in self.optimizers]
        _repoint_schedulers(self)
        self._optimizers_ready = True

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        if self._optimizers_ready:  # made in configure_ddp, before the wrapper (point 1)
            return
        self._make_sharded_optimizers(trainer)


class DDPKitSlowMoStrategy(_DDPKitStrategy):
    """SlowMo in Lightning (module doc): the arguments of `SlowMoDistributedDataParallel` (``slowmo_momentum``,
    ``slowmo_base_algorithm``, ...) go in `slowmo_kwargs`. ``nprocs_per_node`` defaults to Lightning's devices
    per node (fairscale's meaning: DDP inside a machine, SlowMo between machines); give 1 to make every process
    a SlowMo node of its own (local SGD between the processes of one machine).

    Args:
        *args: Lightning's DDPStrategy's positional arguments.
        slowmo_kwargs: SlowMoDistributedDataParallel's arguments (``slowmo_momentum``, ``nprocs_per_node``, ...).
        **kwargs: DDPStrategy's keyword arguments; any that would go to torch DDP is refused by name.
    """

    strategy_name = "ddpkit_slowmo"

    checkpoint_key = "ddpkit_slowmo"

    def __init__(self, *args: Any, slowmo_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        refuse_unknown_kwargs(kwargs, _own_arguments(DDPStrategy), type(self).__name__, ["slowmo_kwargs"])
        self._slowmo_kwargs = dict(slowmo_kwargs or {})
        self._resumed_slowmo: dict[str, Any] | None = None
        self._slowmo: SlowMoDistributedDataParallel | None = None  # kept after teardown (a save after fit)
        super().__init__(*args, **kwargs)

    def configure_ddp(self) -> None:
        arguments = {"nprocs_per_node": self.num_processes, **self._slowmo_kwargs}
        self.model = self._slowmo = SlowMoDistributedDataParallel(self.model, **arguments)
        if self._resumed_slowmo is not None:  # Lightning restores the checkpoint before it wraps the module
            self.model.load_slowmo_state_dict(self._resumed_slowmo)
            self._resumed_slowmo = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self._slowmo is not None:  # on every rank (a collective when sharded)
            checkpoint[self.checkpoint_key] = self._slowmo.slowmo_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict)
        state = checkpoint.get(self.checkpoint_key)
        if state is not None and isinstance(self.model, SlowMoDistributedDataParallel):
            self.model.load_slowmo_state_dict(state)
        elif state is not None:
            self._resumed_slowmo = state

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if isinstance(self.model, SlowMoDistributedDataParallel):
            self.model.perform_slowmo(optimizer)
        return output


def _repoint_schedulers(strategy: DDPStrategy) -> None:
    """Each learning-rate scheduler of `strategy` now drives the OSS that replaced its optimizer (they share the
    param-group dicts, so its values are right; this keeps its own bookkeeping on the optimizer it steps)."""
    for config in strategy.lr_scheduler_configs:
        scheduler = config.scheduler
        old = getattr(scheduler, "optimizer", None)
        for new in strategy.optimizers:
            if old is not None and new is not old and new.param_groups and new.param_groups[0] is old.param_groups[0]:
                scheduler.optimizer = new


# -- Fabric ----------------------------------------------------------------------------------------------------


class _NoSyncControl(_BackwardSyncControl):
    """`fabric.no_backward_sync(model)` through the wrapper's own ``no_sync`` (any ddpkit or torch wrapper)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Any:
        no_sync = getattr(module, "no_sync", None)
        if not enabled or no_sync is None:
            return nullcontext()
        return no_sync()


class _DDPKitFabricStrategy(FabricDDPStrategy):
    """What the Fabric strategies share: ShardedGradScaler for fp16, ``no_sync`` for accumulation, clipping by
    the norm over all shards."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _NoSyncControl()

    precision = _adjusting_setter(FabricStrategy.precision, _with_sharded_scaler)  # type: ignore[assignment]

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        if not isinstance(optimizer, OSS):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        norm = optimizer.clip_grad_norm(max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is not finite ({norm})")
        return norm


class DDPKitFabricOSSStrategy(_DDPKitFabricStrategy):
    """`DDPKitOSSStrategy` for Fabric: torch DDP for the gradients, the optimizers made `OSS` (with `oss_kwargs`)
    in `setup`.

    Args:
        *args: Fabric's DDPStrategy's positional arguments.
        oss_kwargs: OSS's own arguments, for every optimizer (None: OSS's defaults).
        **kwargs: Fabric's DDPStrategy's keyword arguments.
    """

    strategy_name = "ddpkit_oss"

    def __init__(self, *args: Any, oss_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._oss_kwargs = check_oss_kwargs(oss_kwargs, type(self).__name__)
        super().__init__(*args, **kwargs)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return as_oss(optimizer, **self._oss_kwargs)


class DDPKitFabricShardedStrategy(_DDPKitFabricStrategy):
    """`DDPKitShardedStrategy` for Fabric: `fabric.setup(model, *optimizers)` makes the optimizers `OSS` (with
    `oss_kwargs`) and wraps the module in `ShardedDataParallel` (with the keyword arguments of its own given to the
    constructor); they must be set up together.

    Args:
        *args: Fabric's DDPStrategy's positional arguments.
        oss_kwargs: OSS's own arguments, for every optimizer (None: OSS's defaults).
        **kwargs: Fabric's DDPStrategy's keyword arguments and ShardedDataParallel's.
    """

    strategy_name = "ddpkit_sharded"

    def __init__(self, *args: Any, oss_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._sdp_kwargs = take_sdp_kwargs(kwargs)
        refuse_unknown_kwargs(kwargs, _own_arguments(FabricDDPStrategy), type(self).__name__, SDP_OPTIONS)
        self._oss_kwargs = check_oss_kwargs(oss_kwargs, type(self).__name__)
        super().__init__(*args, **kwargs)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        sharded = [as_oss(optimizer, **self._oss_kwargs) for optimizer in optimizers]
        if scheduler is not None and getattr(scheduler, "optimizer", None) in optimizers:
            scheduler.optimizer = sharded[optimizers.index(scheduler.optimizer)]
        wrapped = ShardedDataParallel(module, sharded, **self._sdp_kwargs)
        return wrapped, sharded, scheduler  # type: ignore[list-item]

    def setup_module(self, module: nn.Module) -> nn.Module:
        raise RuntimeError(
            "ddpkit_sharded: ShardedDataParallel needs the model's optimizers; set them up together: "
            "model, optimizer = fabric.setup(model, optimizer)"
        )


class DDPKitFabricSlowMoStrategy(_DDPKitFabricStrategy):
    """`DDPKitSlowMoStrategy` for Fabric: the module wrapped in `SlowMoDistributedDataParallel` (arguments in
    `slowmo_kwargs`; ``nprocs_per_node`` defaults to the devices per machine), ``perform_slowmo`` after every
    optimizer step.

    Args:
        *args: Fabric's DDPStrategy's positional arguments.
        slowmo_kwargs: SlowMoDistributedDataParallel's arguments.
        **kwargs: Fabric's DDPStrategy's keyword arguments.
    """

    strategy_name = "ddpkit_slowmo"

    def __init__(self, *args: Any, slowmo_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        refuse_unknown_kwargs(kwargs, _own_arguments(FabricDDPStrategy), type(self).__name__, ["slowmo_kwargs"])
        self._slowmo_kwargs = dict(slowmo_kwargs or {})
        self._slowmo: SlowMoDistributedDataParallel | None = None
        super().__init__(*args, **kwargs)

    def setup_module(self, module: nn.Module) -> nn.Module:
        arguments = {"nprocs_per_node": self.num_processes, **self._slowmo_kwargs}
        self._slowmo = SlowMoDistributedDataParallel(module, **arguments)
        return self._slowmo

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        if self._slowmo is not None:
            self._slowmo.perform_slowmo(optimizer)
        return output


def _register() -> None:
    """The strategies under their names, and for the sharded ones the variants Lightning registered for fairscale's
    (``ddp_sharded_spawn``, ``ddp_sharded_find_unused_parameters_false``): ``ddpkit_sharded_spawn`` (Lightning's
    spawn launcher), ``ddpkit_sharded_find_unused_parameters_false`` and both; the same for ``ddpkit_oss``, and
    ``ddpkit_slowmo_spawn``."""
    for cls in (DDPKitShardedStrategy, DDPKitOSSStrategy, DDPKitSlowMoStrategy):
        description = (cls.__doc__ or "").split(":")[0]
        variants: dict[str, dict[str, Any]] = {"": {}, "_spawn": {"start_method": "spawn"}}
        if cls is not DDPKitSlowMoStrategy:
            unused = {"find_unused_parameters": False}
            variants |= {
                "_find_unused_parameters_false": unused,
                "_spawn_find_unused_parameters_false": {"start_method": "spawn", **unused},
            }
        for suffix, init_params in variants.items():
            if cls.strategy_name + suffix not in StrategyRegistry:
                StrategyRegistry.register(cls.strategy_name + suffix, cls, description=description, **init_params)
    for fabric_cls in (DDPKitFabricShardedStrategy, DDPKitFabricOSSStrategy, DDPKitFabricSlowMoStrategy):
        if fabric_cls.strategy_name not in FABRIC_STRATEGIES:
            description = (fabric_cls.__doc__ or "").split(":")[0]
            FABRIC_STRATEGIES.register(fabric_cls.strategy_name, fabric_cls, description=description)


_register()
