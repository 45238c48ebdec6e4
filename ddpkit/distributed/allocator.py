"""Freed memory given back to the system at once: glibc's allocator told to map large blocks of their own.

PyTorch's CPU tensors come from the C allocator. glibc keeps a freed block for reuse, and after a large block is
freed it raises the size from which blocks get a mapping of their own, so later gradients and temporaries come
from its heap and a process's resident size stays at its highest: a rank that frees every gradient it does not
own (`ShardedDataParallel`) still counts them. `return_freed_memory` fixes that size (1 MiB by default), so every
large tensor is mapped alone and unmapped when freed. Cost: the pages of a new large tensor are faulted in again.
It changes this process only; ``MALLOC_MMAP_THRESHOLD_`` in the environment does the same before Python starts.

Why a process keeps so much: PyTorch asks for CPU tensors 64-byte aligned (``posix_memalign``), for which glibc
takes a block plus the worst-case padding from its heap and gives the unused pieces back; a freed block of a tensor's
exact size then cannot serve the next tensor of that size, and the heap grows past what is live
(``python -m benchmarks.probe_allocator`` shows it without torch). The cost of mapping blocks alone is their page
faults; ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the environment (glibc 2.35 or later, with the kernel's
transparent huge pages enabled) makes those mappings use huge pages, with far fewer faults. That setting is read when
the process starts, so only the environment of a launcher (``ddpkit train``, ``torchrun``) can give it.

``ddpkit train`` does both for ``--strategy sharded`` where the machine allows (``--allocator auto``): its launcher
puts the huge-page setting in its ranks' environment (`huge_pages_environment`) and each rank maps blocks of
`LARGE_BLOCK_BYTES` or more alone (`map_large_blocks`). The threshold is high so that a model's activations, which
are allocated and freed every step and which the heap reuses cheaply, mostly stay below it, while the gradients and
optimizer temporaries of large layers, the blocks ZeRO-2 frees, go above.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
M_MMAP_THRESHOLD = -3

LARGE_BLOCK_BYTES = 8 * 2**20
"""Blocks of this size or more are mapped alone by `map_large_blocks` (and so by ``ddpkit train --allocator``)."""

HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"
"""glibc's tunable (2.35 and later) that gives its mappings transparent huge pages; value 1."""

THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
"""The kernel's transparent huge page mode: "[always] madvise never" names the one in force in brackets."""


_mapped_from: int | None = None  # the threshold this process set (`in_effect` reports it)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """This process's C library (looked up once: `find_library` asks ``ldconfig``), None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def return_freed_memory(threshold_bytes: int = 2**20, keep_top_bytes: int | None = None) -> bool:
    """Makes glibc map blocks of `threshold_bytes` or more alone, so that freeing one returns its pages at once.

    Calls ``mallopt(M_MMAP_THRESHOLD, threshold_bytes)``, which also stops glibc from raising that threshold by
    itself, and from raising the free space it keeps at the top of its heap with it: that stays at 128 KiB unless
    `keep_top_bytes` sets it (``M_TRIM_THRESHOLD``), so that blocks below the threshold freed and taken again every
    step (activations) are not given back and faulted in again each time. Affects this process's later
    allocations only; a page of a new large block is faulted in on first use.

    Args:
        threshold_bytes: the smallest block size mapped alone.
        keep_top_bytes: the free space the heap keeps at its top before it gives memory back (None: glibc's
            128 KiB).

    Returns:
        True when glibc took the setting; False where the C library is not glibc (nothing changes).

    Example:
        >>> from ddpkit.distributed.allocator import return_freed_memory
        >>> return_freed_memory(8 * 2**20)  # in each rank, before the model is built
        True
    """
    global _mapped_from
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    done = bool(mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(threshold_bytes)))
    if done and keep_top_bytes is not None:
        done = bool(mallopt(ctypes.c_int(M_TRIM_THRESHOLD), ctypes.c_int(keep_top_bytes)))
    if done:
        _mapped_from = threshold_bytes
    return done


def glibc_version() -> tuple[int, int] | None:
    """The version of this process's C library when it is glibc.

    Returns:
        (major, minor), such as (2, 36); None where the C library is not glibc.
    """
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (AttributeError, ValueError, OSError):
        return None
    found = re.fullmatch(r"glibc (\d+)\.(\d+).*", text or "")
    return (int(found[1]), int(found[2])) if found else None


def transparent_huge_pages(setting: str = THP_SETTING) -> str:
    """The kernel's transparent huge page mode.

    Args:
        setting: the file that names it (the kernel's sysfs entry by default).

    Returns:
        "always", "madvise" or "never"; "" where the file cannot be read (not Linux).
    """
    try:
        with open(setting) as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return ""
    return found[1] if found else ""


def huge_pages_available() -> bool:
    """Whether glibc can give its mappings transparent huge pages on this machine (`huge_pages_possible` with
    this process's glibc and the kernel's mode).

    Returns:
        True with glibc 2.35 or later and the kernel's transparent huge pages "always" or "madvise".
    """
    return huge_pages_possible(glibc_version(), transparent_huge_pages())


