"""One writer of a fault-tolerant job's `--out` at a time, fenced by the round: a deposed writer's late write is
refused, and a writer that stalls holds nobody up.

In a fault-tolerant job the member that writes (the first member of a committed round for checkpoints, the
chosen writer for the outputs) changes as ranks leave and join. A writer that stalls (a paused or overloaded
machine) may be replaced, then wake and finish a write it began long ago, over what its successor wrote. Every
write to `--out` therefore names its round (the epoch of the membership it wrote under) and goes through
`fenced`, in two parts:

1. **Stage**: the writer writes into a staging folder of its own inside `--out` (``.ddpkit-stage-*``), with no
   lock held: a writer stopped here costs nobody anything, and its successor writes past it.
2. **Publish**: under an exclusive lock on ``OUT/.ddpkit-round`` (held for a read, a few renames and a write) it
   reads the highest round written so far and refuses a write from an earlier round (`StaleWriter`: the staging
   folder is removed and nothing in `--out` changes); otherwise it renames what it staged into place and records
   the larger of the two rounds, so the record never moves backwards.

The lock (``fcntl.flock``) is released by the kernel however the writer ends; a writer that cannot take it within
`LOCK_SECONDS` (another writer stopped in the middle of its renames) raises `FenceBusy` instead of waiting forever.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

FENCE_FILE = ".ddpkit-round"
STAGE_PREFIX = ".ddpkit-stage-"
LOCK_SECONDS = 30.0  # the longest a writer waits for another's publish (a few renames) before it gives up
LOCK_POLL = 0.01


class StaleWriter(RuntimeError):
    """A write to `--out` from a round older than one already written there: its writer was deposed."""


class FenceBusy(RuntimeError):
    """The fence of `--out` stayed locked for `LOCK_SECONDS` (another writer stopped while publishing)."""


def written_round(out: str) -> int:
    """The latest round recorded in `out`'s fence (-1 when none was)."""
    try:
        with open(os.path.join(out, FENCE_FILE)) as f:
            return _parse(f.read())
    except FileNotFoundError:
        return -1


def _parse(text: str) -> int:
    return int(text.strip()) if text.strip() else -1


def _refuse_if_stale(out: str, held: int, round_: int, what: str) -> None:
    if round_ < held:
        raise StaleWriter(
            f"{what} was not written: --out {out} holds what round {held}'s writer wrote, and this rank "
            f"writes for round {round_} (it was replaced as the writer while it stalled)"
        )


@contextmanager
def fenced(out: str, round_: int, what: str) -> Iterator[str]:
    """Yields a staging folder for the body to write `what` into (laid out as `out` is); once the body is done,
    publishes it into `out` unless a later round wrote `out` already (module doc), and records the round.

    Args:
        out: the job's output folder (created if missing).
        round_: the round (membership epoch) the writer holds the right to write under.
        what: what is written, for the message ("the checkpoint of step 40").

    Yields:
        The staging folder (removed afterwards, whatever happens).

    Raises:
        StaleWriter: `out` was written under a later round, before or while the body ran (nothing is published).
        FenceBusy: the fence stayed locked for `LOCK_SECONDS`.
    """
    os.makedirs(out, exist_ok=True)
    _refuse_if_stale(out, written_round(out), round_, what)  # (early: a deposed writer stages nothing)
    stage = tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=out)
    try:
        yield stage
        with open(os.path.join(out, FENCE_FILE), "a+") as fence:
            _lock(fence, out)
            fence.seek(0)
            held = _parse(fence.read())
            _refuse_if_stale(out, held, round_, what)
            _publish(stage, out)
            fence.seek(0)
            fence.truncate()
            fence.write(str(max(held, round_)))
            fence.flush()
            os.fsync(fence.fileno())
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _lock(fence: IO[str], out: str) -> None:
    """Takes the fence's exclusive lock, waiting at most `LOCK_SECONDS`."""
    deadline = time.monotonic() + LOCK_SECONDS
    while True:
        try:
            fcntl.flock(fence, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise FenceBusy(
                    f"the fence {os.path.join(out, FENCE_FILE)} stayed locked for {LOCK_SECONDS:g} s: another "
                    "writer of --out stopped while publishing; end it (or remove nothing: the kernel frees the "
                    "lock when that process ends) and write again"
                ) from None
            time.sleep(LOCK_POLL)


def _publish(stage: str, out: str) -> None:
    """Moves everything under `stage` to the same place under `out`: a folder `out` lacks is renamed whole (one
    atomic step), a file replaces its namesake; the folders touched are synced."""
    for name in sorted(os.listdir(stage)):
        source, target = os.path.join(stage, name), os.path.join(out, name)
        if os.path.isdir(source) and os.path.isdir(target):
            _publish(source, target)
        else:
            os.replace(source, target)
    descriptor = os.open(out, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
