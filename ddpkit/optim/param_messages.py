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

Memory: building the messages (first step) briefly holds one message's parameters twice, then nothing extra.
Because parameters share storage, ``torch.save`` of *some* parameters (e.g. one layer's ``state_dict()``) writes
the whole buffer they are views of; save ``{k: v.clone() ...}`` for a part of the model (a whole model's
``state_dict()`` is no larger than usual).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddpkit.distributed import comm
from ddpkit.distributed.buckets import views
from ddpkit.distributed.env import ProcessGroup

Plan = list[tuple[int, list[torch.Tensor]]]
"""(owner, parameters) per message, in the same order on every rank."""


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
    wire: torch.Tensor  # `flat` itself, or a persistent fp16 copy when sending in fp16

    @classmethod
    def build(cls, owner: int, params: list[torch.Tensor], fp16: bool) -> ParamMessage:
        """Copies the parameters' current values into a new flat buffer and makes them views of it."""
        first = params[0]
        flat = torch.empty(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        slots = views(flat, [p.shape for p in params])
        message = cls(owner, params, flat, slots, flat)
        if fp16 and first.dtype == torch.float32:
            message.wire = torch.empty(flat.numel(), dtype=torch.float16, device=flat.device)
        for p, slot in zip(params, slots, strict=True):
            slot.copy_(p.detach())
            if p.is_contiguous():
                p.data = slot
        return message

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

    def release(self, keep: set[torch.Tensor]) -> None:
        """Parameters not in `keep` that are still views of this buffer get storage of their own."""
        for p, slot in zip(self.params, self.slots, strict=True):
            if p not in keep and _is_view_of(p, slot):
                p.data = p.detach().clone()


class ParamBroadcaster:
    """Keeps the messages of a plan and broadcasts them: every owner's message to every rank, all in flight at once.

    Communication: one broadcast per message (owner, device, dtype). Memory: none beyond the parameters
    themselves (their storage *is* the messages), plus a persistent fp16 copy of each message with `fp16`.
    """

    def __init__(self, rank: int, group: ProcessGroup | None, fp16: bool) -> None:
        self.rank, self.group, self.fp16 = rank, group, fp16
        self.messages: list[ParamMessage] = []
        self._signature: tuple = ()

    def broadcast(self, plan: Plan) -> None:
        # A message's parameters share a device and dtype: moving them (``module.to(...)``) changes the signature.
        signature = tuple((owner, params[0].device, params[0].dtype, *map(id, params)) for owner, params in plan)
        if signature != self._signature:
            self._rebuild(plan)
            self._signature = signature
        for message in self.messages:
            if message.owner == self.rank:
                message.stage()
        works = [comm.broadcast(m.wire, m.owner, self.group, async_op=True) for m in self.messages]
        comm.wait_all(works)
        for message in self.messages:
            if message.owner != self.rank:
                message.unpack()

    def _rebuild(self, plan: Plan) -> None:
        keep = {p for _, params in plan for p in params}
        for message in self.messages:
            message.release(keep)
        self.messages = [ParamMessage.build(owner, params, self.fp16) for owner, params in plan]
