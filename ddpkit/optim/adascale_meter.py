"""Measuring micro-gradients for AdaScale: the squared norm of every gradient contribution, before it is averaged,
and a call at the end of every backward pass that produced one."""

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

    The first measured gradient of a backward pass queues `on_backward_end` to run when that backward is over:
    queued from inside the engine's own end-of-backward callbacks, so it runs after the callbacks that DDP's and
    ShardedDataParallel's hooks queued during the pass (their gradient reductions are complete by then).
    """

    def __init__(self, factor: Callable[[], float], on_backward_end: Callable[[], None]) -> None:
        self._factor = factor
        self._on_backward_end = on_backward_end
        self._end_queued = False
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
            first_of_backward = not self._end_queued
            self._end_queued = True
        if first_of_backward:
            _queue_callback(self._queue_end)

    def _queue_end(self) -> None:
        _queue_callback(self._backward_ended)  # behind every callback queued during the pass

    def _backward_ended(self) -> None:
        with self._lock:
            self._end_queued = False
        self._on_backward_end()

    @property
    def handles(self) -> list[Any]:
        """The handles of the hooks in place, one per watched parameter."""
        return list(self._handles)

    @property
    def watching(self) -> bool:
        """Whether some parameter is hooked."""
        return bool(self._handles)

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
            self._end_queued = False  # a backward that raised never ran its callbacks

    def close(self) -> None:
        """Removes every hook for good, and lets go of the callbacks (bound methods of the AdaScale that owns this
        meter: a reference cycle that kept the AdaScale, its optimizer and the parameters alive until a garbage
        collection)."""
        self._remove_hooks()
        self.clear()
        self._factor, self._on_backward_end = _one, _nothing
        self.closed = True

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._signature = None


def _one() -> float:
    return 1.0


def _nothing() -> None:
    return None


def _queue_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def square_norm(tensor: torch.Tensor) -> torch.Tensor:
    """``||tensor||^2`` as a float64 scalar on the tensor's device (summed in at least float32, no square root)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    return torch.dot(flat, flat).double()
