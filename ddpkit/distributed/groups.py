"""Node-level process groups: ranks ``[k*n, (k+1)*n)`` form node k; one process per node talks between nodes."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ddpkit.distributed.env import ProcessGroup, job_timeout


@dataclass
class NodeGroups:
    """The groups of a hierarchical job, as seen from one rank.

    `local` holds the ranks of this rank's node; `master` the first rank of every node (None on the other ranks:
    they do not take part in inter-node traffic); `world` all ranks. Nodes may be real machines or, in tests,
    "fake nodes" of processes on one machine: only `nprocs_per_node` decides.
    """

    nprocs_per_node: int
    node: int
    num_nodes: int
    local_rank: int
    world: ProcessGroup
    local: ProcessGroup
    master: ProcessGroup | None

    @property
    def is_master(self) -> bool:
        return self.local_rank == 0

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.nprocs_per_node, (node + 1) * self.nprocs_per_node))


def check_nprocs_per_node(nprocs_per_node: int, world_size: int) -> None:
    """Raises a ValueError unless `nprocs_per_node` is a positive divisor of `world_size`."""
    if not isinstance(nprocs_per_node, int) or nprocs_per_node < 1:
        raise ValueError(f"nprocs_per_node must be an int >= 1, got {nprocs_per_node!r}")
    if world_size % nprocs_per_node:
        raise ValueError(
            f"nprocs_per_node={nprocs_per_node} must divide the world size {world_size}: ranks [k*n, (k+1)*n) "
            "form node k, so every node needs the same number of processes"
        )


def make_node_groups(
    nprocs_per_node: int,
    rank: int,
    world_size: int,
    world: ProcessGroup | None = None,
    local: ProcessGroup | None = None,
    master: ProcessGroup | None = None,
) -> NodeGroups:
    """Creates (or adopts the given) intra-node and inter-node groups; a collective over the default group.

    torch requires every rank to create every group, in the same order: all node groups first, then the group
    of node masters. Groups passed in are used as they are and not created. The groups created here inherit the
    default group's timeout (the job's ``--timeout``), so a rank that stops answering fails them as soon as it
    fails the default group, not after torch's 30-minute default.
    """
    check_nprocs_per_node(nprocs_per_node, world_size)
    num_nodes = world_size // nprocs_per_node
    node, local_rank = divmod(rank, nprocs_per_node)
    timeout = job_timeout()
    if local is None:
        for k in range(num_nodes):
            group = dist.new_group(list(range(k * nprocs_per_node, (k + 1) * nprocs_per_node)), timeout=timeout)
            if k == node:
                local = group
    if master is None:
        group = dist.new_group([k * nprocs_per_node for k in range(num_nodes)], timeout=timeout)
        master = group if local_rank == 0 else None
    return NodeGroups(
        nprocs_per_node=nprocs_per_node,
        node=node,
        num_nodes=num_nodes,
        local_rank=local_rank,
        world=world if world is not None else dist.group.WORLD,
        local=local,
        master=master,
    )
