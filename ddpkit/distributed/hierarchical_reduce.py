"""Reduce to an owner in two stages, within each host and then across hosts (hierarchical ZeRO-2's gradients).

Stage 1 sums the message within each host onto the host's rank in the owner's *lane* (its position on its host;
see `ddpkit.distributed.hosts`), through shared-memory mailboxes where the host allows (`MailboxReduce`), else
over the host group's sockets. Stage 2 sums those per-host partial sums across hosts onto the owner, over the
lane's group: only one rank per host sends, so each gradient leaves every host once, instead of once per rank,
and the owners' lanes spread that traffic over the host's ranks.

Stage 2 can start only when stage 1 is complete on that rank; `progress()` (called from ShardedDataParallel's
gradient hooks) starts it for every finished stage 1 in launch order, so the inter-host transfer overlaps the rest
of backward, and `wait()` finishes both. Over sockets the owner's stage-2 receives are posted ahead (`post`, as
`comm.post_reduce`: ShardedDataParallel posts them all at the first gradient, or with its `receives_ahead` a few
buckets ahead of its launches, completing an owner's reduces as far behind), so its ready notices do not queue
behind its own outgoing data. A rank lets its message go once its part is done (`sent`, `wait_sent`): outside the
owner's lane when stage 1 took it, on the owner's lane (the host's sum) when its stage-2 send is done (waited for
during backward only with `receives_ahead`).

The sum: host partial sums in lane-rank order, then the hosts' sums in host order: the same value as a flat
reduce up to floating-point order. Bytes per message of B bytes: within a host (L-1) B through shared memory;
across hosts (H-1) B sent to the owner, one copy per other host.

Optionally (a `codec`, such as ``ddpkit.algorithms.quantize.BlockCodec("int8")``: per-block absmax bf16, int8 or
int4) stage 2 sends each host's sum encoded, with error feedback: the sender adds the rounding error it kept from
that message's previous step before encoding, and keeps the new error (one fp32 residual per message it sends
across: about (H-1)/H of the gradients per host, spread over its ranks). The owner adds the others' dequantised
sums to its own host's exact sum. Across hosts a message then costs 2 (bf16), 1 + 4/block (int8) or
0.5 + 4/block (int4) bytes per value instead of 4. Only fp32 messages are quantised.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from ddpkit.distributed import comm
from ddpkit.distributed.env import global_rank, group_label
from ddpkit.distributed.hosts import HostGroups
from ddpkit.distributed.mailboxes import MailboxReduce
from ddpkit.distributed.stats import comm_stats


class WireCodec(Protocol):
    """How stage 2 encodes an fp32 message (the quantisers of `ddpkit.algorithms.quantize` are ones)."""

    def nbytes(self, numel: int) -> int: ...

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode(self, message: torch.Tensor, numel: int) -> torch.Tensor: ...


def _stage_done(handle: object) -> bool:
    """Whether an async handle's transfers have all completed (without blocking); unknown handles: False."""
    works = getattr(handle, "works", None)
    if works is None:
        return False
    return all(work.is_completed() for work in works)


class _TwoStage:
    """One message's reduce in flight: stage 1 within the host, then (on the owner's lane) stage 2 across hosts."""

    def __init__(self, message: torch.Tensor, inner: object, start_outer: object | None, reducer: object) -> None:
        # the message is kept only until stage 2 takes it: outside the owner's lane stage 1 holds what it needs
        # (a mailbox copied it; a socket reduce holds it), so a rank that lets its gradient go frees it
        self.message: torch.Tensor | None = message if start_outer is not None else None
        self.inner, self.start_outer = inner, start_outer
        self.reducer = reducer  # starts stage 2 in launch order (`HierarchicalReduce.advance_through`)
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
        self.message = None  # (stage 2 holds what it needs)
        return True

    def wait(self) -> bool:
        self._finish_inner()
        self.advance(block=True)
        if self.outer is not None:
            self.outer.wait()  # type: ignore[attr-defined]
        return True

    def sent(self) -> bool:
        """A sender's view, without waiting: whether this rank's message is no longer needed. Outside the owner's
        lane a rank only gives it to stage 1 (through shared memory: copied into a mailbox at once); on the owner's
        lane it becomes the host's sum that crosses to the owner, needed until stage 2's send is done."""
        if self.start_outer is not None:
            return self.outer is not None and bool(getattr(self.outer, "sent", lambda: False)())
        taken = getattr(self.inner, "sent", None)
        return bool(taken()) if callable(taken) else False

    def wait_sent(self) -> None:
        """A sender's view: waits until this rank's message is no longer needed (`sent`): stage 1, then, on the
        owner's lane, stage 2's send to the owner, whose receive was posted ahead (`HierarchicalReduce.post`)."""
        self._finish_inner()
        self.reducer.advance_through(self)  # type: ignore[attr-defined]
        wait_sent = getattr(self.outer, "wait_sent", None)
        if callable(wait_sent):
            wait_sent()


class _Works:
    """Pending point-to-point transfers (`works`, for `_stage_done`) and what to do once they are complete."""

    def __init__(self, works: list, then: object | None = None, keep: object = None) -> None:
        self.works, self.then, self.keep = works, then, keep

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        if self.then is not None:
            self.then()  # type: ignore[operator]
            self.then = None
        return True

    def sent(self) -> bool:
        return not self.works

    def wait_sent(self) -> None:
        self.wait()


