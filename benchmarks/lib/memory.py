"""Memory of the calling process, from /proc: peak and current resident set, and the proportional set size.

Not ``getrusage().ru_maxrss``: Linux carries that over from the parent across fork + exec, so a spawned rank would
report the benchmark parent's size; VmHWM belongs to the process's own address space. A page shared between ranks
(ddpkit's shared-memory segments) counts in full in each rank's resident set; the PSS splits each shared page
between the processes that map it, so the PSS summed over the ranks is the memory the job occupies.
"""

from __future__ import annotations


def _field_kib(path: str, name: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{name} not found in {path}")


def peak_rss_mb() -> float:
    """Peak resident set (VmHWM) of this process, MiB."""
    return _field_kib("/proc/self/status", "VmHWM") / 1024


def rss_mb() -> float:
    """Current resident set (VmRSS) of this process, MiB."""
    return _field_kib("/proc/self/status", "VmRSS") / 1024


def pss_mb() -> float:
    """Proportional set size of this process (shared pages split between their mappers), MiB."""
    return _field_kib("/proc/self/smaps_rollup", "Pss") / 1024


def total_memory_gb() -> float:
    """The machine's memory (MemTotal), GiB."""
    return _field_kib("/proc/meminfo", "MemTotal") / 2**20
