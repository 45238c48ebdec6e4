"""Simulated time, a simulated store and simulated round groups for the fault-tolerant protocol's tests.

`VirtualTime` is a clock (`ddpkit.fault_tolerance.clock.Clock`) shared by threads: it moves only when every
thread taking part waits (sleeps, waits for a store key or for a group's members) and nothing new happened that a
waiting thread has not looked at yet; it then jumps to the earliest deadline among them. A schedule of pauses and
timeouts of many seconds runs in milliseconds of real time, and the outcome depends only on the schedule, never on
how loaded the machine is.

`SimStore` is torch's Store API on a dict, its waits on that clock; a machine's connections can be cut off (every
call raises the error a broken TCPStore connection raises), or the store lost for all. `SimGroup` stands for a
round's gloo group: a mean over its members that waits for all of them, and fails (a RuntimeError) once the round's
timeout passed without them, as gloo's collectives do when a member is gone.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

STUCK_SECONDS = 20.0  # real seconds without any progress: every thread waits forever (a bug in a test or the code)


class Stuck(RuntimeError):
    """Every thread waits without a deadline and nothing can change any more."""


class VirtualTime:
    """Seconds that pass only while every thread taking part waits (module doc). Start the threads with `start`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Condition(threading.RLock())
        self._active = 0  # threads taking part that are not waiting
        self._generation = 0  # bumped by every change a waiting thread may need to see (a key, the time)
        self._waiting: dict[int, tuple[float, int]] = {}  # thread -> (its deadline, the generation it looked at)
        self.errors: list[BaseException] = []  # what the threads started here raised

    def monotonic(self) -> float:
        with self.lock:
            return self.now

    def sleep(self, seconds: float) -> None:
        self.wait_until(lambda: False, self.monotonic() + seconds)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Time stands still inside (the caller counts as a thread at work): start every thread of a scene in it,
        so that none runs ahead before the others exist."""
        with self.lock:
            self._active += 1
        try:
            yield
        finally:
            with self.lock:
                self._active -= 1
                self.changed()

    def start(self, target: Callable[..., Any], *args: Any) -> threading.Thread:
        """Runs `target(*args)` in a new thread taking part in this time."""
        with self.lock:
            self._active += 1

        def run() -> None:
            try:
                target(*args)
            except BaseException as exc:
                self.errors.append(exc)
                raise
            finally:
                with self.lock:
                    self._active -= 1
                    self.changed()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def changed(self) -> None:
        """Something a waiting thread may be waiting for happened (call with the lock held)."""
        self._generation += 1
        self.lock.notify_all()

    def wait_until(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Waits until `ready()` (checked with the lock held) or the time reaches `deadline`; returns `ready()`."""
        me = threading.get_ident()
        with self.lock:
            self._active -= 1
            try:
                while True:
                    if ready():
                        return True
                    if self.now >= deadline:
                        return False
                    self._waiting[me] = (deadline, self._generation)
                    if self._active == 0 and all(seen == self._generation for _, seen in self._waiting.values()):
                        earliest = min(d for d, _ in self._waiting.values())
                        if math.isinf(earliest):
                            raise Stuck("every thread waits without a deadline")
                        self.now = max(self.now, earliest)
                        self.changed()
                        continue
                    if not self.lock.wait(STUCK_SECONDS):
                        raise Stuck(f"no progress for {STUCK_SECONDS:g} real seconds at t={self.now:g}")
            finally:
                self._waiting.pop(me, None)
                self._active += 1


