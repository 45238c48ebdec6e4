"""Lightning and Fabric strategies that train on through lost machines: one process per replica under a
`ddpkit.fault_tolerance.Manager` (the same manager as ``ddpkit train --fault-tolerant`` and your own loop).

Each process runs Lightning on one device and no process group spans the job: the ranks meet in rounds through
the manager's store. Per optimizer step the strategy

1. takes part in the manager's round: its quorum was formed in the background since the previous step's commit
   (`Manager.start_round(background=True)`), while the batch loaded and, for the Trainer, while the training step
   and backward computed; it is taken after backward (Trainer) or at the step's first training forward (Fabric,
   whose forward and backward are your code's). A process that starts late, or comes back after it was lost,
   receives the live state from a member first (the module, the optimizers, the learning-rate schedulers and, for
   the Trainer, Lightning's loop counters: epoch, batch and optimizer-step progress, so ``global_step`` and
   ``current_epoch`` equal the members' right after the heal); a replica left out of the round formed (it
   stalled) takes the live state there, and the Trainer computes its training step again on it;
2. averages the gradients over the round's members after backward (before gradient clipping and
   ``on_before_optimizer_step``, which then see the averaged gradients, as under DDP);
3. steps the optimizer only if the round committed on every member: a round that failed anywhere (a member died
   during it) leaves every member's parameters and optimizer state as they were, and Lightning's loop goes on to
   the next batch; then starts forming the next round's quorum in the background.

Sends per step what `Manager.average_gradients` sends (one all-reduce of the gradients over the round's group)
plus the quorum's store round trips, and the live state to joiners. Holds a flat copy of the gradients during the
average. Data: each process reads what its dataloader gives it; split the data by the manager's rank yourself
(``DistributedSampler(dataset, num_replicas=max_world, rank=rank)``) so replicas see different batches. A joiner
resumes at the members' data position: under the Trainer it takes the members' loop counters before its first
training step and reads the batch the members are at (the same epoch, given to the sampler, and batch index of its
own share: the batches before it are read and dropped), as a replica that never stopped would; under Fabric your
loop does the same with the position it registered (the class's example).

Refused, with the reason: manual optimization and ``accumulate_grad_batches > 1`` (the round starts inside the
optimizer step, after the backward passes of manual optimization and of earlier micro-batches ran on state a
joiner had not received yet); several devices per process (a replica is one process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.pytorch.strategies import SingleDeviceStrategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    needs = 'ddpkit.integrations.lightning_fault_tolerant needs lightning: pip install "ddpkit[lightning]"'
    raise ImportError(needs) from exc

from ddpkit.distributed.agreement import optimizer_settings
from ddpkit.fault_tolerance.manager import FellBehind, Manager

__all__ = ["DDPKitFabricFaultTolerantStrategy", "DDPKitFaultTolerantStrategy"]


def _check_manager(manager: Any, who: str) -> Manager:
    if not isinstance(manager, Manager):
        raise TypeError(f"{who}: manager must be a ddpkit.fault_tolerance.Manager, got {type(manager).__name__}")
    return manager


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _register_optimizers(manager: Manager, optimizers: Callable[[], list[torch.optim.Optimizer]]) -> None:
    def load(states: list[dict[str, Any]]) -> None:
        for optimizer, state in zip(optimizers(), states, strict=True):
            optimizer.load_state_dict(state)

    manager.register_state("optimizers", lambda: [o.state_dict() for o in optimizers()], load)


def _loops(trainer: pl.Trainer) -> dict[str, Any]:
    """The progress objects of the fit loop that decide ``global_step``, ``current_epoch`` and the epoch's end."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return {
        "epoch": trainer.fit_loop.epoch_progress,
        "batch": epoch_loop.batch_progress,
        "optimizer": epoch_loop.automatic_optimization.optim_progress,
        "scheduler": epoch_loop.scheduler_progress,
    }


def loop_counters(trainer: pl.Trainer) -> dict[str, Any]:
    """Lightning's loop counters of a fit in progress (what a joiner takes so its loop is where the members' are)."""
    counters: dict[str, Any] = {name: progress.state_dict() for name, progress in _loops(trainer).items()}
    counters["batches_that_stepped"] = trainer.fit_loop.epoch_loop._batches_that_stepped
    return counters


def load_loop_counters(trainer: pl.Trainer, counters: dict[str, Any]) -> None:
    """Sets Lightning's loop counters of a fit in progress to `counters` (`loop_counters`)."""
    for name, progress in _loops(trainer).items():
        progress.load_state_dict(counters[name])
    trainer.fit_loop.epoch_loop._batches_that_stepped = counters["batches_that_stepped"]


def _enter_formed(manager: Manager) -> bool:
    """Enters the round `manager` formed in the background; a replica left out of it (it stalled) takes the live
    state there instead. Returns whether it took the live state."""
    try:
        manager.current()
    except FellBehind:
        manager.rejoin()
        return True
    return False


