"""Flat buffers: many tensors packed into one message, and unpacked again."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ddpkit.distributed import comm
from ddpkit.distributed.env import ProcessGroup, group_rank


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One new 1-D tensor holding `tensors` back to back (cast to `dtype` if given)."""
    if not tensors:
        raise ValueError("flatten: needs at least one tensor")
    out_dtype = dtype or tensors[0].dtype
    out = torch.empty(sum(t.numel() for t in tensors), dtype=out_dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].copy_(t.reshape(-1))
        offset += n
    return out


def views(flat: torch.Tensor, shapes: Iterable[torch.Size]) -> list[torch.Tensor]:
    """Views of consecutive slices of `flat` with the given shapes."""
    out = []
    offset = 0
    for shape in shapes:
        n = shape.numel()
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copies consecutive slices of `flat` into `tensors` (casting to each tensor's dtype)."""
    for t, v in zip(tensors, views(flat, [t.shape for t in tensors]), strict=True):
        t.copy_(v)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group: ProcessGroup | None = None) -> None:
    """Gives every rank `src`'s values of `tensors`: one flat broadcast per (device type, dtype), then unpacked."""
    if not tensors:
        return
    by_kind: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device.type, t.dtype), []).append(t)
    messages = [(flatten(group_tensors), group_tensors) for group_tensors in by_kind.values()]
    comm.wait_all([comm.broadcast(flat, src, group, async_op=True) for flat, _ in messages])
    if group_rank(group) != src:
        with torch.no_grad():
            for flat, group_tensors in messages:
                unflatten_into(flat, group_tensors)
