"""What the framework integrations share: turning a user's optimizer into an `OSS` before the first step."""

from __future__ import annotations

import torch

from ddpkit.optim import OSS

__all__ = ["as_oss"]


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