def shifted(counters: Any, now: Any, start: Any) -> Any:
    """`counters` plus what this process counted from `start` to `now` (the same nested dicts of counts): the
    members' counters at their step's start, moved to where this process is inside its own step."""
    if isinstance(counters, dict):
        return {k: shifted(v, now[k], start[k]) for k, v in counters.items()}
    if isinstance(counters, int) and not isinstance(counters, bool):
        return counters + now - start
    return counters


def fetch_batch_at(trainer: pl.Trainer, epoch: int, index: int) -> Any:
    """Batch `index` of epoch `epoch` of the fit's training data, as the fit loop's own fetcher yields it (the
    sampler's epoch set, a new iterator, the batches before it read and dropped), the fetcher left after it: the
    batch the members' replicas of this rank would be at. Only a map of batches that Lightning fetches itself (not
    a ``dataloader_iter`` training step) can be moved."""
    fit_loop = trainer.fit_loop
    fetcher, loader = fit_loop._data_fetcher, fit_loop._combined_loader
    if fetcher is None or loader is None or type(fetcher).__name__ == "_DataLoaderIterDataFetcher":
        raise ValueError(
            "DDPKitFaultTolerantStrategy: a joiner can take the members' data position only when Lightning fetches "
            "the batches (a training_step taking dataloader_iter reads its own)"
        )
    for dataloader in loader.flattened:
        _set_sampler_epoch(dataloader, epoch)
    iter(fetcher)
    for _ in range(index):
        next(fetcher)
    batch, _, _ = next(fetcher)
    fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
    batch = trainer.precision_plugin.convert_input(batch)
    return trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)


class DDPKitFaultTolerantStrategy(SingleDeviceStrategy):
    """``Trainer(strategy=DDPKitFaultTolerantStrategy(manager))``: a fault-tolerant replica (module doc).

    Register anything else a joiner needs (your own counters) with the manager before ``fit``.

    Args:
        manager: this process's `ddpkit.fault_tolerance.Manager` (its store, rank, ``max_world``, ``min_replicas``,
            timeouts).
        device: where the module trains (default the CPU).
        **kwargs: Lightning's SingleDeviceStrategy's keyword arguments.

    Raises:
        ValueError: at ``fit``, for manual optimization or ``accumulate_grad_batches`` > 1.

    Example:
        Each replica's process, its share of the data chosen by the manager's rank::

            manager = Manager(store, rank, max_world=3, quorum_timeout=5, settings={"lr": 0.1})
            sampler = DistributedSampler(dataset, num_replicas=3, rank=rank)
            trainer = L.Trainer(strategy=DDPKitFaultTolerantStrategy(manager), accelerator="cpu", devices=1,
                                max_steps=1000)
            trainer.fit(model, DataLoader(dataset, batch_size=32, sampler=sampler))
            manager.close()
    """

    strategy_name = "ddpkit_fault_tolerant"

    def __init__(self, manager: Manager, device: str | torch.device = "cpu", **kwargs: Any) -> None:
        super().__init__(device=torch.device(device), **kwargs)
        self.manager = _check_manager(manager, "DDPKitFaultTolerantStrategy")
        self._registered = False
        self._step_start: dict[str, Any] | None = None  # the loop counters at this step's start (what joiners take)
        self._round_open = False  # this step's round was entered before the training step (a first step, a heal)
        self._realign = False  # took the members' live state: its next batch is the members' data position

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != "fit" or self._registered:
            return
        if not self.lightning_module.automatic_optimization:
            raise ValueError(
                "DDPKitFaultTolerantStrategy: manual optimization is not supported (the round starts in the "
                "optimizer step, after your backward ran on state a joining replica had not received yet); use "
                "automatic optimization"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"DDPKitFaultTolerantStrategy: accumulate_grad_batches must be 1, got "
                f"{trainer.accumulate_grad_batches} (the earlier micro-batches' backward would run before the "
                "round that heals a joining replica)"
            )
        self.manager.register("module", self.lightning_module)
        _register_optimizers(self.manager, lambda: self.optimizers)
        self.manager.require_same(optimizer_settings(self.optimizers))  # (a replica's lr set only here is compared)

        def load_schedulers(states: list[dict[str, Any]]) -> None:
            for config, state in zip(trainer.lr_scheduler_configs, states, strict=True):
                config.scheduler.load_state_dict(state)

        schedulers = lambda: [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]  # noqa: E731
        self.manager.register_state("schedulers", schedulers, load_schedulers)
        self.manager.register_state("loops", lambda: self._step_start or loop_counters(trainer), self._load_loops)
        self._registered = True

    def _load_loops(self, counters: dict[str, Any]) -> None:
        """The members' loop counters at their step's start: loaded where this process is at its own step's start
        (a new process, before its first training step), else moved by what it counted since (a replica left out of
        a round, taking the live state after its backward). A joiner then reads its next batch where the members
        are (`batch_to_device`)."""
        trainer = self.lightning_module.trainer
        now = loop_counters(trainer)
        start = self._step_start or now
        load_loop_counters(trainer, shifted(counters, now, start))
        quorum = self.manager.quorum
        self._realign = quorum is not None and self.manager.rank in quorum.joined

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Before each training step: notes the loop counters at its start; at this process's first step, enters
        the job's round (round 0, or the live state of a job under way); after taking the live state, replaces
        the batch by the one at the members' data position (`fetch_batch_at`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.training and self._registered:
            self._step_start = loop_counters(trainer)
            if self.manager.quorum is None and not self.manager.forming:
                self.manager.start_round()  # a joiner takes the live state here, before its training step
                self._round_open = True
            if self._realign:
                self._realign = False
                epoch_loop = trainer.fit_loop.epoch_loop
                batch = fetch_batch_at(
                    trainer, trainer.fit_loop.epoch_progress.current.processed, epoch_loop.batch_progress.current.ready
                )
        return super().batch_to_device(batch, device, dataloader_idx)

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        manager = self.manager
        manager.step = self.lightning_module.trainer.global_step  # events name Lightning's step
        if self._round_open:  # entered before the training step (`batch_to_device`)
            self._round_open = False
            result = closure()
        elif manager.forming:  # the quorum formed while the training step and backward computed
            result = closure()
            if _enter_formed(manager):  # left out of the round (it stalled): computed again on the live state
                result = closure()
        else:  # (a step after a round this process could not form in the background)
            manager.start_round()
            result = closure()  # training_step and backward
        manager.average_gradients(_trainable(self.lightning_module))
        committed = manager.should_commit()  # False when the round failed on some member: every member skips
        manager.start_round(background=True)  # the next step's quorum, while its batch loads and computes
        if not committed:
            return result
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)


