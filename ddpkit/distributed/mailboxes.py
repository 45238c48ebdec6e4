"""Reduce to one rank through shared-memory mailboxes, for the ranks of one host (ShardedDataParallel's gradients).

Over gloo, a point-to-point reduce moves each sender's tensor through the kernel's TCP loopback: a copy into the
socket, a copy out into the root's receive buffer, then the root adds it. On one host the sender can instead copy
the tensor into a *mailbox*, a shared-memory segment it owns, and tell the root with a one-byte message; the root
adds straight out of the mailbox (in rank order, so the sum is bit for bit the one of the socket path) and answers
with a one-byte acknowledgement. Waiting for a reduce means, on a sender, waiting for that acknowledgement too:
once every rank has waited for its reduces nothing is left in flight, so a process group destroyed afterwards has
no pending message.

Mailboxes are reused: each sender keeps `SLOTS` per root, used in turn, each as large as the largest message put
in it (made anew, under a new version, when a larger one comes); the signal byte names the slot and its version,
so the root maps the right one. The root adds as soon as it starts its side of a reduce (waiting there for the
senders' signals), and a sender refills a slot only after the root acknowledged what it held: the mailboxes a rank
holds are bounded by `SLOTS` messages per root, not by the messages of a step. Every rank reduces in the same order
(a collective), so a rank that waits is waiting for ranks behind it, which never wait for it: no cycle.

Per reduce and sender: one memcpy of the tensor, 1 byte each way on the wire. Memory: per sender and root at most
`SLOTS` mailboxes of the largest message; the root maps them and needs no receive buffers. Mailbox files are
unlinked by the root as soon as it mapped them.

CommStats: kind ``shared_memory``; a sender's payload is the tensor, each side's sent bytes are its signals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddpkit.distributed import comm
from ddpkit.distributed.env import ProcessGroup, global_rank, group_label, group_rank, group_size
from ddpkit.distributed.shared_memory import SharedSegments
from ddpkit.distributed.stats import comm_stats


class _Posted:
    """A sender's reduce in flight: its 1-byte "mailbox full" signal and the root's 1-byte acknowledgement that it
    added the mailbox. `wait()` returns once both have arrived (the buffers stay referenced until then)."""

    def __init__(self, signal: object, signal_byte: torch.Tensor, ack: object, ack_byte: torch.Tensor) -> None:
        self.works: list[object] = [signal, ack]
        self.bytes = (signal_byte, ack_byte)

    def wait(self) -> bool:
        for work in self.works:
            work.wait()  # type: ignore[attr-defined]
        self.works = []
        return True

    @property
    def pending(self) -> bool:
        return bool(self.works)

    def sent(self) -> bool:
        """The tensor was copied into the mailbox when the reduce was posted: the sender may free it at once."""
        return True

    def wait_sent(self) -> None:
        """Nothing to wait for (`sent`); the acknowledgement is waited for with the reduce."""


class _Collected:
    """The root's pending receipt of every sender's signal: `wait()` adds the mailboxes and acknowledges them."""

    def __init__(self, owner: MailboxReduce, tensor: torch.Tensor, key: str, tag: int, works: list, flags: list):
        self.owner, self.tensor, self.key, self.tag = owner, tensor, key, tag
        self.works, self.flags = works, flags

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        if self.works:
            self.owner.add_and_acknowledge(self.tensor, self.flags, self.tag)
            self.works = []
        self.tensor = None  # type: ignore[assignment]  (added: the root's own holders keep its tensor as needed)
        return True


class MailboxReduce:
    """SUM-reduces CPU tensors to a root of the same host through shared-memory mailboxes (see the module doc).

    Build it with `agree` (collective); `reduce` must then be called in the same order on every rank, like any
    collective, with a `key` naming the message (the same key for the same message every step).
    """

    def __init__(self, group: ProcessGroup | None, segments: SharedSegments) -> None:
        self.group, self.segments = group, segments
        self.rank, self.world_size = group_rank(group), group_size(group)
        self._slots: dict[int, list[_Slot]] = {}  # per root: this rank's mailboxes to it, used in turn
        self._turn: dict[int, int] = {}
        self._inbox: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # (sender, slot) -> (version, mapping)

    @classmethod
    def agree(cls, group: ProcessGroup | None, nbytes: int) -> MailboxReduce | None:
        """Collective: a MailboxReduce when every rank of `group` is on one host with room for `nbytes`, else None."""
        segments = SharedSegments.agree(group, nbytes) if nbytes else None
        return cls(group, segments) if segments is not None else None

    def reduce(self, tensor: torch.Tensor, dst: int, key: str) -> object:
        """Starts the reduce of `tensor` into group rank `dst`'s `tensor`; returns a handle to `wait()` for."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return comm.reduce(tensor, dst, self.group, async_op=True)
        key = f"{key}-{tensor.numel()}-{str(tensor.dtype).removeprefix('torch.')}"
        tag = comm.next_p2p_tag(self.group)
        if self.rank != dst:
            return self._post(tensor, dst, key, tag)
        flags = [torch.zeros(1, dtype=torch.uint8) for _ in range(self.world_size - 1)]
        works = [
            dist.irecv(flag, global_rank(self.group, src), group=self.group, tag=tag)
            for src, flag in zip(self._senders(), flags, strict=True)
        ]
        collected = _Collected(self, tensor, key, tag, works, flags)
        collected.wait()  # the root adds at once: its senders' mailboxes are free again (see the module doc)
        return collected

    def _senders(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _name(self, root: int, slot: int, version: int) -> str:
        return f"mailbox-to{root}-{slot}-v{version}"

    def _post(self, tensor: torch.Tensor, dst: int, key: str, tag: int) -> _Posted:
        slots = self._slots.setdefault(dst, [_Slot() for _ in range(SLOTS)])
        index = self._turn.get(dst, 0)
        self._turn[dst] = (index + 1) % SLOTS
        slot = slots[index]
        if slot.posted is not None:
            slot.posted.wait()  # the root has added what this mailbox held (owners add as they reach a bucket)
        nbytes = comm.nbytes(tensor)
        if slot.box is None or slot.box.numel() < nbytes:  # a larger message: a larger mailbox, a new version
            slot.version = (slot.version + 1) % VERSIONS
            slot.box = self.segments.create(self._name(dst, index, slot.version), nbytes, torch.uint8)
        slot.box[:nbytes].view(tensor.dtype).copy_(tensor.view(-1))
        peer = global_rank(self.group, dst)
        signal = torch.tensor([1 + index + SLOTS * slot.version], dtype=torch.uint8)
        ack = torch.zeros(1, dtype=torch.uint8)
        slot.posted = _Posted(
            dist.isend(signal, peer, group=self.group, tag=tag),
            signal,
            dist.irecv(ack, peer, group=self.group, tag=tag),
            ack,
        )
        comm_stats.record("shared_memory", group_label(self.group), comm.nbytes(tensor), 1.0)
        return slot.posted

    def add_and_acknowledge(self, tensor: torch.Tensor, flags: list[torch.Tensor], tag: int) -> None:
        """Root: adds every sender's mailbox (the slot its signal `flags` names) into `tensor` in rank order, then
        tells each sender it may refill."""
        flat = tensor.view(-1)
        nbytes = comm.nbytes(flat)
        for sender, flag in zip(self._senders(), flags, strict=True):
            slot, version = divmod(int(flag.item()) - 1, SLOTS)[::-1]
            flat.add_(self._mailbox(sender, slot, version)[:nbytes].view(flat.dtype))
        ack = torch.ones(1, dtype=torch.uint8)
        works = [dist.isend(ack, global_rank(self.group, s), group=self.group, tag=tag) for s in self._senders()]
        for work in works:  # each sender posted its receive with its signal: gloo never keeps an unwaited send
            work.wait()
        comm_stats.record("shared_memory", group_label(self.group), 0, float(self.world_size - 1))

    def forget(self, prefix: str) -> int:
        """Waits for every signal and acknowledgement still in flight (the messages named `prefix` will not be sent
        again; the mailboxes themselves are reused by the next ones); returns how many were waited for."""
        pending = [s.posted for slots in self._slots.values() for s in slots if s.posted is not None]
        for posted in pending:
            posted.wait()
        return len(pending)

    def held(self) -> int:
        """How many mailboxes this rank maps (its own and the ones it reads)."""
        return sum(s.box is not None for slots in self._slots.values() for s in slots) + len(self._inbox)

    def pending(self) -> int:
        """How many of this rank's reduces still have a signal or acknowledgement in flight (0 once every
        handle `reduce` returned has been waited for)."""
        return sum(1 for slots in self._slots.values() for s in slots if s.posted is not None and s.posted.pending)

    def _mailbox(self, sender: int, slot: int, version: int) -> torch.Tensor:
        """Sender `sender`'s mailbox `slot` at `version`, mapped (again when the sender made a larger one)."""
        held = self._inbox.get((sender, slot))
        if held is None or held[0] != version:
            name = f"mailbox-to{self.rank}-{slot}-v{version}"
            box = self.segments.attach(name, sender, self.segments.size(name, sender), torch.uint8)
            self.segments.remove(name, sender)
            held = self._inbox[(sender, slot)] = (version, box)
        return held[1]


@dataclass
class _Slot:
    """One of a sender's mailboxes to one root: the segment (`box`, bytes), its version, the last reduce it held."""

    box: torch.Tensor | None = None
    version: int = -1
    posted: _Posted | None = None


SLOTS = 2
"""Mailboxes per sender and root, used in turn."""
VERSIONS = 127
"""Versions a slot's name cycles through (the signal byte carries 1 + slot + SLOTS x version, at most 255)."""
