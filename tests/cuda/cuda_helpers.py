"""Helpers shared by the `cuda` test set (tests/cuda): models, batches, comparisons and the device context."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ddpkit.distributed import comm
from ddpkit.distributed.shared_memory import ENV_VAR as SHARED_MEMORY_ENV
from ddpkit.testing import rank_device
from ddpkit.train.workloads import models

SHAPE = (16, 8, 64, 2)  # features, outputs, hidden width, hidden layers


@contextmanager
def placed(device: str) -> Iterator[torch.device]:
    """In a rank: yields its device. For the CPU dry run, makes ddpkit take CUDA's path and undoes it after."""
    if device != "cpu":
        yield rank_device()
        return
    old_env, old_flag = os.environ.get(SHARED_MEMORY_ENV), comm._STAGE_CPU_TENSORS
    os.environ[SHARED_MEMORY_ENV] = "0"
    comm._STAGE_CPU_TENSORS = True
    try:
        yield torch.device("cpu")
    finally:
        comm._STAGE_CPU_TENSORS = old_flag
        if old_env is None:
            os.environ.pop(SHARED_MEMORY_ENV, None)
        else:
            os.environ[SHARED_MEMORY_ENV] = old_env


def mlp(device: torch.device, seed: int = 0, shape: tuple[int, int, int, int] = SHAPE) -> nn.Module:
    """`ddpkit train`'s MLP, the same on every rank (built on CPU from `seed`, then moved: the same values on every
    device)."""
    torch.manual_seed(seed)
    return models.mlp(*shape).to(device)


def batch(rank: int, step: int, device: torch.device, rows: int = 8, shape: tuple[int, ...] = SHAPE):
    """Rank `rank`'s batch at `step` (made on CPU, so every device gets the same numbers)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(rows, shape[0], generator=g), torch.randn(rows, shape[1], generator=g)
    return x.to(device), y.to(device)


def flat(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The parameters as one float64 CPU vector."""
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in params])


def max_diff(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    return (flat(a) - flat(b)).abs().max().item()


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_devices(optimizer: torch.optim.Optimizer) -> list[str]:
    """The device types of an optimizer's per-parameter state tensors (step counters aside)."""
    kinds = {v.device.type for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
    return sorted(kinds)
