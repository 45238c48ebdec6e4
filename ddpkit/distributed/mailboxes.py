"""Reduce to one rank through shared-memory mailboxes, for the ranks of one host (ShardedDataParallel's gradients).

Over gloo, a point-to-point reduce moves each sender's tensor through the kernel's TCP loopback: a copy into the
socket, a copy out into the root's receive buffer, then the root adds it. On one host the sender can instead copy
the tensor into a *mailbox*, a shared-memory segment it owns (one per message key and root, reused every step),
and tell the root with a one-byte message; the root adds straight out of the mailbox (in rank order, so the sum is
bit for bit the one of the socket path) and answers with a one-byte acknowledgement. Waiting for a reduce means, on
a sender, waiting for that acknowledgement too: once every rank has waited for its reduces nothing is left in
flight, so a process group destroyed afterwards has no pending message (and a mailbox is never refilled before
the root has read it).

Per reduce and sender: one memcpy of the tensor, 1 byte each way on the wire. Memory: each sender keeps a mailbox
per key it sends (together about the gradients it does not own); the root maps them and needs no receive buffers.
Mailbox files are unlinked by the root as soon as it mapped them.

CommStats: kind ``shared_memory``; a sender's payload is the tensor, each side's sent bytes are its signals.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.distributed import comm
from ddpkit.distributed.env import ProcessGroup, global_rank, group_label, group_rank, group_size
from ddpkit.distributed.shared_memory import SharedSegments, release_pages
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
            self.owner.add_and_acknowledge(self.tensor, self.key, self.tag)
            self.works = []
        return True


class MailboxReduce:
    """SUM-reduces CPU tensors to a root of the same host through shared-memory mailboxes (see the module doc).

    Build it with `agree` (collective); `reduce` must then be called in the same order on every rank, like any
    collective, with a `key` naming the message (the same key for the same message every step).
    """

    def __init__(self, group: ProcessGroup | None, segments: SharedSegments) -> None:
        self.group, self.segments = group, segments
        self.rank, self.world_size = group_rank(group), group_size(group)
        self._outbox: dict[tuple[str, int], tuple[torch.Tensor, _Posted | None]] = {}
        self._inbox: dict[tuple[str, int], torch.Tensor] = {}

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
        return _Collected(self, tensor, key, tag, works, flags)

    def _senders(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _name(self, key: str, sender: int) -> str:
        return f"mailbox-{key}-{sender}"

    def _post(self, tensor: torch.Tensor, dst: int, key: str, tag: int) -> _Posted:
        box, previous = self._outbox.get((key, dst), (None, None))
        if box is None:
            box = self.segments.create(self._name(key, self.rank), tensor.numel(), tensor.dtype)
        elif previous is not None:
            previous.wait()  # the root has added what this mailbox held last time (normally waited for long ago)
        box.copy_(tensor.view(-1))
        peer = global_rank(self.group, dst)
        signal, ack = torch.ones(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
        posted = _Posted(
            dist.isend(signal, peer, group=self.group, tag=tag),
            signal,
            dist.irecv(ack, peer, group=self.group, tag=tag),
            ack,
        )
        self._outbox[(key, dst)] = (box, posted)
        comm_stats.record("shared_memory", group_label(self.group), comm.nbytes(tensor), 1.0)
        return posted

    def add_and_acknowledge(self, tensor: torch.Tensor, key: str, tag: int) -> None:
        """Root: adds every sender's mailbox into `tensor` in rank order, then tells each sender it may refill."""
        flat = tensor.view(-1)
        for sender in self._senders():
            box = self._mailbox(key, sender, flat)
            flat.add_(box)
            release_pages(box)  # its memory goes back until the sender fills it again, next step
        ack = torch.ones(1, dtype=torch.uint8)
        works = [dist.isend(ack, global_rank(self.group, s), group=self.group, tag=tag) for s in self._senders()]
        for work in works:  # each sender posted its receive with its signal: gloo never keeps an unwaited send
            work.wait()
        comm_stats.record("shared_memory", group_label(self.group), 0, float(self.world_size - 1))

    def forget(self, prefix: str) -> int:
        """Drops every mailbox whose key starts with `prefix` (messages that will not be sent again), after any
        signal or acknowledgement of theirs still in flight; returns how many. Their memory goes with the last
        mapping (the files were unlinked when mapped)."""
        outgoing = [k for k in self._outbox if k[0].startswith(prefix)]
        for key in outgoing:
            _, posted = self._outbox.pop(key)
            if posted is not None:
                posted.wait()
        incoming = [k for k in self._inbox if k[0].startswith(prefix)]
        for key in incoming:
            del self._inbox[key]
        return len(outgoing) + len(incoming)

    def held(self) -> int:
        """How many mailboxes this rank maps (its own and the ones it reads)."""
        return len(self._outbox) + len(self._inbox)

    def pending(self) -> int:
        """How many of this rank's reduces still have a signal or acknowledgement in flight (0 once every
        handle `reduce` returned has been waited for)."""
        return sum(1 for _, posted in self._outbox.values() if posted is not None and posted.pending)

    def _mailbox(self, key: str, sender: int, like: torch.Tensor) -> torch.Tensor:
        box = self._inbox.get((key, sender))
        if box is None:
            name = self._name(key, sender)
            box = self._inbox[(key, sender)] = self.segments.attach(name, sender, like.numel(), like.dtype)
            self.segments.remove(name, sender)
        return box