class _CompressedOuter:
    """Stage 2 of one message, quantised with error feedback (module doc). Every rank of the owner's lane creates
    it at the same point, in the same order (it takes the lane group's next tag); the owner posts its receives."""

    def __init__(self, reducer: HierarchicalReduce, key: str, numel: int, owner: int) -> None:
        self.reducer, self.key, self.numel = reducer, key, numel
        groups = reducer.groups
        self.group, self.owner_host = groups.lane_group, groups.host_of(owner)
        self.tag = comm.next_p2p_tag(self.group)
        assert reducer.codec is not None
        self.size = reducer.codec.nbytes(numel)
        self.buffers: list[torch.Tensor] = []
        self.works: list = []
        if groups.host == self.owner_host:
            others = [h for h in range(groups.layout.host_count) if h != groups.host]
            self.buffers = [torch.empty(self.size, dtype=torch.uint8) for _ in others]
            self.works = [
                dist.irecv(buf, global_rank(self.group, h), group=self.group, tag=self.tag)
                for h, buf in zip(others, self.buffers, strict=True)
            ]

    def start(self, tensor: torch.Tensor) -> _Works:
        flat = tensor.view(-1)
        reducer = self.reducer
        label = group_label(self.group)
        if reducer.groups.host != self.owner_host:
            residual = reducer.residuals.get(self.key)
            corrected = flat + residual if residual is not None else flat.clone()
            assert reducer.codec is not None
            payload, sent = reducer.codec.encode(corrected)
            reducer.residuals[self.key] = corrected.sub_(sent)
            comm_stats.record("reduce", label, self.size, float(self.size))
            send = dist.isend(payload, global_rank(self.group, self.owner_host), group=self.group, tag=self.tag)
            return _Works([send], keep=payload)
        comm_stats.record("reduce", label, self.size, 0.0)

        def add_others() -> None:
            assert reducer.codec is not None
            for buf in self.buffers:  # in host order: the same sum on every run
                flat.add_(reducer.codec.decode(buf, self.numel))
            self.buffers = []

        return _Works(self.works, then=add_others)


class HierarchicalReduce:
    """SUM-reduces messages to owners (ranks of the whole job) host by host, then across hosts (module doc).

    Build it with `agree` (collective over each host). Every rank calls `post` (at the start of backward) and
    `reduce` for the same messages in the same order, like a collective, with a key naming the message.
    """

    def __init__(self, groups: HostGroups, mailboxes: MailboxReduce | None, codec: WireCodec | None = None) -> None:
        self.groups, self.mailboxes = groups, mailboxes
        self.codec = codec
        self.residuals: dict[str, torch.Tensor] = {}  # per message this rank sends across: its rounding error
        self._posted: dict[str, comm.PostedReduce | _CompressedOuter] = {}
        self._in_flight: list[_TwoStage] = []

    @classmethod
    def agree(cls, groups: HostGroups, nbytes: int, codec: WireCodec | None = None) -> HierarchicalReduce:
        """Collective within each host: shared-memory mailboxes where every rank of the host may use them."""
        return cls(groups, MailboxReduce.agree(groups.host_group, nbytes), codec)

    def forget(self, prefix: str) -> None:
        """Drops the error-feedback residuals of messages whose key starts with `prefix` (replaced buckets)."""
        for key in [k for k in self.residuals if k.startswith(prefix)]:
            del self.residuals[key]

    def _on_owner_lane(self, owner: int) -> bool:
        return self.groups.lane_of(owner) == self.groups.lane

    def post(self, key: str, numel: int, dtype: torch.dtype, owner: int, device: torch.device) -> None:
        """Posts stage 2's receiving side for the message `key` (on the owner's lane; sockets only)."""
        if not self._on_owner_lane(owner):
            return
        if self.codec is not None and dtype == torch.float32 and device.type == "cpu":
            self._posted[key] = _CompressedOuter(self, key, numel, owner)
        elif comm.can_post_reduce(device, self.groups.lane_group):
            self._posted[key] = comm.post_reduce(numel, dtype, self.groups.host_of(owner), self.groups.lane_group)

    def reduce(self, message: torch.Tensor, owner: int, key: str) -> _TwoStage:
        """Starts the reduce of `message` into `owner`'s message; returns a handle to `wait()` for."""
        lane = self.groups.lane_of(owner)
        if self.mailboxes is not None:
            inner: object = self.mailboxes.reduce(message, lane, key)
        elif len(self.groups.layout.hosts[0]) == 1:
            inner = _Works([])  # one rank per host: nothing to sum within it
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

        handle = _TwoStage(message, inner, start_outer, self)
        self._in_flight.append(handle)
        self.progress()
        return handle

    def progress(self) -> None:
        """Starts stage 2 of every message whose stage 1 is done, in launch order (never out of it)."""
        while self._in_flight and self._in_flight[0].advance(block=False):
            self._in_flight.pop(0)

    def advance_through(self, handle: object) -> None:
        """Starts stage 2 of every message up to `handle` in launch order (blocking on stage 1 where needed), so
        that `handle` may be waited for before the end of backward without starting a stage 2 out of order."""
        if handle not in self._in_flight:
            return  # (its stage 2 started already)
        while self._in_flight:
            first = self._in_flight.pop(0)
            first.advance(block=True)
            if first is handle:
                return

    def finish(self) -> None:
        """Starts every remaining stage 2 in launch order (blocking on stage 1 where needed)."""
        for handle in self._in_flight:
            handle.advance(block=True)
        self._in_flight = []
