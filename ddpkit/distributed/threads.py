"""How many intra-op threads a rank takes: its share of the cores of the machine it runs on.

torch gives every process as many threads as the machine has cores. Two ranks on one machine then run twice as many
threads as there are cores, and each matrix product waits for threads the other rank holds (several times slower
than ranks that take their share of the cores each). A local spawn knows how many ranks share the machine before it
starts; ``--rank`` launches and torchrun's (one process per node, or nodes in containers on one machine) learn it
only once they have joined, from one all-gather of each rank's machine identity; the ranks of a fault-tolerant job,
which no group spans, from the identities each wrote into the job's store, counted over the members of the round
they took part in.

Ranks share a machine's cores when they run under one kernel (the same boot id) on the same CPUs (the same
affinity set): network or mount namespaces (containers, the test hosts of `benchmarks.lib.netns`) do not give a
process cores of its own. ``OMP_NUM_THREADS``, when set, wins: the user (or torchrun, which sets it to 1 for
several processes per node) chose.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ddpkit.distributed.env import ProcessGroup
from ddpkit.distributed.objects import gather_objects
from ddpkit.distributed.shared_memory import boot_id

OMP_VARIABLE = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_identity() -> str:
    """Equal for exactly the processes that compete for the same cores: one kernel, the same CPU set."""
    boot = boot_id()
    try:
        cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        cpus = str(os.cpu_count())
    return f"{boot}|{cpus}"


def threads_per_rank(cores: int, ranks_here: int, requested: str | None = None) -> int:
    """Intra-op threads for one of `ranks_here` ranks sharing `cores`: an even share, at least one; a positive
    integer `requested` (``OMP_NUM_THREADS``) instead when given."""
    if requested is not None and requested.strip().isdigit() and int(requested) > 0:
        return int(requested)
    return max(1, cores // max(1, ranks_here))


def share_cores(local_ranks: int) -> int:
    """Before joining: this rank's share among the `local_ranks` a local launcher started. Returns the count."""
    threads = threads_per_rank(usable_cores(), local_ranks, os.environ.get(OMP_VARIABLE))
    torch.set_num_threads(threads)
    return threads


def share_cores_with_peers(group: ProcessGroup | None = None) -> int:
    """After joining (a collective of the group): this rank's share among every rank of `group` on its machine,
    found by one all-gather of each rank's `machine_identity`. Returns the count."""
    identities = gather_objects(machine_identity(), dst=-1, group=group)
    assert identities is not None
    return _take_share(sum(1 for identity in identities if identity == machine_identity()))


def publish_machine(store: Any, key_prefix: str, rank: int) -> None:
    """Writes this rank's `machine_identity` into `store` under ``key_prefix + rank``, for
    `share_cores_through_store` (a fault-tolerant rank, before it takes part in its first round)."""
    store.set(f"{key_prefix}{rank}", machine_identity())


def share_cores_through_store(store: Any, key_prefix: str, rank: int, members: list[int]) -> int:
    """A fault-tolerant rank's share of its machine's cores among the round's `members` that published the same
    machine identity (`publish_machine`: one store read per member). Returns the count."""
    mine = machine_identity()
    keys = {r: f"{key_prefix}{r}" for r in members if r != rank}
    return _take_share(1 + sum(1 for key in keys.values() if store.check([key]) and store.get(key).decode() == mine))


def _take_share(ranks_here: int) -> int:
    """Sets this process's intra-op threads to its share among `ranks_here` ranks of its machine; returns it."""
    threads = threads_per_rank(usable_cores(), ranks_here, os.environ.get(OMP_VARIABLE))
    torch.set_num_threads(threads)
    return threads
