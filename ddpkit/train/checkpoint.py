"""Checkpoints that let `ddpkit train --resume` continue exactly where a run stopped.

Layout of ``OUT/checkpoint/``: ``rank{r}.pt`` per rank (its model replica, its scaler and, for SlowMo, its
optimizer state: SlowMo lets replicas and optimizer states differ between nodes), ``shared.pt`` written by rank 0
(the whole optimizer state in torch's format, consolidated when sharded, for every other strategy; SlowMo's slow
buffers and counters; the trainer's counters and history) and ``meta.json`` written last. On resume rank 0 reads
``shared.pt`` and sends it to the others, so only the per-rank files need to be on every machine.
Saving and loading are collectives: every rank calls them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from ddpkit.distributed import comm
from ddpkit.distributed.env import group_rank, group_size
from ddpkit.distributed.objects import broadcast_object
from ddpkit.nn import SlowMoDistributedDataParallel
from ddpkit.optim import OSS
from ddpkit.train.strategies import Strategy
from ddpkit.train.trainer import TrainerState


def checkpoint_dir(out: str) -> str:
    return os.path.join(out, "checkpoint")


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


def _per_rank_optimizer(strategy: Strategy) -> bool:
    """SlowMo nodes step their own optimizers on their own gradients, so the optimizer states differ per node."""
    return isinstance(strategy.model, SlowMoDistributedDataParallel)


def _save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(out: str, strategy: Strategy, state: TrainerState) -> None:
    """Writes the checkpoint of every rank (a collective)."""
    folder = checkpoint_dir(out)
    os.makedirs(folder, exist_ok=True)
    rank = group_rank()
    per_rank = _per_rank_optimizer(strategy)
    mine: dict[str, Any] = {"model": strategy.module.state_dict()}
    mine["scaler"] = strategy.scaler.state_dict() if strategy.scaler is not None else None
    mine["optimizer"] = strategy.optimizer.state_dict() if per_rank else None
    optimizer_state = None if per_rank else _optimizer_state(strategy.optimizer)
    slowmo = strategy.model.slowmo_state_dict() if isinstance(strategy.model, SlowMoDistributedDataParallel) else None
    mine["slowmo"] = slowmo if slowmo is not None and "sgp_buffer" in slowmo else None  # SGP's differs per node
    _save(mine, os.path.join(folder, f"rank{rank}.pt"))
    if rank == 0:
        shared = {"optimizer": optimizer_state, "slowmo": slowmo, "trainer": dataclasses.asdict(state)}
        _save(shared, os.path.join(folder, "shared.pt"))
    comm.barrier()
    if rank == 0:
        meta = {"epoch": state.epoch, "step": state.step, "world_size": group_size(), "strategy": strategy.name}
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump(meta, f)


def read_meta(out: str) -> dict[str, Any]:
    with open(os.path.join(checkpoint_dir(out), "meta.json")) as f:
        return json.load(f)


def load_checkpoint(out: str, strategy: Strategy) -> TrainerState:
    """Restores every rank from the checkpoint in `out` and returns the trainer's counters (a collective)."""
    folder = checkpoint_dir(out)
    rank = group_rank()
    shared = torch.load(os.path.join(folder, "shared.pt"), weights_only=False) if rank == 0 else None
    shared = broadcast_object(shared, 0)
    mine = torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=False)
    strategy.module.load_state_dict(mine["model"])
    if strategy.scaler is not None and mine["scaler"] is not None:
        strategy.scaler.load_state_dict(mine["scaler"])
    per_rank = _per_rank_optimizer(strategy)
    strategy.optimizer.load_state_dict(mine["optimizer"] if per_rank else shared["optimizer"])
    if isinstance(strategy.model, SlowMoDistributedDataParallel):
        strategy.model.load_slowmo_state_dict(mine.get("slowmo") or shared["slowmo"])
    return TrainerState(**shared["trainer"])
