"""Checkpoints that let `ddpkit train --resume` continue where a run stopped (the files: `checkpoint_files`).

Rank 0 writes ``shared.pt``: the model (for every strategy but SlowMo the replicas are equal), the whole optimizer
state in torch's format (consolidated first when sharded, so it loads at any world size), SlowMo's slow buffers
and the trainer's counters. Under SlowMo each rank also writes its own replica and optimizer state (they differ
between nodes), each into its own ``--out``. Rank 0 commits the folder once every rank's file is synced; the
last `keep` committed folders stay. On resume rank 0 picks the newest committed folder, verifies and reads it and
sends it to the others; each SlowMo rank verifies and reads its own file. A SlowMo job resumed at another world
size (every rank file then in rank 0's ``--out``) starts every rank from the mean of the saved replicas and
optimizer states (`mean_state`: what SlowMo's next averaging makes of the parameters), with the slow buffers
carried whole. Saving and loading are collectives: every rank calls them, and a failure on any rank (a full disk,
a corrupt file) raises the same error on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch

from ddpkit.distributed.env import group_rank, group_size
from ddpkit.distributed.objects import broadcast_object, gather_objects
from ddpkit.nn import SlowMoDistributedDataParallel
from ddpkit.optim import OSS
from ddpkit.optim.state_dict import check_state_shapes
from ddpkit.train.checkpoints import checkpoint_files as files
from ddpkit.train.checkpoints.checkpoint_files import CheckpointError
from ddpkit.train.loop.strategies import Strategy
from ddpkit.train.loop.trainer import TrainerState

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


def _sharded_part(optimizer: torch.optim.Optimizer) -> OSS | None:
    """The OSS inside `optimizer` (itself, or the optimizer a wrapper such as AdaScale holds)."""
    if isinstance(optimizer, OSS):
        return optimizer
    for name in ("optimizer", "_optimizer", "optim"):
        inner = getattr(optimizer, name, None)
        if isinstance(inner, OSS):
            return inner
    return None


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The whole optimizer state on rank 0 (consolidating a sharded one first), None elsewhere."""
    sharded = _sharded_part(optimizer)
    if sharded is not None:
        sharded.consolidate_state_dict(recipient_rank=0)
    return optimizer.state_dict() if group_rank() == 0 else None


def _is_slowmo(strategy: Strategy) -> bool:
    """SlowMo nodes step their own optimizers on their own gradients, so replicas and optimizer states differ."""
    return isinstance(strategy.model, SlowMoDistributedDataParallel)


def _per_rank(slow_state: dict[str, Any] | None) -> bool:
    """Whether SlowMo's state differs between nodes (SGP's gossip buffer; the slow-link residuals and syncs in
    flight), so each rank's own file carries it."""
    return slow_state is not None and ("sgp_buffer" in slow_state or "outer_synced" in slow_state)


def _agree(error: str | None) -> None:
    """Raises on every rank the first rank's error, if any rank had one (one small all-gather)."""
    errors = gather_objects(error, dst=-1)
    assert errors is not None
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def _write_files(folder: str, strategy: Strategy, state: TrainerState) -> tuple[dict[str, str], str | None]:
    """This rank's files of the checkpoint in `folder` (collectives first: every rank calls it): their names and
    SHA-256, and the error that stopped the writing, if any."""
    rank, slowmo = group_rank(), _is_slowmo(strategy)
    optimizer_state = None if slowmo else _optimizer_state(strategy.optimizer)
    slow_state = strategy.model.slowmo_state_dict() if slowmo else None
    scaler = strategy.scaler.state_dict() if strategy.scaler is not None else None
    written: dict[str, str] = {}
    try:
        if slowmo or rank == 0:
            os.makedirs(folder, exist_ok=True)
        if slowmo:
            mine = {
                "model": strategy.module.state_dict(),
                "optimizer": strategy.optimizer.state_dict(),
                "scaler": scaler,
                "slowmo": slow_state if _per_rank(slow_state) else None,  # per node
            }
            written[files.rank_file(rank)] = files.save_file(mine, os.path.join(folder, files.rank_file(rank)))
        if rank == 0:
            if os.path.exists(os.path.join(folder, files.MARKER)):
                os.unlink(os.path.join(folder, files.MARKER))  # this folder is being rewritten: not committed now
            shared = {
                "model": None if slowmo else strategy.module.state_dict(),
                "scaler": None if slowmo else scaler,
                "optimizer": optimizer_state,
                "slowmo": slow_state,
                "trainer": dataclasses.asdict(state),
            }
            written[files.SHARED] = files.save_file(shared, os.path.join(folder, files.SHARED))
    except CheckpointError as exc:
        return written, str(exc)
    except OSError as exc:
        return written, f"cannot write {folder}: {exc}"
    return written, None


def _commit(folder: str, reports: list[tuple[dict[str, str], str | None]], manifest: dict[str, Any]) -> str | None:
    """Rank 0: writes the marker once every rank reported its files written; the first error otherwise."""
    failed = next((error for _, error in reports if error is not None), None)
    if failed is not None:
        return failed
    try:
        files.write_marker(folder, {**manifest, "files": {k: v for w, _ in reports for k, v in w.items()}})
    except CheckpointError as exc:
        return str(exc)
    return None


