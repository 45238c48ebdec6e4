"""Heartbeats of a fault-tolerant job's ranks, so that a quorum stops waiting for a rank that is gone.

Each rank's `Heartbeat` thread adds one to its own counter in the job's store every `INTERVAL` seconds, on a
connection of its own. A rank waiting for others' arrival at a round reads the counters of those still missing
(`Liveness.gone`): a counter that has not moved for `stale_after` seconds of this rank's own clock (no clocks are
compared across machines) belongs to a rank that is dead, stopped or cut off, and the round goes on without it
instead of waiting its whole `quorum_timeout`.

On a store with leases (etcd: `ddpkit.fault_tolerance.etcd_store.EtcdStore`), the counter is a key attached to a
lease of `LEASE_SECONDS` that each beat renews: when the rank dies, stops or is cut off, the etcd cluster itself
deletes its key once the lease runs out, whatever the readers' clocks. A reader then counts a rank it expects (a
member of the previous round, or a joiner: both beat before they take part) whose key is absent as gone.

Sends: per rank every `INTERVAL` seconds one store addition (etcd: a lease renewal and a put); reads only while a
quorum waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ddpkit.fault_tolerance.clock import Clock, SystemClock
from ddpkit.fault_tolerance.job_secret import unsigned

INTERVAL = 0.25  # seconds between a rank's beats
STALE_AFTER = 2.0  # seconds without a beat after which a rank counts as gone (at most the quorum timeout)
LEASE_SECONDS = 5  # an etcd lease's time to live: a rank's key goes this long after its last renewal (several
# times the client's failover to another member, `etcd_store.REQUEST_SECONDS`, so that a silent member never
# makes a healthy rank's lease run out)


def alive_key(prefix: str, rank: int) -> str:
    """The store key of rank `rank`'s beat counter under the job's `prefix`."""
    return f"{prefix}alive/{rank}"


class Heartbeat:
    """This rank's beat (module doc), on `store` (give it a connection of its own: `store.clone()`). A store call
    that fails is passed to `on_error` (from the heartbeat's thread, once per run of failures) and the beat goes
    on trying: a store that comes back (a connection that broke, an etcd failover) sees this rank beat again,
    instead of counting it gone until it rejoins."""

    def __init__(
        self, store: Any, prefix: str, rank: int, on_error: Callable[[BaseException], None] | None = None
    ) -> None:
        self._stop = threading.Event()
        self._on_error = on_error
        self._thread = threading.Thread(
            target=self._beat, args=(store, alive_key(prefix, rank)), daemon=True, name="ddpkit-alive"
        )
        self._thread.start()

    def _beat(self, store: Any, key: str) -> None:
        store = unsigned(store)  # (beats are counters: not tagged, `ddpkit.fault_tolerance.job_secret`)
        leased = callable(getattr(store, "keep_alive", None))  # a store with leases (etcd)
        lease, beats, failing = None, 0, False
        while not self._stop.is_set():
            try:
                if leased:
                    if lease is None or not store.keep_alive(lease):  # (a lease that ran out: a new one)
                        lease = store.grant_lease(LEASE_SECONDS)
                    beats += 1
                    store.put_leased(key, str(beats), lease)
                else:
                    store.add(key, 1)
                failing = False
            except (RuntimeError, dist.DistError, OSError) as exc:
                if self._on_error is not None and not self._stop.is_set() and not failing:
                    self._on_error(exc)
                failing = True  # (the rank learns whether the store is gone from its next round)
            self._stop.wait(INTERVAL)

    def stop(self, wait: bool = False) -> None:
        """Stops beating; with `wait`, returns once the thread ended (at most a few seconds: a call to a store that
        went silent ends at its own timeout), so that nothing talks to the store after its owner closed."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=5.0)


class Liveness:
    """What this rank has seen of the others' beats (module doc).

    Args:
        prefix: the job's key prefix in the store.
        stale_after: seconds of this rank's clock without a change of a counter after which its rank is gone.
        clock: the clock those seconds are read from (default: the machine's; `ddpkit.fault_tolerance.clock`).
    """

    def __init__(self, prefix: str, stale_after: float = STALE_AFTER, clock: Clock | None = None) -> None:
        self.prefix, self.stale_after = prefix, stale_after
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (its counter, when this rank saw it change)

    def gone(self, store: Any, ranks: list[int]) -> bool:
        """Whether every one of `ranks` (ranks this round expects: they beat before taking part) is gone: its key
        is absent (its lease ran out) or its counter did not move for `stale_after` seconds (False while any of
        them beats, or was first seen less than `stale_after` ago)."""
        if not ranks:
            return False
        present = _beat_counters(store, self.prefix, ranks)
        if not present:
            return True
        now, stale = self.clock.monotonic(), True
        for rank, value in present.items():
            old = self._seen.get(rank)
            if old is None or old[0] != value:
                self._seen[rank] = (value, now)
                stale = False
            elif now - old[1] < self.stale_after:
                stale = False
        return stale


def _beat_counters(store: Any, prefix: str, ranks: list[int]) -> dict[int, bytes]:
    """The beat counters of those of `ranks` whose key exists, by rank. A leased key (etcd) may run out at any
    moment, between a look at it and a read of it too: there each key is read in one request that says whether it
    exists (`get_if_present`). Other stores' counters are never deleted: a look, then one read of those present."""
    keys, store = {rank: alive_key(prefix, rank) for rank in ranks}, unsigned(store)
    if callable(getattr(store, "get_if_present", None)):
        values = {rank: store.get_if_present(key) for rank, key in keys.items()}
        return {rank: value for rank, value in values.items() if value is not None}
    present = [rank for rank, key in keys.items() if store.check([key])]
    return dict(zip(present, store.multi_get([keys[r] for r in present]), strict=True)) if present else {}
