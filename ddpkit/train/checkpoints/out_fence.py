"""One writer of a fault-tolerant job's `--out` at a time, fenced by the round: a deposed writer's late write is
refused.

In a fault-tolerant job the member that writes (the first member of a committed round for checkpoints, the
chosen writer for the outputs) changes as ranks leave and join. A writer that stalls (a paused or overloaded
machine) may be replaced, then wake and finish a write it began long ago, over what its successor wrote. Every
write to `--out` therefore names its round (the epoch of the membership it wrote under) and goes through
`fenced`: under an exclusive lock on ``OUT/.ddpkit-round`` it reads the highest round written so far and refuses
a write from an earlier round (`StaleWriter`); a write from that round or a later one proceeds and records its
round. The lock (``fcntl.flock``) is released by the kernel however the writer ends.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

FENCE_FILE = ".ddpkit-round"


class StaleWriter(RuntimeError):
    """A write to `--out` from a round older than one already written there: its writer was deposed."""


def written_round(out: str) -> int:
    """The latest round recorded in `out`'s fence (-1 when none was)."""
    try:
        with open(os.path.join(out, FENCE_FILE)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return -1
    return int(text) if text else -1


@contextmanager
def fenced(out: str, round_: int, what: str) -> Iterator[None]:
    """Runs the body (a write of `what` to `out`) only if no later round wrote `out` already, then records
    `round_`. Writers of `out` wait for each other here.

    Args:
        out: the job's output folder (created if missing).
        round_: the round (membership epoch) the writer holds the right to write under.
        what: what is written, for the message ("the checkpoint of step 40").

    Raises:
        StaleWriter: `out` was written under a later round (nothing of this write is done).
    """
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, FENCE_FILE), "a+") as fence:
        fcntl.flock(fence, fcntl.LOCK_EX)
        fence.seek(0)
        text = fence.read().strip()
        held = int(text) if text else -1
        if round_ < held:
            raise StaleWriter(
                f"{what} was not written: --out {out} holds what round {held}'s writer wrote, and this rank "
                f"writes for round {round_} (it was replaced as the writer while it stalled)"
            )
        yield
        fence.seek(0)
        fence.truncate()
        fence.write(str(round_))
        fence.flush()
        os.fsync(fence.fileno())
