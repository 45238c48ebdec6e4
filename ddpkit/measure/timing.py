"""Timing training steps: per-step wall clock after a warm-up, per-phase laps, medians, rounds and ratios.

`ddpkit bench` and the scripts under ``benchmarks/`` time steps with these functions, so a figure printed by one
means the same as the figure printed by the other: the median of the timed steps' wall clock (the warm-up steps
not counted), the maximum over ranks, and ratios against a baseline measured the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def timed_steps(
    step: Callable[[], T], steps: int, warmup: int = 0, sync: Callable[[], None] | None = None
) -> tuple[list[float], list[T]]:
    """Calls `step` ``warmup + steps`` times; returns the last `steps` calls' seconds and return values.

    `sync` (e.g. a barrier, so every rank starts the step together) runs before each call and is not timed.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"timed_steps: steps must be >= 1 and warmup >= 0; got steps={steps}, warmup={warmup}")
    seconds: list[float] = []
    values: list[T] = []
    for i in range(warmup + steps):
        if sync is not None:
            sync()
        start = time.perf_counter()
        value = step()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            seconds.append(elapsed)
            values.append(value)
    return seconds, values


@dataclass
class PhaseTimer:
    """Seconds per named phase of each step: ``start()``, then ``lap(name)`` at the end of each phase.

    ``lap`` records the time since the previous lap (or the start); ``stop()`` records the whole step as "step".
    """

    phases: dict[str, list[float]] = field(default_factory=dict)
    _start: float = 0.0
    _last: float = 0.0

    def start(self) -> None:
        self._start = self._last = time.perf_counter()

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self.add(name, seconds)
        return seconds

    def stop(self) -> float:
        seconds = time.perf_counter() - self._start
        self.add("step", seconds)
        return seconds

    def add(self, name: str, seconds: float) -> None:
        self.phases.setdefault(name, []).append(seconds)

    def clear(self) -> None:
        """Forgets every recorded step (call it when the warm-up is over)."""
        self.phases.clear()

    def medians_ms(self) -> dict[str, float]:
        return {name: statistics.median(values) * 1e3 for name, values in self.phases.items()}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds in `optimizer.state` (for a sharded optimizer, pass its local ``optim``; a DTensor,
    as FSDP2's state is, counts its local shard)."""
    local = [getattr(v, "to_local", lambda v=v: v)() for s in optimizer.state.values() for v in s.values()]
    return sum(value.numel() * value.element_size() for value in local if torch.is_tensor(value))


def interleaved(keys: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, key) for every key in every round, round-robin: a slow spell of the machine hits every key alike."""
    if rounds < 1:
        raise ValueError(f"interleaved: rounds must be >= 1; got {rounds}")
    for r in range(rounds):
        for key in keys:
            yield r, key


@dataclass(frozen=True)
class RoundSummary:
    """One figure measured in several rounds: the best (lowest), the median and every round's value."""

    best: float
    median: float
    rounds: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> RoundSummary:
        if not values:
            raise ValueError("RoundSummary.of: no values")
        return cls(min(values), statistics.median(values), tuple(values))

    def as_dict(self) -> dict[str, Any]:
        return {"best": self.best, "median": self.median, "rounds": list(self.rounds)}


def window_means(seconds: Sequence[float], window: int) -> list[float]:
    """The mean of each run of `window` consecutive steps (a trailing shorter run is dropped): a strategy whose
    steps differ periodically (SlowMo averages every few steps) gets windows that each hold one period."""
    if window < 1:
        raise ValueError(f"window_means: window must be >= 1; got {window}")
    whole = len(seconds) - len(seconds) % window
    return [statistics.fmean(seconds[i : i + window]) for i in range(0, whole, window)]


def step_time(windows: Sequence[float]) -> float:
    """THE step time of `ddpkit bench` (table, plot, prediction, recommendation alike): the median of the window
    means, robust to a slow spell of the machine while periodic steps count in proportion."""
    if not windows:
        raise ValueError("step_time: no windows")
    return statistics.median(windows)


def relative_spread(windows: Sequence[float]) -> float:
    """How much the window means scatter: half their interquartile range over their median (0 for one window)."""
    if len(windows) < 2:
        return 0.0
    low, _, high = statistics.quantiles(windows, n=4, method="inclusive")
    return (high - low) / 2 / statistics.median(windows)


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``, or None where either is missing or the base is 0."""
    if value is None or base is None or base == 0:
        return None
    return value / base
