"""A rank that never lingers: it ends when told to stop (SIGTERM, SIGHUP) or when the process that started it is
gone, even while its main thread waits inside a collective."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpkit import _set_parent_death_signal

PARENT_POLL_SECONDS = 0.5
"""How often a rank checks that the process that started it still runs (where PR_SET_PDEATHSIG is missing)."""


def say(line: str, stream: Any = None) -> None:
    """Writes `line` and its newline to `stream` (default: stderr) in one write, so that lines of processes
    sharing the stream never mix: print's separate write of the newline (unbuffered stderr) let the launcher's
    last line land in between."""
    stream = sys.stderr if stream is None else stream
    stream.flush()
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor (a test's capture)
        stream.write(line + "\n")
        stream.flush()
        return
    os.write(fd, (line + "\n").encode())


def tell(line: str) -> None:
    """`say` on stdout: what a user reads as the job's progress (membership changes), not as an error."""
    say(line, sys.stdout)


def guard_rank(label: str, cleanup: Callable[[], Any]) -> None:
    """Makes this rank end, never linger, when it is told to stop or its launcher is gone.

    SIGTERM and SIGHUP get a handler whose C part, in whatever thread the signal lands, writes the signal's number
    to a pipe (``signal.set_wakeup_fd``); a watcher thread reads it, so the signal is acted on even while the main
    thread waits inside a collective, where Python handlers never run. The watcher runs `cleanup`, says why and
    exits with 128 + the signal. The watcher also checks every `PARENT_POLL_SECONDS` that the parent still runs;
    the parent's death sends SIGCONT (PR_SET_PDEATHSIG on Linux), which wakes a rank that was stopped (SIGSTOP) at
    that moment so that its watcher sees the launcher gone and ends it: a stopped process would only queue a
    SIGTERM, and stay, orphaned, forever. Call it from the main thread.
    """
    import multiprocessing
    import select

    spawner = multiprocessing.parent_process()  # the launcher, in processes ddpkit's `spawn` started
    parent = os.getppid()  # torchrun's agent, or the fork server of ddpkit's launcher

    def launcher_gone() -> bool:
        """Whether the launcher ended: multiprocessing's pipe from it closed, or (under torchrun) the parent."""
        return not spawner.is_alive() if spawner is not None else os.getppid() != parent

    caught = (signal.SIGTERM, signal.SIGHUP)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    for sig in caught:
        signal.signal(sig, lambda signum, frame: None)  # the watcher acts; the main thread goes on meanwhile
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    # wakes a stopped rank; the watcher then sees the launcher gone (armed already at the fork in the ranks of
    # ddpkit's launcher, whose fork server ends with the launcher; torchrun's workers are armed here)
    _set_parent_death_signal(signal.SIGCONT)

    def finish(code: int, why: str) -> None:
        try:
            cleanup()
        finally:
            say(f"ddpkit: {label}: {why}; stopping")
            os._exit(code)

    def watch() -> None:
        while True:
            ready, _, _ = select.select([read_end], [], [], PARENT_POLL_SECONDS)
            numbers = [n for n in (os.read(read_end, 64) if ready else b"") if n in caught]
            if numbers:  # the parent-death signal can come before this process is given its new parent
                time.sleep(0.1)
            gone = launcher_gone()
            if numbers:
                finish(
                    128 + numbers[0], "its launcher is gone" if gone else f"{signal.Signals(numbers[0]).name} received"
                )
            if gone:
                finish(1, "its launcher is gone")

    if launcher_gone():  # it ended before the death signal was armed
        finish(1, "its launcher is gone")
    threading.Thread(target=watch, name="ddpkit-rank-guard", daemon=True).start()