def huge_pages_possible(version: tuple[int, int] | None, mode: str) -> bool:
    """Whether glibc `version` under the kernel's transparent huge page `mode` can give mappings huge pages.

    Args:
        version: glibc's (major, minor), as `glibc_version` gives it; None: not glibc.
        mode: the kernel's mode, as `transparent_huge_pages` gives it.

    Returns:
        True with glibc 2.35 or later (the first with ``glibc.malloc.hugetlb``) and the mode "always" or "madvise".
    """
    return version is not None and version >= (2, 35) and mode in ("always", "madvise")


def _tunables(environ: Mapping[str, str]) -> dict[str, str]:
    """The glibc tunables `environ` sets (``GLIBC_TUNABLES=name=value:name=value``), by name."""
    pairs = (item.split("=", 1) for item in environ.get("GLIBC_TUNABLES", "").split(":") if item)
    return {pair[0]: pair[1] if len(pair) > 1 else "" for pair in pairs}


def huge_pages_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a launcher adds to its processes' environment so that glibc maps large blocks in huge pages.

    glibc reads its tunables when a process starts, so this must be in the environment the ranks start with.

    Args:
        environ: the environment the processes would start with (``os.environ`` in a launcher).

    Returns:
        ``{"GLIBC_TUNABLES": ...}`` with ``glibc.malloc.hugetlb=1`` after the tunables `environ` has already; empty
        where huge pages are not available (`huge_pages_available`) or where `environ` chooses that tunable itself
        (the user's setting wins).

    Example:
        >>> os.environ.update(huge_pages_environment(os.environ))  # in the launcher, before starting the ranks
    """
    if not huge_pages_available() or HUGE_PAGE_TUNABLE in _tunables(environ):
        return {}
    tunables = environ.get("GLIBC_TUNABLES", "")
    return {"GLIBC_TUNABLES": ":".join(item for item in (tunables, f"{HUGE_PAGE_TUNABLE}=1") if item)}


def started_environment(path: str = "/proc/self/environ") -> dict[str, str]:
    """The environment this process image started with: what glibc read its settings from.

    A process forked by a fork server has the fork server's, whatever ``os.environ`` says now.

    Args:
        path: where the kernel shows it (``/proc/self/environ``).

    Returns:
        Name to value; empty where it cannot be read (not Linux).
    """
    try:
        with open(path, "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return {}
    pairs = (entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)
    return {name: value for name, value in pairs}


def started_with_huge_pages(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process started with glibc's huge pages for its mappings.

    Args:
        environ: the environment the process started with (`started_environment` when None).

    Returns:
        True when its ``GLIBC_TUNABLES`` sets ``glibc.malloc.hugetlb`` to 1 or 2.
    """
    environ = started_environment() if environ is None else environ
    return _tunables(environ).get(HUGE_PAGE_TUNABLE) in ("1", "2")


def threshold_chosen_by_user(environ: Mapping[str, str]) -> bool:
    """Whether an environment chooses glibc's mapping threshold itself.

    Args:
        environ: a process's starting environment.

    Returns:
        True when it sets ``MALLOC_MMAP_THRESHOLD_`` or the tunable ``glibc.malloc.mmap_threshold``.
    """
    return "MALLOC_MMAP_THRESHOLD_" in environ or "glibc.malloc.mmap_threshold" in _tunables(environ)


def map_large_blocks(threshold_bytes: int = LARGE_BLOCK_BYTES, environ: Mapping[str, str] | None = None) -> bool:
    """Makes this process map blocks of `threshold_bytes` or more alone, unless the user chose a threshold.

    What each rank of ``ddpkit train --allocator mapped`` (and ``auto`` with ``--strategy sharded``) runs first:
    `return_freed_memory` with a threshold high enough that activations mostly stay in the heap, whose top keeps
    twice the threshold free (the ratio glibc keeps when it moves the threshold itself).

    Args:
        threshold_bytes: the smallest block size mapped alone.
        environ: the process's starting environment (`started_environment` when None); a threshold set there stands.

    Returns:
        True when blocks of that size are now mapped alone; False where the user's threshold stands or the C library
        is not glibc.
    """
    environ = started_environment() if environ is None else environ
    if threshold_chosen_by_user(environ):
        return False
    return return_freed_memory(threshold_bytes, keep_top_bytes=2 * threshold_bytes)  # (glibc's own ratio)


def in_effect() -> dict[str, object]:
    """This process's allocator settings, for a run's record.

    Returns:
        ``large_blocks_mapped_from_bytes``: the threshold this process set, None for glibc's own moving threshold,
        "environment" for the user's; ``huge_pages``: whether glibc's mappings get huge pages.
    """
    started = started_environment()
    mapped_from: object = "environment" if threshold_chosen_by_user(started) else _mapped_from
    return {"large_blocks_mapped_from_bytes": mapped_from, "huge_pages": started_with_huge_pages(started)}


class MallocInfo(ctypes.Structure):
    """glibc's ``struct mallinfo2``: the heap's counters (``arena``: bytes of the heap; ``uordblks``: handed out from
    it; ``hblkhd``: in blocks mapped alone)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_info() -> MallocInfo | None:
    """This process's allocator counters now (glibc's ``mallinfo2``, glibc 2.33 or later).

    Returns:
        The counters; None where the C library has no ``mallinfo2``.
    """
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = MallocInfo
    return mallinfo2()
