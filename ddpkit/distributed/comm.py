"""The collectives ddpkit uses, each recorded in `comm_stats`.

Ranks given to these functions (`src`, `dst`) are ranks *inside* `group`, which is what every caller in ddpkit
thinks in (the owner of a shard is a rank of the optimizer's group). They are translated to the global ranks
torch expects. With ``async_op=True`` the torch work handle is returned; the bytes are counted when the
collective is issued.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.distributed.env import ProcessGroup, global_rank, group_label, group_size
from ddpkit.distributed.stats import comm_stats, wire_bytes

Work = object  # torch's work handle (torch.distributed.Work), kept opaque


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _record(kind: str, group: ProcessGroup | None, payload: int, is_root: bool = False) -> None:
    n = group_size(group)
    comm_stats.record(kind, group_label(group), payload, wire_bytes(kind, payload, n, is_root))


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Sends `tensor` from group rank `src` to every rank of `group` (in place on receivers)."""
    _record("broadcast", group, _nbytes(tensor))
    return dist.broadcast(tensor, global_rank(group, src), group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    group: ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Work | None:
    """Reduces `tensor` from every rank into group rank `dst` (only `dst`'s tensor holds the result)."""
    _record("reduce", group, _nbytes(tensor))
    return dist.reduce(tensor, global_rank(group, dst), op=op, group=group, async_op=async_op)


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Work | None:
    """Reduces `tensor` over `group` into every rank's copy."""
    _record("all_reduce", group, _nbytes(tensor))
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(
    outputs: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Gathers every rank's `tensor` into `outputs` on every rank."""
    _record("all_gather", group, _nbytes(tensor))
    return dist.all_gather(outputs, tensor, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    inputs: list[torch.Tensor],
    group: ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Work | None:
    """Reduces `inputs[i]` over the group into rank i's `output`."""
    _record("reduce_scatter", group, sum(_nbytes(t) for t in inputs))
    return dist.reduce_scatter(output, inputs, op=op, group=group, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    outputs: list[torch.Tensor] | None,
    dst: int,
    group: ProcessGroup | None = None,
    is_root: bool = False,
) -> None:
    """Gathers every rank's `tensor` into `outputs` on group rank `dst` (None elsewhere)."""
    _record("gather", group, _nbytes(tensor), is_root=is_root)
    dist.gather(tensor, outputs, dst=global_rank(group, dst), group=group)


def barrier(group: ProcessGroup | None = None) -> None:
    """Returns once every rank of `group` has called it (counted, with no payload)."""
    _record("barrier", group, 0)
    dist.barrier(group=group)


def wait_all(works: list[Work | None]) -> None:
    """Waits for every async collective in `works` (None entries are skipped)."""
    for work in works:
        if work is not None:
            work.wait()  # type: ignore[attr-defined]
