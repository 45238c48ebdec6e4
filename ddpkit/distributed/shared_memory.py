"""Shared-memory segments between the ranks of one host: how a tensor reaches a neighbour without a socket.

Between two processes on one machine, gloo moves a tensor through the kernel's TCP loopback: a copy into the
socket on one side, a copy out on the other, on the same cores that train. A barrier, one memcpy out of a shared
segment and a second barrier cost less than those two copies through the kernel.

A *segment* is a file in ``/dev/shm`` that one rank (its writer) creates and writes, and the ranks that read it
map (``torch.from_file(..., shared=True)``). Once all have mapped it the file is unlinked: the mappings live on
and nothing is left behind when the processes end. A rank killed in the few milliseconds between the creation and
the unlinking leaves its file behind; its name carries the writer's pid namespace and pid. A process that ends
any other way (an exception, a peer that failed, SIGTERM) unlinks the files it created and did not yet remove
(`remove_own_files`, run at exit and by ``ddpkit train``'s signal handling). What a killed process left is
removed by the launcher of its job once the job ended, and by any later ``ddpkit train`` job on the host whatever
its strategy (``sweep_stale(min_age=0)``: the writer is gone); a job that uses shared memory also sweeps files
over a minute old whose writer is gone. Two users: OSS's parameter messages (`ddpkit.optim.param_messages`: one
writer, every other rank reads) and ShardedDataParallel's gradient reduce (`ddpkit.distributed.mailboxes`: every
sender writes, the owner reads). Segments are used only when

* every rank of the group runs on one host: same boot, hostname, and network, mount and pid namespace (so ranks
  in different network namespaces, the way the multi-host tests simulate hosts, count as different hosts);
* the group's backend is gloo (CPU tensors) and ``/dev/shm`` exists with room for the segments;
* the environment variable ``DDPKIT_SHARED_MEMORY`` is not ``0`` (``1``, the default, allows them).

CommStats counts a copy into or out of a segment for another rank as kind ``shared_memory``: its payload bytes,
and on the wire only the 1-byte signals that go with it (barriers count 0, like every barrier).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ddpkit.distributed.env import ProcessGroup, backend_name, group_label, group_size
from ddpkit.distributed.objects import gather_objects
from ddpkit.distributed.segment_files import OWN_FILES, SHM_DIR, pid_namespace, sweep_stale
from ddpkit.distributed.stats import comm_stats

ENV_VAR = "DDPKIT_SHARED_MEMORY"


def enabled_by_environment() -> bool:
    """Whether ``DDPKIT_SHARED_MEMORY`` allows segments (default yes); raises on a value other than 0 or 1."""
    value = os.environ.get(ENV_VAR, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {ENV_VAR} must be 0 (off) or 1 (on, the default), got {value!r}")
    return value == "1"


def boot_id() -> str:
    """The running kernel's boot id: equal for exactly the processes of one boot of one machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "no-boot-id"


def host_identity() -> str:
    """A string equal for exactly the processes that can share ``/dev/shm`` and count as one host."""
    parts = [socket.gethostname(), boot_id()]
    for namespace in ("net", "mnt", "pid"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{namespace}"))
        except OSError:
            parts.append(f"no-{namespace}-ns")
    return "|".join(parts)


def free_bytes() -> int:
    """Bytes free in ``/dev/shm`` (0 when it does not exist)."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


def cpu_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the CPU tensors among `tensors`: what segments for them would hold (the room `agree` asks for)."""
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


def record_copy(nbytes: int, group: ProcessGroup | None) -> None:
    """Counts one copy of `nbytes` out of another rank's segment (nothing is sent on the wire)."""
    comm_stats.record("shared_memory", group_label(group), nbytes, 0.0)


class SharedSegments:
    """Names, creates, maps and unlinks the segments of one process group; build with `agree` (collective).

    A segment is named by the group's token, the pid namespace and its writer's pid (so that litter can be told
    from live segments: `sweep_stale`) and a name the caller chooses, unique among the writer's segments.
    `pids`: the pid of every rank, by group rank (all ranks share one pid namespace: `host_identity`)."""

    def __init__(self, group: ProcessGroup | None, token: str, pids: list[int]) -> None:
        self.group, self.token, self.pids = group, token, pids
        self.rank = dist.get_rank(group)
        self.pid_namespace = pid_namespace()

    @classmethod
    def agree(cls, group: ProcessGroup | None, nbytes: int) -> SharedSegments | None:
        """Collective (one object all-gather): segments for `group` when every rank is on one host, may use
        ``/dev/shm`` and sees room there for `nbytes` (plus 64 MiB to spare); None otherwise, on every rank."""
        if group_size(group) < 2 or backend_name(group, "cpu") != "gloo":
            return None
        usable = enabled_by_environment()
        if usable:
            sweep_stale()
            usable = free_bytes() >= nbytes + 2**26
        everyone = gather_objects((host_identity(), usable, uuid.uuid4().hex, os.getpid()), dst=-1, group=group)
        assert everyone is not None
        if any(identity != everyone[0][0] or not ok for identity, ok, _, _ in everyone):
            return None
        return cls(group, everyone[0][2], [pid for _, _, _, pid in everyone])

    def _path(self, name: str, writer: int) -> str:
        return os.path.join(SHM_DIR, f"ddpkit-{self.token}-{self.pid_namespace}-{self.pids[writer]}-{name}")

    def create(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new segment of `numel` elements, written by this rank; `remove` it once every reader mapped it."""
        path = self._path(name, self.rank)
        OWN_FILES.add(path)
        return torch.from_file(path, shared=True, size=numel, dtype=dtype)

    def attach(self, name: str, writer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Maps the segment group rank `writer` created (before this rank learnt of it: after a barrier or a
        message). Raises if it is not there: mapping would create an empty file and read zeros."""
        path = self._path(name, writer)
        if not os.path.exists(path):
            raise RuntimeError(
                f"shared-memory segment {path} of rank {writer} is missing: it was removed before this rank mapped "
                f"it (by a cleaner of {SHM_DIR}?). Set {ENV_VAR}=0 to exchange tensors over sockets instead."
            )
        return torch.from_file(path, shared=True, size=numel, dtype=dtype)

    def size(self, name: str, writer: int) -> int:
        """The bytes of the segment group rank `writer` created (0 if it is not there)."""
        try:
            return os.path.getsize(self._path(name, writer))
        except OSError:
            return 0

    def remove(self, name: str, writer: int) -> None:
        """Unlinks a segment's file: processes that mapped it keep it, none can map it any more."""
        path = self._path(name, writer)
        OWN_FILES.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