class SimStore(dist.Store):
    """torch's Store API on a dict shared by every connection (`clone`), waiting on `time` (module doc)."""

    def __init__(
        self,
        time: VirtualTime,
        data: dict[str, bytes] | None = None,
        shared: dict | None = None,
        machine: dict | None = None,
    ) -> None:
        super().__init__()
        self.time = time
        self.data = data if data is not None else {}
        self.shared = shared if shared is not None else {"lost": False}
        self.machine = machine if machine is not None else {"cut": False}  # its machine is cut off from the store

    def on_another_machine(self) -> SimStore:
        """A connection from another machine (one that `cut` can cut off alone, with its clones)."""
        return SimStore(self.time, self.data, self.shared)

    def cut(self) -> None:
        """This connection's machine loses the store for good (every connection it made, and makes)."""
        with self.time.lock:
            self.machine["cut"] = True
            self.time.changed()

    def _check(self) -> None:
        if self.shared["lost"] or self.machine["cut"]:
            raise dist.DistNetworkError("Connection reset by peer (the store's machine is gone)")

    def _change(self, key: str, value: bytes) -> None:
        self.data[key] = value
        self.time.changed()

    def set(self, key: str, value: Any) -> None:
        with self.time.lock:
            self._check()
            self._change(key, _bytes(value))

    def get(self, key: str) -> bytes:
        if not self.wait_for([key], None):
            raise dist.DistStoreError(f"wait timeout for key {key}")
        with self.time.lock:
            return self.data[key]

    def add(self, key: str, value: int) -> int:
        with self.time.lock:
            self._check()
            total = int(self.data.get(key, b"0")) + value
            self._change(key, str(total).encode())
        after = self.machine.get("after_add", {}).pop(key, None)  # (a test's fault right after this addition)
        if after is not None:
            after()
        return total

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        with self.time.lock:
            self._check()
            current = self.data.get(key)
            if (current is None and _bytes(expected) == b"") or current == _bytes(expected):
                self._change(key, _bytes(desired))
                return _bytes(desired)
            return current if current is not None else _bytes(expected)

    def check(self, keys: list[str]) -> bool:
        with self.time.lock:
            self._check()
            return all(k in self.data for k in keys)

    def wait_for(self, keys: list[str], timeout: timedelta | None) -> bool:
        """Whether every key of `keys` exists within `timeout` of simulated time (None: without end)."""
        seconds = math.inf if timeout is None else timeout.total_seconds()

        def ready() -> bool:
            self._check()
            return all(k in self.data for k in keys)

        return self.time.wait_until(ready, self.time.monotonic() + seconds)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if not self.wait_for(keys, timeout):
            raise dist.DistStoreError(f"wait timeout for keys {keys}")

    def delete_key(self, key: str) -> bool:
        with self.time.lock:
            self._check()
            return self.data.pop(key, None) is not None

    def append(self, key: str, value: Any) -> None:
        with self.time.lock:
            self._check()
            self._change(key, self.data.get(key, b"") + _bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def num_keys(self) -> int:
        with self.time.lock:
            self._check()
            return len(self.data)

    def clone(self) -> SimStore:
        """A new connection to the same store (a cut connection's clone is cut too: its machine is cut off)."""
        self._check()
        return SimStore(self.time, self.data, self.shared, self.machine)


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class SimGroup:
    """A round's group of `size` members as seen by member `index` (module doc): it meets the others under `key`
    in `hub` (one dict per test), each collective numbered in call order."""

    def __init__(
        self,
        hub: dict,
        key: str,
        index: int,
        size: int,
        time: VirtualTime,
        timeout: float,
        members: list[int] | None = None,
    ) -> None:
        self.hub, self.key, self.index, self.size, self.time, self.timeout = hub, key, index, size, time, timeout
        self.members = members  # the members' global ranks: a partition (`hub["cut"]`) separates them
        self.calls = 0
        self._meet("connect", None)  # as gloo's constructor: every member connects, or it fails at the timeout

    def mean(self, value: float | None) -> float:
        """The mean of the members' values (None: this member does not count); a RuntimeError if a member did not
        take part within the timeout, or if nobody counts."""
        self.calls += 1
        values = self._meet(f"mean{self.calls}", value)
        counted = [v for v in values if v is not None]
        if not counted:
            raise RuntimeError("no member holds live state")
        return sum(counted) / len(counted)

    def broadcast(self, value: float | None) -> float:
        """Member 0's value, on every member (a RuntimeError as `mean`'s)."""
        self.calls += 1
        return self._meet(f"broadcast{self.calls}", value)[0]

    def _separated(self) -> bool:
        """Whether a member of the group is cut off from the others' data plane (`hub["cut"]`: ranks whose network
        reaches the store but no peer)."""
        cut = self.hub.get("cut", set())
        return self.members is not None and len(self.members) > 1 and bool(cut & set(self.members))

    def _meet(self, what: str, value: Any) -> list[Any]:
        if self._separated():  # nobody on the other side answers: the collective fails at its timeout
            self.time.sleep(self.timeout)
            raise RuntimeError(f"{self.key} {what}: a member cut off from its peers did not answer")
        with self.time.lock:
            slot = self.hub.setdefault((self.key, what), {})
            slot[self.index] = value
            self.time.changed()
            if not self.time.wait_until(lambda: len(slot) == self.size, self.time.now + self.timeout):
                raise RuntimeError(f"{self.key} {what}: a member did not take part within {self.timeout:g} s")
            return [slot[i] for i in range(self.size)]


class SimReach:
    """`ddpkit.fault_tolerance.reachability.Reachability` on simulated time: the ranks in `hub["cut"]` reach the
    store and no peer (probes answer at once)."""

    def __init__(self, hub: dict, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def unreached(self, store: Any, ranks: list[int]) -> list[int]:
        cut = self.hub.get("cut", set())
        others = [r for r in ranks if r != self.rank]
        return others if self.rank in cut else [r for r in others if r in cut]
