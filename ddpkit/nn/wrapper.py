"""What every ddpkit model wrapper shares: the wrapped model as `.module`, and its attributes reachable directly."""

from __future__ import annotations

from typing import Any

from torch import nn


class ModuleWrapper(nn.Module):
    """Base of the data-parallel wrappers: an attribute not found on the wrapper is looked up on `.module`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)