def save_checkpoint(out: str, strategy: Strategy, state: TrainerState, settings: dict[str, Any], keep: int = 2) -> str:
    """Writes and commits the checkpoint of step ``state.step`` (a collective), keeps the newest `keep`; returns
    its folder. Raises the same CheckpointError on every rank if any rank could not write its file."""
    folder = os.path.join(files.checkpoint_root(out), files.folder_name(state.step))
    reports = gather_objects(_write_files(folder, strategy, state), dst=0)
    decision: tuple[str | None, list[str]] = (None, [])
    if group_rank() == 0:
        assert reports is not None
        manifest = {
            "epoch": state.epoch,
            "step": state.step,
            "epoch_samples": state.epoch_samples,
            "world_size": group_size(),
            "strategy": strategy.name,
            "settings": settings,
        }
        failed = _commit(folder, reports, manifest)
        kept = [os.path.basename(f) for _, f in files.committed(out)][-keep:] if failed is None else []
        decision = (failed, kept)
    failed, kept = broadcast_object(decision, 0)
    if failed is not None:
        raise CheckpointError(failed)
    files.prune(out, kept)
    return folder


def _read_shared(out: str, settings: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any], list[str]]:
    """Rank 0: the newest committed folder, its marker, its verified shared file and what the resume changes."""
    files.check_written_by(out, fault_tolerant=False)
    folder, manifest, loaded, skipped = files.newest_intact(out, verify=(files.SHARED,))
    try:
        notes = [*skipped, *files.resume_notes(manifest, settings)]
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    shared = loaded[files.SHARED]
    if manifest["strategy"] == "slowmo" and manifest["world_size"] != settings["world_size"]:
        if _per_rank(shared["slowmo"]):
            raise CheckpointError(
                f"--resume: the checkpoint of step {manifest['step']} holds SGP's gossip state or the slow-link "
                f"state (error-feedback residuals, syncs in flight) of "
                f"{manifest['world_size']} processes, which does not carry to {settings['world_size']}; resume at "
                f"--nproc-per-node x --nnodes = {manifest['world_size']}"
            )
        saved = [files.load_verified(folder, files.rank_file(r), manifest) for r in range(manifest["world_size"])]
        shared["replica"] = mean_state(saved)
    return folder, manifest, shared, notes


def mean_state(states: list[Any]) -> Any:
    """The element-wise mean of equally structured states (dicts, lists, tensors): floating-point tensors are
    averaged in the given order (``torch.stack(...).mean(0)``), anything else is taken from the first."""
    first = states[0]
    if isinstance(first, dict):
        return {key: mean_state([s[key] for s in states]) for key in first}
    if isinstance(first, list | tuple):
        return type(first)(mean_state(list(items)) for items in zip(*states, strict=True))
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        return torch.stack(states).mean(0)
    return first


def _load_model(module: torch.nn.Module, saved: dict[str, torch.Tensor], path: str) -> None:
    """Loads a model state after checking every tensor's name, shape and dtype against `module`."""
    mine = module.state_dict()
    for name, value in mine.items():
        other = saved.get(name)
        if other is None or tuple(other.shape) != tuple(value.shape) or other.dtype != value.dtype:
            got = "missing" if other is None else f"{tuple(other.shape)} {other.dtype}"
            raise CheckpointError(
                f"the model in {path} does not fit this model: {name} is {got} there and "
                f"{tuple(value.shape)} {value.dtype} here (were --model/--hidden/--depth/data changed?)"
            )
    module.load_state_dict(saved)


def _load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any], path: str) -> None:
    try:
        check_state_shapes(saved, [p for group in optimizer.param_groups for p in group["params"]])
    except ValueError as exc:
        raise CheckpointError(f"the optimizer state in {path} does not fit this model: {exc}") from None
    optimizer.load_state_dict(saved)


def _apply_settings(optimizer: torch.optim.Optimizer, settings: dict[str, Any]) -> None:
    """This run's hyper-parameters replace the checkpoint's (a changed --lr takes effect)."""
    for group in optimizer.param_groups:
        for name in files.HYPERPARAMETERS:
            if settings.get(name) is not None and name in group:
                group[name] = settings[name]


def load_checkpoint(out: str, strategy: Strategy, settings: dict[str, Any]) -> TrainerState:
    """Restores every rank from the newest committed checkpoint in `out`; returns the trainer's counters."""
    rank, slowmo = group_rank(), _is_slowmo(strategy)
    payload: Any = None
    if rank == 0:
        try:
            payload = _read_shared(out, settings)
        except CheckpointError as exc:
            payload = str(exc)
    payload = broadcast_object(payload, 0)
    if isinstance(payload, str):
        raise CheckpointError(payload)
    folder, manifest, shared, notes = payload
    name = os.path.basename(folder)
    error = None
    try:
        if slowmo and "replica" in shared:  # another world size: the mean of the saved replicas
            mine, where = shared["replica"], os.path.join(folder, "rank*.pt")
        elif slowmo:
            mine_folder = os.path.join(files.checkpoint_root(out), name)
            mine = files.load_verified(mine_folder, files.rank_file(rank), manifest)
            where = os.path.join(mine_folder, files.rank_file(rank))
        else:
            mine, where = shared, os.path.join(folder, files.SHARED)
        _load_model(strategy.module, mine["model"], where)
        if strategy.scaler is not None and mine["scaler"] is not None:
            strategy.scaler.load_state_dict(mine["scaler"])
        _load_optimizer(strategy.optimizer, mine["optimizer"], where)
    except CheckpointError as exc:
        error = str(exc)
    _agree(error)
    _apply_settings(strategy.optimizer, settings)
    if slowmo:  # SGP's gossip state and the slow-link state differ per node: each rank's own file carries them
        strategy.model.load_slowmo_state_dict(mine.get("slowmo") or shared["slowmo"])
    if rank == 0:
        print("ddpkit: " + "; ".join(notes), file=sys.stderr, flush=True)
    return TrainerState(**shared["trainer"])
