"""Point-to-point exchanges (gossip), each send and receive recorded in `comm_stats`.

`exchange` posts every send and receive of one round at once and returns a handle; the transfers progress in
the backend's own threads while the caller computes, and `wait()` completes them. Ranks are ranks inside `group`
(as everywhere in ddpkit). Counting: a send of B bytes is kind ``send`` with payload B and B bytes on the wire;
a receive is kind ``recv`` with payload B and 0 bytes sent, so summing ``sent_bytes`` over ranks counts every
byte once.

On gloo, whose point-to-point calls take CPU tensors only, a CUDA tensor is staged: it is copied to a CPU buffer
before sending, and received into a CPU buffer that `wait()` copies to the device. On NCCL the CUDA tensors go
as they are, in one batch (`torch.distributed.batch_isend_irecv`), as NCCL needs for sends and receives between
the same ranks in both directions.

On gloo every receive is posted before any send. gloo starts a send's data as soon as the peer has announced
the matching receive, and the announcement of this rank's own receive travels on the same connection behind
whatever was queued before it. So when two ranks exchange with each other and each posted its send first, the
second announcement could wait behind a whole message and the two messages crossed one after the other: a round
would take twice the link time.

A round that is never waited for (a model dropped while its gossip is in flight) must not take its pending
transfers with it: gloo leaves the group's connections unusable when a pending send or receive is destroyed (the
next exchange on the group hangs). So every exchange stays referenced here until waited for, and the next
exchange on the same group first waits for any left over (they completed long ago: every rank posted its side).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from ddpkit.distributed.comm import nbytes
from ddpkit.distributed.env import ProcessGroup, backend_name, global_rank, group_label
from ddpkit.distributed.stats import comm_stats


def _is_nccl(group: ProcessGroup | None) -> bool:
    """Whether CUDA tensors go to NCCL as they are (else through host copies on gloo)."""
    return backend_name(group, "cuda") == "nccl"


class Exchange:
    """The pending sends and receives of one round; `wait()` completes them and fills the receive tensors."""

    def __init__(
        self, label: str, works: list, copies: list[tuple[torch.Tensor, torch.Tensor]], keep: list[torch.Tensor]
    ) -> None:
        self.label, self.works, self.copies, self._keep = label, works, copies, keep
        _unfinished[label].append(self)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        for device_tensor, staged in self.copies:
            device_tensor.copy_(staged)
        self.works, self.copies, self._keep = [], [], []
        if self in _unfinished[self.label]:
            _unfinished[self.label].remove(self)


_unfinished: defaultdict[str, list[Exchange]] = defaultdict(list)


def _stage(tensor: torch.Tensor, nccl: bool) -> torch.Tensor:
    """The tensor the backend can take: the tensor itself, or a CPU copy of a CUDA tensor on gloo."""
    if tensor.device.type == "cpu" or nccl:
        return tensor
    return tensor.to("cpu")


def exchange(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    group: ProcessGroup | None,
    tag: int,
) -> Exchange:
    """Sends each ``(tensor, dst)`` and receives into each ``(tensor, src)``; returns the pending `Exchange`.

    A sent tensor must not change until `wait()`; a receive tensor holds the message only after it.
    """
    nccl = _is_nccl(group)
    label = group_label(group)
    for left_over in list(_unfinished[label]):
        left_over.wait()
    staged_sends = [(_stage(tensor, nccl), dst) for tensor, dst in sends]
    staged_recvs = [
        (tensor if tensor.device.type == "cpu" or nccl else torch.empty_like(tensor, device="cpu"), src)
        for tensor, src in recvs
    ]
    for tensor, _ in staged_sends:
        comm_stats.record("send", label, nbytes(tensor), float(nbytes(tensor)))
    for tensor, _ in staged_recvs:
        comm_stats.record("recv", label, nbytes(tensor), 0.0)
    copies = [(t, s) for (t, _), (s, _) in zip(recvs, staged_recvs, strict=True) if s is not t]
    if nccl:
        ops = [dist.P2POp(dist.isend, t, global_rank(group, dst), group, tag) for t, dst in staged_sends]
        ops += [dist.P2POp(dist.irecv, t, global_rank(group, src), group, tag) for t, src in staged_recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
    else:  # receives first: see the module doc
        works = [dist.irecv(t, global_rank(group, src), group=group, tag=tag) for t, src in staged_recvs]
        works += [dist.isend(t, global_rank(group, dst), group=group, tag=tag) for t, dst in staged_sends]
    return Exchange(label, works, copies, [t for t, _ in staged_sends])
