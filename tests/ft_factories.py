"""Factories for the fault-tolerant training tests: the digits MLP, slowed so that a run lasts long enough to
lose a rank and start it again while the others train on (`DDPKIT_TEST_STEP_SECONDS` per forward, default 0.02).

A test that restarts a lost machine can also hold training: while the file named by `DDPKIT_TEST_HOLD_FILE`
exists, every training forward waits. Removed once the restarted command says it is joining, it keeps a short run
from finishing before a restart that a loaded machine slowed down (the survivors still train every step)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn


class SlowMLP(nn.Module):
    """A 64-32-10 MLP whose forward also sleeps (the sleep stands for a bigger model's compute)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.pause = float(os.environ.get("DDPKIT_TEST_STEP_SECONDS", "0.02"))
        self.hold = os.environ.get("DDPKIT_TEST_HOLD_FILE", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(self.pause)
            while self.hold and os.path.exists(self.hold):
                time.sleep(0.05)
        return self.net(x.flatten(1))


def slow_mlp() -> nn.Module:
    return SlowMLP()
