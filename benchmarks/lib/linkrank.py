"""What a rank of a benchmark across namespace hosts needs: the lr schedule, its interface's byte counter and the
held-out loss of a model."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn


def lr_at(step: int, steps: int, base: float) -> float:
    """Cosine decay from `base` at step 1 to 5% of it at step `steps`."""
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - 1) / max(1, steps - 1))))


def tx_bytes() -> int | None:
    """Bytes sent so far by this host's interface (None on loopback, which the ranks share)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return None if ifname == "lo" else int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


@torch.no_grad()
def held_out_loss(model: nn.Module, workload: Any, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    """`workload`'s loss of `model` on `data`, in eval mode (the model is left in train mode)."""
    model.eval()
    loss = workload.loss(model(data[0]), data[1]).item()
    model.train()
    return loss


def train_step(built: tuple[nn.Module, torch.optim.Optimizer, Any], workload: Any, batch: Any, lr: float) -> float:
    """One step on `batch` at learning rate `lr` with ``built = (module, optimizer, after_step or None)``: zero the
    gradients, forward, backward, the optimizer's step, then ``after_step()``; returns the loss."""
    wrapped, optimizer, after_step = built
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss = workload.loss(wrapped(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    if after_step is not None:
        after_step()
    return loss.item()
