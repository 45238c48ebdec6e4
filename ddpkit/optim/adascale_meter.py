"""Measuring micro-gradients for AdaScale: the squared norm of every gradient contribution, before it is averaged."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


class MicroGradientMeter:
    """Sums, per parameter group, the squared norms of the gradients that autograd produces for trainable parameters.

    A tensor hook on each parameter receives the gradient of one backward pass *before* it is accumulated into
    ``.grad``; DDP and ShardedDataParallel act after accumulation, so each value is one worker's gradient of one
    micro-batch, with or without ``no_sync()``. Each squared norm is multiplied by ``factor()`` (read at hook time)
    and added to its group's float64 total on the gradient's device. Nothing is communicated here.
    """

    def __init__(self, factor: Callable[[], float]) -> None:
        self._factor = factor
        self._totals: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()  # hooks of parameters on different devices may run on different threads
        self._handles: list[Any] = []
        self._signature: tuple[tuple[int, int], ...] | None = None
        self.closed = False

    def watch(self, param_groups: Sequence[dict[str, Any]]) -> None:
        """Hooks the parameters of `param_groups` that require grad (again only if that set or its groups changed)."""
        if self.closed:
            return
        trainable = [(i, p) for i, group in enumerate(param_groups) for p in group["params"] if p.requires_grad]
        signature = tuple((i, id(p)) for i, p in trainable)
        if signature == self._signature:
            return
        self._remove_hooks()
        self._handles = [p.register_hook(functools.partial(self._record, i)) for i, p in trainable]
        self._signature = signature

    def _record(self, group_index: int, grad: torch.Tensor) -> None:
        square = square_norm(grad)
        factor = self._factor()
        if factor != 1.0:
            square = square * factor
        with self._lock:
            total = self._totals.get(group_index)
            self._totals[group_index] = square if total is None else total + square.to(total.device)

    @property
    def pending(self) -> bool:
        """Whether some gradient was measured since the last `clear()`."""
        return bool(self._totals)

    def totals_into(self, out: torch.Tensor) -> None:
        """Adds each group's total to ``out[group index]``."""
        with self._lock:
            for i, total in self._totals.items():
                out[i] += total.to(out.device)

    def clear(self) -> None:
        with self._lock:
            self._totals.clear()

    def close(self) -> None:
        """Removes every hook for good."""
        self._remove_hooks()
        self.clear()
        self.closed = True

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._signature = None


def square_norm(tensor: torch.Tensor) -> torch.Tensor:
    """``||tensor||^2`` as a float64 scalar on the tensor's device (summed in at least float32, no square root)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    return torch.dot(flat, flat).double()
