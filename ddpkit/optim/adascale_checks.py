"""AdaScale's argument checks: each raises a ValueError or TypeError that names the argument, before anything is
built or communicated."""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from ddpkit.distributed.env import ProcessGroup, group_size


class SingleWorkerError(ValueError, RuntimeError):
    """AdaScale on a single worker without gradient accumulation: there is no spread of gradients to measure.
    A RuntimeError, as fairscale raises (its users catch that), and a ValueError (a bad argument)."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_scale(scale: Any, where: str) -> None:
    if not is_real(scale) or scale < 1:
        raise ValueError(f"{where}: scale must be a finite number >= 1 (base batches per update), got {scale!r}")


def check_options(
    scale: float | None, smoothing: float | None, num_gradients_to_accumulate: int, is_scaled_loss: bool, debias: bool
) -> None:
    """Raises a ValueError/TypeError naming the argument, before anything is built or sent."""
    if scale is not None:
        check_scale(scale, "AdaScale")
    if smoothing is not None and (not is_real(smoothing) or not 0 <= smoothing < 1):
        raise ValueError(f"AdaScale: smoothing must be None or a number in [0, 1), got {smoothing!r}")
    if not is_int(num_gradients_to_accumulate) or num_gradients_to_accumulate < 1:
        raise ValueError(
            f"AdaScale: num_gradients_to_accumulate must be an int >= 1, got {num_gradients_to_accumulate!r}"
        )
    for name, value in (("is_scaled_loss", is_scaled_loss), ("debias_ewma", debias)):
        if not isinstance(value, bool):
            raise TypeError(f"AdaScale: {name} must be a bool, got {value!r}")


def resolve_world_size(world_size: int | None, group: ProcessGroup | None) -> int:
    """`world_size`, checked against the process group (None: the group's size, 1 without a process group)."""
    initialized = dist.is_available() and dist.is_initialized()
    actual = group_size(group) if initialized else 1
    if world_size is None:
        return actual
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"AdaScale: world_size must be None or an int >= 1, got {world_size!r}")
    if world_size not in (1, actual):
        where = f"the process group has {actual} ranks" if initialized else "no process group is initialised"
        raise ValueError(
            f"AdaScale: world_size={world_size} but {where}; pass None (the group's size), the group's size, or 1 "
            "for a purely local AdaScale"
        )
    return world_size
