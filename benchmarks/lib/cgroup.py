"""A command run inside a memory cgroup of its own: the peak of the whole job, every page counted once.

A process's resident set counts a page shared with other processes (shared memory, the same file mapped) in full
in each of them; the cgroup charges each page once, to the group of the process that first touched it, and keeps
the highest total (``memory.max_usage_in_bytes``). Files already in the page cache when the job starts are not
charged again, so a benchmark runs a warm-up job first. With a limit (``memory.limit_in_bytes``) a job that needs
more is ended by the kernel's OOM killer: that is how "it does not fit" is measured. cgroup v1's memory controller
(what this machine mounts at /sys/fs/cgroup/memory), as root; `unavailable` says why not elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def unavailable() -> str | None:
    """Why a memory cgroup cannot be made here, or None when it can."""
    if not (ROOT / "cgroup.procs").exists():
        return f"no cgroup v1 memory controller at {ROOT}"
    probe = ROOT / f"ddpkit-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError as exc:
        return f"cannot make a memory cgroup under {ROOT} ({exc}; run as root)"
    probe.rmdir()
    return None


@dataclass
class Outcome:
    """A job's end: its exit status and output, the cgroup's peak, and whether the kernel ran out of the limit."""

    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int
    out_of_memory: bool


def run(command: list[str], limit_bytes: int | None = None, timeout: float = 900.0) -> Outcome:
    """Runs `command` in a fresh memory cgroup (limited to `limit_bytes` if given) and removes the cgroup after."""
    group = ROOT / f"ddpkit-bench-{uuid.uuid4().hex[:12]}"
    group.mkdir()
    try:
        if limit_bytes is not None:
            (group / "memory.limit_in_bytes").write_text(str(limit_bytes))

        def enter() -> None:  # in the child, before exec: it and everything it starts belong to the group
            (group / "cgroup.procs").write_text(str(os.getpid()))

        done = subprocess.run(command, preexec_fn=enter, capture_output=True, text=True, timeout=timeout)
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        hit_limit = int((group / "memory.failcnt").read_text()) > 0  # an allocation had to wait for reclaim, or failed
        failed_for_memory = limit_bytes is not None and done.returncode != 0 and hit_limit
        return Outcome(done.returncode, done.stdout, done.stderr, peak, failed_for_memory)
    finally:
        _remove(group)


def _remove(group: Path) -> None:
    """Removes the cgroup once its last process is gone (what the job left is killed first)."""
    for _ in range(100):
        procs = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        for pid in procs:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
