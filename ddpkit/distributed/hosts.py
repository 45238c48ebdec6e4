"""Which ranks share a host, and the process groups hierarchical sharding runs on.

A job of H hosts with L ranks each is seen as a grid: the ranks of one host form its *host group* (they can use
shared memory), and the ranks with the same position on every host form a *lane group* (rank l of every host).
Hierarchical ZeRO sums a gradient within each host first, then only one rank per host (the one in the owner's
lane) sends that host's partial sum across, so every host sends each gradient once instead of L times; parameters
come back the same way. Lanes spread that inter-host traffic over the host's ranks.

The layout is the one ddpkit already uses to decide on shared memory: `shared_memory.host_identity` (hostname,
boot id and the network, mount and pid namespaces). Hosts are numbered by their lowest rank; a rank's lane is its
position among its host's ranks in rank order.

Communication: `detect` is one object all-gather of the identity strings; `HostGroups.build` creates H + L process
groups (``torch.distributed.new_group``, collective over the whole job, in the same order on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ddpkit.distributed import shared_memory
from ddpkit.distributed.env import ProcessGroup, group_size
from ddpkit.distributed.objects import gather_objects


@dataclass(frozen=True)
class HostLayout:
    """Per host (numbered by lowest rank), the group ranks on it in rank order."""

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def from_identities(cls, identities: list[str]) -> HostLayout:
        order: dict[str, list[int]] = {}
        for rank, identity in enumerate(identities):
            order.setdefault(identity, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in order.values()))

    @property
    def host_count(self) -> int:
        return len(self.hosts)

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if rank in ranks)

    def lane_of(self, rank: int) -> int:
        return self.hosts[self.host_of(rank)].index(rank)

    def rank_at(self, host: int, lane: int) -> int:
        return self.hosts[host][lane]

    @property
    def uniform(self) -> bool:
        """Every host has the same number of ranks."""
        return len({len(ranks) for ranks in self.hosts}) == 1

    @property
    def pays(self) -> bool:
        """Hierarchy changes something: several hosts, and several ranks on each."""
        return self.host_count > 1 and self.uniform and len(self.hosts[0]) > 1

    def describe(self) -> str:
        return "; ".join(f"host {h}: ranks {', '.join(map(str, ranks))}" for h, ranks in enumerate(self.hosts))

    def check_uniform(self, what: str) -> None:
        """Raises a ValueError naming every host's ranks when the hosts hold different numbers of ranks."""
        if not self.uniform:
            raise ValueError(
                f"{what}: hierarchical sharding needs the same number of ranks on every host, got {self.describe()}; "
                "start as many processes on each machine (--nproc-per-node), or pass hierarchical=False"
            )


def detect(group: ProcessGroup | None) -> HostLayout:
    """Collective (one object all-gather): the host layout of `group`, the same on every rank."""
    identities = gather_objects(shared_memory.host_identity(), dst=-1, group=group)
    assert identities is not None
    return HostLayout.from_identities(list(identities))


@dataclass
class HostGroups:
    """This rank's place in a uniform layout of the whole job, and its host and lane process groups."""

    layout: HostLayout
    host: int
    lane: int
    host_group: ProcessGroup
    lane_group: ProcessGroup

    @classmethod
    def build(cls, layout: HostLayout) -> HostGroups:
        """Collective over the whole job: one group per host, then one per lane, created on every rank alike."""
        rank = dist.get_rank()
        host_groups = [dist.new_group(list(ranks)) for ranks in layout.hosts]
        lanes = len(layout.hosts[0])
        lane_groups = [dist.new_group([ranks[lane] for ranks in layout.hosts]) for lane in range(lanes)]
        host, lane = layout.host_of(rank), layout.lane_of(rank)
        return cls(layout, host, lane, host_groups[host], lane_groups[lane])

    def lane_of(self, rank: int) -> int:
        return self.layout.lane_of(rank)

    def host_of(self, rank: int) -> int:
        return self.layout.host_of(rank)


_built: dict[HostLayout, HostGroups] = {}


def hierarchy(
    group: ProcessGroup | None, wanted: bool | None, what: str, one_per_host: bool = False
) -> HostGroups | None:
    """Collective: the host and lane groups for hierarchical sharding over `group`, or None where it is off.

    `wanted` None: on where it pays (the whole job on several hosts with equal numbers of ranks, several per host);
    True: also required (an uneven layout raises, naming the hosts); False: off. Only the whole job (the default
    group) can be split this way, since creating groups involves every rank. The groups are built once per layout
    and shared by every optimizer and wrapper of the process. `one_per_host`: also with one rank per host (for
    what the cross-host stage does by itself, e.g. compressing what crosses).
    """
    if wanted is False or group_size(group) < 2:
        return None
    if group not in (None, dist.group.WORLD):
        if wanted:
            raise ValueError(f"{what}: hierarchical=True needs the default process group (the whole job)")
        return None
    layout = detect(group)
    if wanted:
        layout.check_uniform(what)
    if not (layout.pays or (one_per_host and layout.host_count > 1 and layout.uniform)):
        return None
    if layout not in _built:
        _built[layout] = HostGroups.build(layout)
    return _built[layout]
