"""Python values (optimizer state, settings, reports) sent between ranks as uint8 tensors, so every byte is
counted; encoded as JSON and raw tensor bytes (`ddpkit.distributed.wire_format`), never pickled."""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.distributed import comm, wire_format
from ddpkit.distributed.env import ProcessGroup, comm_device, group_rank, group_size


def _to_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    return wire_format.encode(obj).to(device)


def _from_tensor(data: torch.Tensor) -> Any:
    return wire_format.decode(data)


def broadcast_object(obj: Any, src: int, group: ProcessGroup | None = None) -> Any:
    """Returns `src`'s `obj` on every rank: one broadcast of its size, one of its bytes."""
    device = comm_device(group)
    is_src = group_rank(group) == src
    data = _to_tensor(obj, device) if is_src else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=device)
    comm.broadcast(size, src, group)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    comm.broadcast(data, src, group)
    return obj if is_src else _from_tensor(data)


def gather_objects(obj: Any, dst: int, group: ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on group rank `dst` (None elsewhere); `dst=-1` gives it to all.

    One all-gather of the sizes, then one gather (or all-gather) of the bytes padded to the largest size.
    """
    device = comm_device(group)
    n = group_size(group)
    me = group_rank(group)
    data = _to_tensor(obj, device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    comm.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    if dst == -1:
        outputs = [torch.empty_like(padded) for _ in range(n)]
        comm.all_gather(outputs, padded, group)
    else:
        outputs = [torch.empty_like(padded) for _ in range(n)] if me == dst else None
        comm.gather(padded, outputs, dst, group, is_root=me == dst)
        if outputs is None:
            return None
    return [_from_tensor(out[: int(size.item())]) for out, size in zip(outputs, sizes, strict=True)]
