"""`WrappedOptimizer`: a torch `Optimizer` that is a view of another one (AdaScale's base), and the learning-rate
scaling AdaScale applies around the wrapped optimizer's step."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from torch.optim import Optimizer

__all__ = ["WrappedOptimizer", "scaled_learning_rates"]


class WrappedOptimizer(Optimizer):
    """Shares ``param_groups``, ``state`` and ``defaults`` with ``self._optimizer`` (set by the subclass before
    `_init_optimizer_base`) and falls back to it for any other attribute, so torch's LR schedulers, step hooks and
    code written for the wrapped optimizer accept the wrapper. Holds nothing of its own; communicates nothing."""

    _optimizer: Optimizer

    def _init_optimizer_base(self) -> None:
        """What torch.optim.Optimizer.__init__ sets up besides groups and state (hook registries, step profiling),
        so that torch's LR schedulers and step hooks accept this wrapper; groups and state are the wrapped one's."""
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()

    # -- what is shared with the wrapped optimizer ---------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's groups (the same list): LR schedulers write the base learning rate here."""
        return self._optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    @property
    def optimizer(self) -> Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    def __getattr__(self, name: str) -> Any:
        # Any other attribute of the wrapped optimizer (e.g. OSS's consolidate_state_dict, clip_grad_norm).
        wrapped = self.__dict__.get("_optimizer")
        if wrapped is None or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(wrapped, name)


@contextlib.contextmanager
def scaled_learning_rates(param_groups: list[dict[str, Any]], gains: list[float]) -> Iterator[None]:
    """Multiplies each group's ``lr`` by its gain inside the block and puts the original value back after it."""
    original = [group["lr"] for group in param_groups]
    for group, factor in zip(param_groups, gains, strict=True):
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(param_groups, original, strict=True):
            group["lr"] = lr
