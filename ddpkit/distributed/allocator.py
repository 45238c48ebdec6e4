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
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def return_freed_memory(threshold_bytes: int = 2**20) -> bool:
    """Makes blocks of at least `threshold_bytes` mapped alone (and so returned when freed); False where the C
    library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(threshold_bytes)))
