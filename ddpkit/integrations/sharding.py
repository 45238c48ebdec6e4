"""What the framework integrations share: a user's optimizer made an `OSS` before its first step, and torch's
GradScaler made a `ShardedGradScaler` (so that a skip is agreed by every rank)."""

from __future__ import annotations

import torch

from ddpkit.optim import OSS, ShardedGradScaler

__all__ = ["as_oss", "sharded_scaler_like"]


def as_oss(optimizer: torch.optim.Optimizer) -> OSS:
    """`optimizer` as an OSS of its own class over the very same param-group dicts (so a learning-rate
    scheduler built on `optimizer` keeps changing the OSS's hyper-parameters); an OSS is returned as it is.
    Raises a TypeError for an optimizer that already holds state (its state would be lost)."""
    if isinstance(optimizer, OSS):
        return optimizer
    if optimizer.state:
        raise TypeError(
            f"ddpkit's integrations shard the optimizer before its first step; "
            f"this {type(optimizer).__name__} already holds state. Give a fresh optimizer (or a ddpkit OSS)"
        )
    return OSS(optimizer.param_groups, optim=type(optimizer), **optimizer.defaults)


def sharded_scaler_like(scaler: torch.amp.GradScaler, device: str) -> ShardedGradScaler:
    """A ShardedGradScaler on `device` with `scaler`'s current scale and settings (a ShardedGradScaler as it is)."""
    if isinstance(scaler, ShardedGradScaler):
        return scaler
    return ShardedGradScaler(
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
        device=device,
    )
