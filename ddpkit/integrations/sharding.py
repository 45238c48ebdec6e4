"""What the framework integrations share: a user's optimizer made an `OSS` before its first step, and torch's
GradScaler made a `ShardedGradScaler` (so that a skip is agreed by every rank)."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from typing import Any

import torch

from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS, ShardedGradScaler

__all__ = [
    "OSS_OPTIONS",
    "SDP_OPTIONS",
    "as_oss",
    "check_oss_kwargs",
    "refuse_unknown_kwargs",
    "sharded_scaler_like",
    "take_sdp_kwargs",
]


OSS_OPTIONS = frozenset(inspect.signature(OSS.__init__).parameters) - {"self", "params", "optim", "defaults"}
"""OSS's own arguments (``split_params``, ``min_split_numel``, ``broadcast_fp16``, ...), which an integration's
`oss_kwargs` may set."""


SDP_OPTIONS = frozenset(inspect.signature(ShardedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "sharded_optimizer",
    "process_group",
}
"""ShardedDataParallel's own arguments (``reduce_buffer_size``, ``keep_bucketed_grads``, ...)."""


def take_sdp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Removes ShardedDataParallel's own arguments from `kwargs` (a strategy's keyword arguments) and returns them.

    Args:
        kwargs: a strategy's keyword arguments (ShardedDataParallel's are taken out of it).
    """
    return {key: kwargs.pop(key) for key in sorted(SDP_OPTIONS) if key in kwargs}


def refuse_unknown_kwargs(kwargs: dict[str, Any], accepted: Iterable[str], where: str, own: Iterable[str]) -> None:
    """A TypeError naming the first key of `kwargs` (what is left of a strategy's keyword arguments) that is not in
    `accepted` (its base class's own arguments), with the closest known name: a misspelt option (``reduce_bufer_size``)
    or one of torch DDP's that ddpkit's wrapper does not take (``bucket_cap_mb``) would otherwise be dropped.

    Args:
        kwargs: what is left of a strategy's keyword arguments.
        accepted: the arguments its base class takes.
        where: the name the message starts with.
        own: the wrapper's own arguments (for the closest name).
    """
    unknown = sorted(set(kwargs) - set(accepted))
    if not unknown:
        return
    known = sorted(set(accepted) | set(own))
    close = difflib.get_close_matches(unknown[0], known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TypeError(
        f"{where}: unexpected keyword argument {unknown[0]!r}{hint}; the wrapper's own are {', '.join(sorted(own))}"
    )


def check_oss_kwargs(oss_kwargs: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """`oss_kwargs` as a dict, or a TypeError naming the first key that is not one of OSS's own arguments.

    Args:
        oss_kwargs: OSS's own arguments, or None.
        where: the name the message starts with.
    """
    oss_kwargs = dict(oss_kwargs or {})
    unknown = sorted(set(oss_kwargs) - OSS_OPTIONS)
    if unknown:
        raise TypeError(
            f"{where}: oss_kwargs takes OSS's own arguments ({', '.join(sorted(OSS_OPTIONS))}), got {unknown[0]!r}; "
            "the optimizer's hyper-parameters come from the optimizer you give"
        )
    return oss_kwargs


def as_oss(optimizer: torch.optim.Optimizer, **oss_kwargs: Any) -> OSS:
    """`optimizer` as an OSS of its own class over the very same param-group dicts (so a learning-rate
    scheduler built on `optimizer` keeps changing the OSS's hyper-parameters), built with `oss_kwargs` (OSS's own
    arguments, e.g. ``min_split_numel``); an OSS is returned as it is. Raises a TypeError for an optimizer that
    already holds state (its state would be lost).

    Args:
        optimizer: a torch optimizer without state yet (or an OSS).
        **oss_kwargs: OSS's own arguments.
    """
    if isinstance(optimizer, OSS):
        if oss_kwargs:
            raise TypeError(
                f"oss_kwargs ({', '.join(sorted(oss_kwargs))}) cannot apply to an optimizer that is already an OSS; "
                "give those arguments to the OSS you build, or return a plain torch optimizer"
            )
        return optimizer
    if optimizer.state:
        raise TypeError(
            f"ddpkit's integrations shard the optimizer before its first step; "
            f"this {type(optimizer).__name__} already holds state. Give a fresh optimizer (or a ddpkit OSS)"
        )
    return OSS(optimizer.param_groups, optim=type(optimizer), **oss_kwargs, **optimizer.defaults)


def sharded_scaler_like(scaler: torch.amp.GradScaler, device: str) -> ShardedGradScaler:
    """A ShardedGradScaler on `device` with `scaler`'s current scale and settings (a ShardedGradScaler as it is).

    Args:
        scaler: torch's GradScaler (or a ShardedGradScaler, returned as it is).
        device: the device type of the new scaler ("cpu" or "cuda").
    """
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
