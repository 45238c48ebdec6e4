"""Reduce to an owner in two stages, within each host and then across hosts (hierarchical ZeRO-2's gradients).

Stage 1 sums the message within each host onto the host's rank in the owner's *lane* (its position on its host;
see `ddpkit.distributed.hosts`), through shared-memory mailboxes where the host allows (`MailboxReduce`), else
over the host group's sockets. Stage 2 sums those per-host partial sums across hosts onto the owner, over the
lane's group: only one rank per host sends, so each gradient leaves every host once, instead of once per rank,
and the owners' lanes spread that traffic over the host's ranks.

Stage 2 can start only when stage 1 is complete on that rank; `progress()` (called from ShardedDataParallel's
gradient hooks) starts it for every finished stage 1 in launch order, so the inter-host transfer overlaps the rest
of backward, and `wait()` finishes both. Over sockets the owner's stage-2 receives are posted at the first
gradient (`post`, as `comm.post_reduce`), so its ready notices do not queue behind its own outgoing data.

The sum: host partial sums in lane-rank order, then the hosts' sums in host order: the same value as a flat
reduce up to floating-point order. Bytes per message of B bytes: within a host (L-1) B through shared memory;
across hosts (H-1) B sent to the owner, one copy per other host.
"""

from __future__ import annotations

import torch

from ddpkit.distributed import comm
from ddpkit.distributed.hosts import HostGroups
from ddpkit.distributed.mailboxes import MailboxReduce


def _stage_done(handle: object) -> bool:
    """Whether an async handle's transfers have all completed (without blocking); unknown handles: False."""
    works = getattr(handle, "works", None)
    if works is None:
        return False
    return all(work.is_completed() for work in works)


class _TwoStage:
    """One message's reduce in flight: stage 1 within the host, then (on the owner's lane) stage 2 across hosts."""

    def __init__(self, message: torch.Tensor, inner: object, start_outer: object | None) -> None:
        self.message, self.inner, self.start_outer = message, inner, start_outer
        self.outer: object | None = None
        self.inner_done = False

    def _finish_inner(self) -> None:
        if not self.inner_done:
            self.inner.wait()  # type: ignore[attr-defined]
            self.inner_done = True

    def advance(self, block: bool) -> bool:
        """Starts stage 2 once stage 1 is done (waiting for it if `block`); True when nothing is left to start."""
        if self.start_outer is None or self.outer is not None:
            return True
        if not block and not _stage_done(self.inner):
            return False
        self._finish_inner()
        self.outer = self.start_outer(self.message)  # type: ignore[operator]
        return True

    def wait(self) -> bool:
        self._finish_inner()
        self.advance(block=True)
        if self.outer is not None:
            self.outer.wait()  # type: ignore[attr-defined]
        return True


class HierarchicalReduce:
    """SUM-reduces messages to owners (ranks of the whole job) host by host, then across hosts (module doc).

    Build it with `agree` (collective over each host). Every rank calls `post` (at the start of backward) and
    `reduce` for the same messages in the same order, like a collective, with a key naming the message.
    """

    def __init__(self, groups: HostGroups, mailboxes: MailboxReduce | None) -> None:
        self.groups, self.mailboxes = groups, mailboxes
        self._posted: dict[str, comm.PostedReduce] = {}
        self._in_flight: list[_TwoStage] = []

    @classmethod
    def agree(cls, groups: HostGroups, nbytes: int) -> HierarchicalReduce:
        """Collective within each host: shared-memory mailboxes where every rank of the host may use them."""
        return cls(groups, MailboxReduce.agree(groups.host_group, nbytes))

    def _on_owner_lane(self, owner: int) -> bool:
        return self.groups.lane_of(owner) == self.groups.lane

    def post(self, key: str, numel: int, dtype: torch.dtype, owner: int, device: torch.device) -> None:
        """Posts stage 2's receiving side for the message `key` (on the owner's lane; sockets only)."""
        if self._on_owner_lane(owner) and comm.can_post_reduce(device, self.groups.lane_group):
            self._posted[key] = comm.post_reduce(numel, dtype, self.groups.host_of(owner), self.groups.lane_group)

    def reduce(self, message: torch.Tensor, owner: int, key: str) -> _TwoStage:
        """Starts the reduce of `message` into `owner`'s message; returns a handle to `wait()` for."""
        lane = self.groups.lane_of(owner)
        if self.mailboxes is not None:
            inner = self.mailboxes.reduce(message, lane, key)
        else:
            inner = comm.reduce(message, lane, self.groups.host_group, async_op=True)
        start_outer = None
        if self._on_owner_lane(owner):
            posted = self._posted.pop(key, None)
            dst = self.groups.host_of(owner)
            if posted is not None:
                start_outer = posted.start
            else:

                def start_outer(tensor: torch.Tensor, dst: int = dst) -> object:
                    return comm.reduce(tensor, dst, self.groups.lane_group, async_op=True)

        handle = _TwoStage(message, inner, start_outer)
        self._in_flight.append(handle)
        self.progress()
        return handle

    def progress(self) -> None:
        """Starts stage 2 of every message whose stage 1 is done, in launch order (never out of it)."""
        while self._in_flight and self._in_flight[0].advance(block=False):
            self._in_flight.pop(0)

    def finish(self) -> None:
        """Starts every remaining stage 2 in launch order (blocking on stage 1 where needed)."""
        for handle in self._in_flight:
            handle.advance(block=True)
        self._in_flight = []
