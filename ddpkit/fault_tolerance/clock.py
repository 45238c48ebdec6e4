"""The time a fault-tolerant job's protocol reads: how long a quorum waits, when a timeout has passed.

`Membership` asks its clock, never `time` itself, so that the protocol can run on simulated time: a test gives it
a clock that moves only when every rank waits (tests/test_protocol_fake_clock.py), so schedules of pauses and
timeouts run in milliseconds and always the same way. A store's own waits (``store.wait(keys, timeout)``) keep
the store's clock; such a test's store waits on the same simulated time.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds that only go forward, and a way to let them pass."""

    def monotonic(self) -> float:
        """Seconds since an arbitrary start; never decreases."""
        ...

    def sleep(self, seconds: float) -> None:
        """Returns once `seconds` have passed on this clock."""
        ...


class SystemClock:
    """The machine's monotonic clock (`time.monotonic`, `time.sleep`): what a real job runs on."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
