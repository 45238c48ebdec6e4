"""A command run inside a memory cgroup of its own: the peak of the whole job, every page counted once.

A process's resident set counts a page shared with other processes (shared memory, the same file mapped) in full
in each of them; the cgroup charges each page once, to the group of the process that first touched it, and keeps
the highest total (``memory.max_usage_in_bytes``). Files already in the page cache when the job starts are not
charged again, so a benchmark runs a warm-up job first. With a limit (``memory.limit_in_bytes``) a job that needs
more is ended by the kernel's OOM killer: that is how "it does not fit" is measured. cgroup v1's memory controller
(what this machine mounts at /sys/fs/cgroup/memory), as root; `unavailable` says why not elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
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
    return run_together([command], limit_bytes, timeout)[0]


def run_together(
    commands: list[list[str]], limit_bytes: int | None = None, timeout: float = 900.0, env: dict[str, str] | None = None
) -> list[Outcome]:
    """Starts `commands` at once, each in a fresh memory cgroup of its own (each limited to `limit_bytes` if given:
    the hosts of a job on namespace hosts), waits for all of them and removes the cgroups after. Output goes to
    files, so no process blocks on a full pipe while another is waited for."""
    groups: list[Path] = []
    try:
        with contextlib.ExitStack() as files:
            procs, outputs = [], []
            for command in commands:
                group = ROOT / f"ddpkit-bench-{uuid.uuid4().hex[:12]}"
                group.mkdir()
                groups.append(group)
                if limit_bytes is not None:
                    (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
                out, err = (files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
                outputs.append((out, err))
                procs.append(subprocess.Popen(command, preexec_fn=_enter(group), stdout=out, stderr=err, env=env))
            deadline = time.monotonic() + timeout
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            outcomes = []
            for proc, group, (out, err) in zip(procs, groups, outputs, strict=True):
                out.seek(0)
                err.seek(0)
                peak = int((group / "memory.max_usage_in_bytes").read_text())
                hit_limit = int((group / "memory.failcnt").read_text()) > 0  # an allocation waited, or failed
                failed_for_memory = limit_bytes is not None and proc.returncode != 0 and hit_limit
                outcomes.append(Outcome(proc.returncode, out.read(), err.read(), peak, failed_for_memory))
            return outcomes
    finally:
        for group in groups:
            _remove(group)


def _enter(group: Path) -> Callable[[], None]:
    def enter() -> None:  # in the child, before exec: it and everything it starts belong to the group
        (group / "cgroup.procs").write_text(str(os.getpid()))

    return enter


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
