"""One job per `--out` folder: each rank holds an exclusive lock on its own lock file there while it runs.

Two jobs given the same `--out` used to run side by side, one deleting or overwriting the other's checkpoints
while both exited 0. Rank r of a job locks ``OUT/.ddpkit-rank<r>.lock`` (``fcntl.flock``, released by the kernel
however the process ends, SIGKILL included), so the ranks of one job, on one machine or several sharing the
folder, never collide with each other, and a second job finds its rank 0's file taken and stops at once, naming
the process that holds it. The lock is taken once the ranks agree, before anything is written (a job refused at
start-up leaves no folder behind), and released when the run ends (`holding_out`), so one process may run one
job after another on the same folder (a notebook resuming its own run). An elastic restart's new processes find
the old ones' locks released.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from typing import IO

from ddpkit.distributed.launch import LaunchError

_held: list[IO[str]] = []  # the open lock files, kept for the life of the process


def lock_path(out: str, rank: int) -> str:
    return os.path.join(out, f".ddpkit-rank{rank}.lock")


def claim_out(out: str, rank: int) -> None:
    """Locks `out` for this rank of this job, or raises LaunchError naming the job that holds it."""
    os.makedirs(out, exist_ok=True)
    handle = open(lock_path(out, rank), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise LaunchError(
            f"--out {out} is in use by another ddpkit job ({holder}); give each job its own --out, or wait until "
            "that job ends"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"rank {rank}, pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}")
    handle.flush()
    _held.append(handle)


def release_out(out: str, rank: int) -> None:
    """Releases this process's lock on `out` for `rank` (taken by `claim_out`); nothing if it holds none."""
    path = os.path.abspath(lock_path(out, rank))
    for handle in [h for h in _held if os.path.abspath(h.name) == path]:
        _held.remove(handle)
        handle.close()  # closing the file releases its flock


@contextlib.contextmanager
def holding_out(out: str | None, rank: int) -> Iterator[None]:
    """`claim_out` for the duration of the block (nothing without an `out`), released however the block ends."""
    if out is None:
        yield
        return
    claim_out(out, rank)
    try:
        yield
    finally:
        release_out(out, rank)
