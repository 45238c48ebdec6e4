"""`CommStats`: an exact, cheap count of what ddpkit's collectives send.

Every collective that ddpkit issues goes through `ddpkit.distributed.comm`, which records it here: one entry
per (collective kind, process group) with the number of calls, the payload bytes (the size of the tensor this
rank handed to the collective) and the bytes this rank sends on the wire under the bandwidth-optimal
algorithm for that collective:

=============== ====================================== ==================================
kind            payload ``B`` (this rank's tensor)     bytes sent by one rank, N ranks
=============== ====================================== ==================================
all_reduce      the tensor                             ``2 (N-1)/N B`` (ring)
reduce          the tensor                             on gloo (ddpkit sends point to point): ``B`` on
                                                       non-roots, 0 on the root, exactly; on other backends
                                                       ``(N-1)/N B`` (reduce-scatter + gather)
broadcast       the tensor                             ``(N-1)/N B`` (scatter + all-gather)
all_gather      this rank's input                      ``(N-1) B``
reduce_scatter  this rank's full input                 ``(N-1)/N B``
all_to_all      this rank's full input (every part)    ``(N-1)/N B`` with equal parts; what is addressed to
                                                       other ranks exactly, as the compressed mean records it
gather          this rank's input                      ``B`` on non-roots, 0 on the root
barrier         nothing                                0
shared_memory   a copy out of another rank's segment   0 (same host, no wire; see shared_memory.py)
cpu_staging     a copy of a CUDA tensor to or from     0 (gloo only; see comm.py)
                host memory
send            a point-to-point message (gossip)      ``B``, recorded as such by p2p.py
recv            a point-to-point message received      0, recorded as such by p2p.py
=============== ====================================== ==================================

Summed over the ranks, a reduce to the owner plus a broadcast from the owner sends exactly what one all-reduce of
the same tensor sends, 2 (N-1) B, which is how ShardedDataParallel + OSS is compared against DDP. On gloo the
all-reduce, broadcast and ddpkit's point-to-point reduce put these totals on the wire, TCP headers aside
(`tests/test_wire_bytes.py` holds them to the interfaces' counters; `benchmarks/` measures a real link too).
Recording is a few Python additions under a lock (backward hooks may run on autograd worker threads); nothing is
synchronised with other ranks, so each rank reads its own numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ddpkit.distributed import ledger


@dataclass
class CollectiveCount:
    """Totals for one (kind, group) pair.

    Attributes:
        calls: the collectives counted.
        payload_bytes: the bytes of their tensors.
        sent_bytes: the bytes they put on the wire from this rank (modelled per algorithm: `wire_bytes`).
    """

    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0

    def add(self, other: CollectiveCount) -> None:
        self.calls += other.calls
        self.payload_bytes += other.payload_bytes
        self.sent_bytes += other.sent_bytes


def wire_bytes(kind: str, payload_bytes: int, world_size: int, is_root: bool = False) -> float:
    """Bytes one rank sends for a collective of `kind` under the bandwidth-optimal algorithm (see module doc)."""
    n = world_size
    if n <= 1 or kind in ("barrier", "shared_memory", "cpu_staging"):
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * payload_bytes
    if kind in ("reduce", "broadcast", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * payload_bytes
    if kind == "all_gather":
        return float((n - 1) * payload_bytes)
    if kind == "gather":
        return 0.0 if is_root else float(payload_bytes)
    raise ValueError(f"wire_bytes: unknown collective kind {kind!r}")


class CommStats:
    """Counts calls, payload bytes and modelled wire bytes per collective kind and process group.

    Use the process-wide instance `ddpkit.distributed.comm_stats`::

        comm_stats.reset()
        train_one_step()
        print(comm_stats.total().sent_bytes, comm_stats.calls("reduce"))

    `measure()` gives the difference over a block without resetting what others count.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], CollectiveCount] = {}

    def record(self, kind: str, group: str, payload_bytes: int, sent_bytes: float) -> None:
        """Adds one call of `kind` on `group` (a label such as ``"world"`` or ``"ranks[0,1]"``); the collective
        is also this rank's latest in `ddpkit.distributed.ledger` (host copies are not collectives)."""
        if kind != "cpu_staging":
            ledger.note(kind, group, payload_bytes)
        with self._lock:
            count = self._counts.setdefault((kind, group), CollectiveCount())
            count.calls += 1
            count.payload_bytes += payload_bytes
            count.sent_bytes += sent_bytes

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    def snapshot(self) -> dict[tuple[str, str], CollectiveCount]:
        """A copy of the counts, keyed by (kind, group label)."""
        with self._lock:
            return {key: CollectiveCount(c.calls, c.payload_bytes, c.sent_bytes) for key, c in self._counts.items()}

    def total(self, kind: str | None = None, group: str | None = None) -> CollectiveCount:
        """Sum over the entries matching `kind` and `group` (None matches all)."""
        out = CollectiveCount()
        for (k, g), count in self.snapshot().items():
            if (kind is None or k == kind) and (group is None or g == group):
                out.add(count)
        return out

    def calls(self, kind: str | None = None, group: str | None = None) -> int:
        return self.total(kind, group).calls

    def sent_bytes(self, kind: str | None = None, group: str | None = None) -> float:
        return self.total(kind, group).sent_bytes

    def payload_bytes(self, kind: str | None = None, group: str | None = None) -> int:
        return self.total(kind, group).payload_bytes

    @contextmanager
    def measure(self) -> Iterator[CommStats]:
        """Yields a fresh `CommStats` that, when the block ends, holds what was recorded inside it."""
        before = self.snapshot()
        delta = CommStats()
        try:
            yield delta
        finally:
            for key, count in self.snapshot().items():
                old = before.get(key, CollectiveCount())
                diff = CollectiveCount(
                    count.calls - old.calls, count.payload_bytes - old.payload_bytes, count.sent_bytes - old.sent_bytes
                )
                if diff.calls:
                    delta._counts[key] = diff

    def table(self) -> str:
        """A printable table of the counts."""
        rows = [f"{'kind':<15}{'group':<18}{'calls':>8}{'payload MB':>13}{'sent MB':>11}"]
        for (kind, group), c in sorted(self.snapshot().items()):
            rows.append(f"{kind:<15}{group:<18}{c.calls:>8}{c.payload_bytes / 1e6:>13.3f}{c.sent_bytes / 1e6:>11.3f}")
        return "\n".join(rows)


comm_stats = CommStats()
"""The process-wide counter that every ddpkit collective records into."""
