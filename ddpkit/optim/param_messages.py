"""OSS's parameter broadcast: each owner's parameters live in one persistent flat buffer that is the message.

After the local optimizer stepped, every rank must receive the shards it does not own. Packing them into a fresh
flat buffer each step (and unpacking on arrival) costs two passes over the model and, on CPU, page faults on every
new buffer, which together took longer than the transfer itself on the benchmark machine. Instead every trainable
contiguous parameter is made a view into the flat buffer of its message once (``param.data = slot``), so the owner
sends its parameters where they are and receivers receive straight into theirs: no copy, no allocation per step.

Parameters that cannot be views (not contiguous, or replaced by the user since, e.g. by ``module.to(...)``) keep
their own storage and are copied into their slot before sending / out of it after receiving, and are adopted again
when possible. When the set of trainable parameters, their devices or their dtypes change, the messages are
rebuilt; parameters that leave every message get back storage of their own.

Memory: building the messages (first step, before the optimizer's state exists: `prepare`) briefly holds one
message's parameters twice, then nothing extra.
Because parameters share storage, ``torch.save`` of *some* parameters (e.g. one layer's ``state_dict()``) writes
the whole buffer they are views of; save ``{k: v.clone() ...}`` for a part of the model (a whole model's
``state_dict()`` is no larger than usual).

Over sockets every rank posts its receives before its sends (`comm.broadcast_many`): a receive posted after this
rank's own outgoing message queued its ready notice behind that message, so the owners' messages crossed the link
one after the other instead of both ways at once.

On one host (see `ddpkit.distributed.shared_memory`), a CPU message is not sent at all: the owner's buffer (its
fp16 copy with `broadcast_fp16`) is a shared-memory segment, so the owner's optimizer step writes it in place; after
a barrier every other rank copies it into its own parameters' buffer, and a second barrier tells the owner it may
write again. Every rank still holds its own replica, exactly as with a broadcast.

On several hosts (`hierarchical`, see `ddpkit.distributed.hosts`), delivery has two stages: each owner broadcasts
its messages over its lane group (one rank per host), then on every host the rank in the owner's lane delivers
them to its host's ranks as if it owned them (shared memory, or the host group's sockets). A message thus crosses
between hosts once per other host.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ddpkit.distributed import comm, hosts, shared_memory
from ddpkit.distributed.buckets import views
from ddpkit.distributed.env import ProcessGroup, group_size
from ddpkit.distributed.shared_memory import SharedSegments

Plan = list[tuple[int, list[torch.Tensor], bool]]
"""(owner, tensors, in place) per message, in the same order on every rank. An in-place message is one tensor
that already is the message (a piece of a split parameter, viewing that parameter's storage): it is sent and
received where it is, and never made a view of a buffer of the broadcaster's."""


def _is_view_of(param: torch.Tensor, slot: torch.Tensor) -> bool:
    return (
        param.device == slot.device
        and param.data_ptr() == slot.data_ptr()
        and param.shape == slot.shape
        and param.dtype == slot.dtype
        and param.is_contiguous()
    )


@dataclass
class ParamMessage:
    """One owner's parameters of one device and dtype, in one flat buffer (`flat`) sent as `wire`."""

    owner: int
    params: list[torch.Tensor]
    flat: torch.Tensor
    slots: list[torch.Tensor]
    wire: torch.Tensor  # `flat` itself, a persistent fp16 copy with `broadcast_fp16`, or the owner's segment
    shared: bool = False  # `wire` is a shared-memory segment (owner: its own; others: the owner's, mapped)

    @classmethod
    def build(cls, owner: int, params: list[torch.Tensor], flat: torch.Tensor, wire: torch.Tensor) -> ParamMessage:
        """Copies the parameters' current values into `flat` and makes them views of it (nothing to do when
        `flat` is the one parameter itself: an in-place message)."""
        if len(params) == 1 and flat is params[0]:
            return cls(owner, params, flat, [flat], wire)
        slots = views(flat, [p.shape for p in params])
        for p, slot in zip(params, slots, strict=True):
            slot.copy_(p.detach())
            if p.is_contiguous():
                p.data = slot
        return cls(owner, params, flat, slots, wire)

    @property
    def buffer(self) -> torch.Tensor:
        """fairscale's name for a bucket's flat buffer (`flat`): its tests read ``bucket.buffer``."""
        return self.flat

    def stage(self) -> None:
        """Owner, before sending: stray parameters go into their slots (and everything into the fp16 wire)."""
        for p, slot in zip(self.params, self.slots, strict=True):
            if not _is_view_of(p, slot):
                slot.copy_(p.detach())
                self._adopt(p, slot)
        if self.wire is not self.flat:
            self.wire.copy_(self.flat)

    def unpack(self) -> None:
        """After receiving: values into the flat buffer (from fp16), and into parameters that are not views."""
        if self.wire is not self.flat:
            self.flat.copy_(self.wire)
        for p, slot in zip(self.params, self.slots, strict=True):
            if not _is_view_of(p, slot):
                p.detach().copy_(slot)
                self._adopt(p, slot)

    @staticmethod
    def _adopt(param: torch.Tensor, slot: torch.Tensor) -> None:
        if param.is_contiguous() and param.device == slot.device and param.dtype == slot.dtype:
            param.data = slot

    def share_owners_pages(self) -> None:
        """A receiver's parameters become views of the owner's mapped segment (`wire`): one copy per host. Their
        values are the owner's already (replicas are equal when the messages are built)."""
        self.flat = self.wire
        self.slots = views(self.wire, [p.shape for p in self.params])
        for p, slot in zip(self.params, self.slots, strict=True):
            if p.is_contiguous():
                p.data = slot

    def release(self, keep: set[torch.Tensor]) -> None:
        """Parameters not in `keep` that are still views of this buffer get storage of their own."""
        for p, slot in zip(self.params, self.slots, strict=True):
            if p not in keep and _is_view_of(p, slot):
                p.data = p.detach().clone()


class ParamBroadcaster:
    """Keeps the messages of a plan and delivers them: every owner's message to every rank, all in flight at once.

    Communication per step: one broadcast per message (owner, device, dtype); on one host, CPU messages instead
    go through shared memory (two barriers, and each rank copies the messages it does not own; CommStats kind
    ``shared_memory``). A rebuild (first step, or when the plan changes) costs an object all-gather (on a gloo
    group) to agree on shared memory, and two barriers when it is used. Memory: none beyond the parameters
    themselves (their storage *is* the messages), plus a persistent fp16 copy of each message with `fp16`.
    """

    def __init__(
        self,
        rank: int,
        group: ProcessGroup | None,
        fp16: bool,
        hierarchical: bool | None = None,
        share_pages: bool = False,
    ) -> None:
        self.rank, self.group, self.fp16, self.share_pages = rank, group, fp16, share_pages
        self.hierarchical = hierarchical
        self.messages: list[ParamMessage] = []
        self._sources: list[int] = []  # per message, the rank (of `group`) that owns it
        self._signature: tuple = ()
        self._segments: SharedSegments | None = None
        self._decided = False  # whether shared memory over the whole group, or hosts, were looked at yet
        self._hosts: hosts.HostGroups | None = None
        # Where messages are delivered by their (local) owners: the whole group, or this rank's host (hierarchical).
        self._local_rank, self._local_group = rank, group

    def prepare(self, plan: Plan) -> None:
        """Builds the messages for `plan` if it changed since the last build (collective, like `broadcast`, which
        calls it). OSS calls it before its local optimizer first steps: the parameters move into their buffers
        while no optimizer state exists yet, so the move's transient copy (one message) adds to less."""
        # A message's parameters share a device and dtype: moving them (``module.to(...)``) changes the signature.
        # An in-place message is its tensor's storage: a new storage (the parameter moved) rebuilds it.
        signature = tuple(
            (owner, params[0].device, params[0].dtype, in_place and params[0].data_ptr(), *map(id, params))
            for owner, params, in_place in plan
        )
        if signature != self._signature:
            self._rebuild(plan)
            self._signature = signature

    def broadcast(self, plan: Plan) -> None:
        self.prepare(plan)
        for message, source in zip(self.messages, self._sources, strict=True):
            if source == self.rank:
                message.stage()
        if self._hosts is not None:
            self._across_hosts(self._hosts)
        # Receives first (`comm.broadcast_many`): over sockets, owners' messages then flow both ways at once.
        pairs = [(m.wire, m.owner) for m in self.messages if not m.shared]
        comm.wait_all(comm.broadcast_many(pairs, self._local_group))
        any_shared = any(m.shared for m in self.messages)
        if any_shared:
            comm.barrier(self._local_group)  # every owner's segment holds its new values
        for message in self.messages:
            if message.owner != self._local_rank:
                message.unpack()
                if message.shared:
                    shared_memory.record_copy(comm.nbytes(message.wire), self._local_group)
        if any_shared:
            comm.barrier(self._local_group)  # every rank has copied: owners may write their parameters again

    def _across_hosts(self, groups: hosts.HostGroups) -> None:
        """Hierarchical: each owner sends its messages once to every other host, to the rank in its own lane,
        which then delivers them on its host like an owner (see `ddpkit.distributed.hosts`)."""
        lane = [
            (m, source)
            for m, source in zip(self.messages, self._sources, strict=True)
            if groups.lane_of(source) == groups.lane
        ]
        comm.wait_all(comm.broadcast_many([(m.wire, groups.host_of(source)) for m, source in lane], groups.lane_group))
        for message, source in lane:
            if source != self.rank:
                message.unpack()  # into this rank's own parameters, where they are not the message itself

    def _rebuild(self, plan: Plan) -> None:
        keep = {p for _, params, _ in plan for p in params}
        for message in self.messages:
            message.release(keep)
        segments = self._segments = self._segments_for(plan)
        if self.share_pages:
            self._check_sharing(segments)
        self._sources = [owner for owner, _, _ in plan]
        if self._hosts is not None:  # delivered on each host by the rank in the owner's lane
            plan = [(self._hosts.lane_of(owner), params, in_place) for owner, params, in_place in plan]
        self.messages = [self._build(index, entry, segments) for index, entry in enumerate(plan)]
        if segments is not None:
            self._attach(segments)

    def _attach(self, segments: SharedSegments) -> None:
        """Every rank maps the segments of the messages it receives; the files go once all are mapped."""
        try:
            comm.barrier(self._local_group)  # every owner has created and filled its segments
            for index, message in enumerate(self.messages):
                if message.shared and message.owner != self._local_rank:
                    message.wire = segments.attach(
                        self._segment_name(index),
                        message.owner,
                        message.flat.numel(),
                        self._wire_dtype(message.flat.dtype),
                    )
            if self.share_pages and self._hosts is None and not self.fp16:  # one host: one copy of the parameters
                for message in self.messages:
                    in_place = message.slots[0] is message.params[0]  # a piece: it stays in its own parameter
                    if message.shared and message.owner != self._local_rank and not in_place:
                        message.share_owners_pages()
            comm.barrier(self._local_group)  # every segment is mapped by every rank that reads it
        finally:  # also when a peer failed: leave nothing in /dev/shm
            for index, message in enumerate(self.messages):
                if message.shared and message.owner == self._local_rank:
                    segments.remove(self._segment_name(index), self._local_rank)

    def _check_sharing(self, segments: SharedSegments | None) -> None:
        """`share_pages` where the layout lets it act: refused on every rank alike (the layout was agreed
        collectively) when the ranks are on several hosts or cannot share memory; a warning for a single rank."""
        if group_size(self.group) < 2:
            warnings.warn("OSS: shared_parameters has nothing to share with a single rank", stacklevel=4)
        elif self._hosts is not None:
            raise ValueError(
                f"OSS: shared_parameters holds the parameters once per host, but the {group_size(self.group)} ranks "
                "are on several hosts, where it cannot act: leave it off (ddpkit train: --shared-parameters needs "
                "--nnodes 1)"
            )
        elif segments is None:
            raise ValueError(
                "OSS: shared_parameters needs every rank on one host with room in /dev/shm, which this group's "
                "ranks do not have: leave it off"
            )

    def _segments_for(self, plan: Plan) -> SharedSegments | None:
        """Shared segments for this plan's CPU messages, or None (collective: every rank decides the same)."""
        nbytes = shared_memory.cpu_bytes(p for _, params, _ in plan for p in params)
        if not nbytes:
            return None
        if not self._decided:  # the first build: one host, several, or neither (collective on every rank alike)
            self._decided = True
            segments = SharedSegments.agree(self.group, nbytes)
            if segments is not None:
                return segments
            self._hosts = hosts.hierarchy(self.group, self.hierarchical, "OSS")
            if self._hosts is None:
                return None
            self._local_rank, self._local_group = self._hosts.lane, self._hosts.host_group
        return SharedSegments.agree(self._local_group, nbytes)

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if self.fp16 and dtype == torch.float32 else dtype

    def _segment_name(self, index: int) -> str:
        return str(index)

    def _build(
        self, index: int, entry: tuple[int, list[torch.Tensor], bool], segments: SharedSegments | None
    ) -> ParamMessage:
        owner, params, in_place = entry
        first = params[0]
        numel, dtype, wire_dtype = sum(p.numel() for p in params), first.dtype, self._wire_dtype(first.dtype)
        shared = segments is not None and first.device.type == "cpu"
        if shared and owner == self._local_rank:
            wire = segments.create(self._segment_name(index), numel, wire_dtype)
            flat = first if in_place else wire if wire_dtype == dtype else torch.empty(numel, dtype=dtype)
        else:
            flat = first if in_place else torch.empty(numel, dtype=dtype, device=first.device)
            wire = flat if wire_dtype == dtype or shared else torch.empty(numel, dtype=wire_dtype, device=first.device)
        message = ParamMessage.build(owner, params, flat, wire)
        message.shared = shared
        return message
