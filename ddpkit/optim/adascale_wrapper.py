"""`AdaScaleWrapper`: `AdaScale` built from parameters, like a torch optimizer (e.g. as OSS's `optim` class)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from ddpkit.optim.adascale import AdaScale
from ddpkit.optim.adascale_checks import check_options

__all__ = ["AdaScaleWrapper"]


class AdaScaleWrapper(AdaScale):
    """`AdaScale` around ``optim_cls(params, **optim_args)``, built like a torch optimizer from parameters.

    So it can be passed where an optimizer class is expected, e.g. ``OSS(params, optim=AdaScaleWrapper, lr=0.1)``
    (see `AdaScale` for what that measures). Everything else is `AdaScale`'s.

    Args:
        params: the parameters or param groups, as for any torch optimizer.
        world_size: as `AdaScale`'s.
        scale: as `AdaScale`'s.
        smoothing: as `AdaScale`'s.
        num_gradients_to_accumulate: as `AdaScale`'s.
        debias_ewma: as `AdaScale`'s.
        optim_cls: the torch optimizer class built on `params` (default: SGD).
        is_scaled_loss: as `AdaScale`'s.
        **optim_args: that optimizer's own arguments (``lr``, ``momentum``, ...).

    Raises:
        TypeError: `optim_cls` is not a torch optimizer class.
        ValueError: as `AdaScale`'s.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        world_size: int | None = None,
        scale: float | None = None,
        smoothing: float | None = None,
        num_gradients_to_accumulate: int = 1,
        debias_ewma: bool = True,
        optim_cls: type[Optimizer] = torch.optim.SGD,
        is_scaled_loss: bool = True,
        **optim_args: Any,
    ) -> None:
        check_options(scale, smoothing, num_gradients_to_accumulate, is_scaled_loss, debias_ewma)
        if not (inspect.isclass(optim_cls) and issubclass(optim_cls, Optimizer)):
            raise TypeError(
                f"AdaScaleWrapper: optim_cls must be a torch.optim.Optimizer subclass (e.g. torch.optim.SGD), "
                f"got {optim_cls!r}"
            )
        super().__init__(
            optim_cls(params, **optim_args),
            world_size=world_size,
            scale=scale,
            smoothing=smoothing,
            num_gradients_to_accumulate=num_gradients_to_accumulate,
            is_scaled_loss=is_scaled_loss,
            debias_ewma=debias_ewma,
        )