class _RoundOnForward(nn.Module):
    """Fabric's module under the fault-tolerant strategy: a training forward opens the manager's round first (a
    joiner receives the live state before it computes), unless the round is open already."""

    def __init__(self, module: nn.Module, strategy: DDPKitFabricFaultTolerantStrategy) -> None:
        super().__init__()
        self.module = module
        self._strategy = [strategy]  # in a list: not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            self._strategy[0].open_round()
        return self.module(*args, **kwargs)


class DDPKitFabricFaultTolerantStrategy(FabricSingleDeviceStrategy):
    """``Fabric(strategy=DDPKitFabricFaultTolerantStrategy(manager))``: the same replica for a Fabric loop.

    ``fabric.setup(model, optimizer)`` registers both with the manager; the first training forward of a step opens
    the round, ``optimizer.step()`` averages the gradients and steps only if the round committed everywhere
    (it returns None when it did not). Register your loop's own counters with the manager
    (``manager.register_state("step", ...)``) and call ``fabric.strategy.open_round()`` before reading data, so a
    joiner takes the members' step there and your loop starts at their batch.

    Args:
        manager: this process's `ddpkit.fault_tolerance.Manager`.
        device: where the module trains (default the CPU).
        **kwargs: Fabric's SingleDeviceStrategy's keyword arguments.

    Example:
        A loop whose position a joiner takes (``loader`` gives this replica's share of the data)::

            fabric = L.Fabric(strategy=DDPKitFabricFaultTolerantStrategy(manager), accelerator="cpu", devices=1)
            model, optimizer = fabric.setup(model, optimizer)
            position = {"step": 0}
            manager.register_state("step", lambda: dict(position), position.update)
            data = fabric.setup_dataloaders(loader)
            fabric.strategy.open_round()  # a joiner takes the live state here, the step included
            while position["step"] < total_steps:
                for index, (x, y) in enumerate(data):
                    if index < position["step"] % len(data):
                        continue  # (a joiner starts at the members' batch)
                    fabric.backward(loss_fn(model(x), y))
                    optimizer.step()  # None where the round failed on some member
                    optimizer.zero_grad()
                    position["step"] += 1
    """

    def __init__(self, manager: Manager, device: str | torch.device = "cpu", **kwargs: Any) -> None:
        super().__init__(device=torch.device(device), **kwargs)
        self.manager = _check_manager(manager, "DDPKitFabricFaultTolerantStrategy")
        self._module: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._round_open = False

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        if self._module is not None:
            raise ValueError("DDPKitFabricFaultTolerantStrategy: set up one module per process (one replica)")
        self._module = module
        self.manager.register("module", module)
        _register_optimizers(self.manager, lambda: self._optimizers)
        return _RoundOnForward(module, self)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._optimizers.append(optimizer)
        self.manager.require_same(optimizer_settings([optimizer], first=len(self._optimizers) - 1))
        return super().setup_optimizer(optimizer)

    def open_round(self) -> None:
        """Enters the manager's round unless one is open (called by the module's training forward): the one
        formed in the background since the last step (a replica left out of it takes the live state there), else
        a round formed now (the first step)."""
        if self._round_open:
            return
        manager = self.manager
        if manager.forming:
            _enter_formed(manager)  # (before the step computes: a replica left out takes the live state here)
        else:
            manager.start_round()
        self._round_open = True

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        assert self._module is not None, "DDPKitFabricFaultTolerantStrategy: fabric.setup(model, optimizer) first"
        self.open_round()  # a step without a training forward still takes part in the round
        self._round_open = False
        self.manager.average_gradients(_trainable(self._module))
        committed = self.manager.should_commit()
        self.manager.start_round(background=True)  # the next step's quorum, while its batch loads
        if not committed:
            return None
        return super().optimizer_step(optimizer, **kwargs)
