"""A rank's data for `ddpkit train`: its shard of the training set, the held-out set, and the run's length."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.utils.data import DataLoader

from ddpkit.train.settings.config import TrainConfig
from ddpkit.train.workloads.sampler import ResumableSampler
from ddpkit.train.workloads.workload import Workload


@dataclass
class RankData:
    """`loader`: this rank's shard of each epoch (`ResumableSampler` over `world_size` ranks); `heldout`: the whole
    held-out set; `total_steps`: the optimizer steps the run will take (--epochs, --grad-accum, --max-steps)."""

    loader: DataLoader
    heldout: DataLoader
    total_steps: int


def rank_data(cfg: TrainConfig, work: Workload, rank: int, world_size: int) -> RankData:
    sampler = ResumableSampler(work.train, world_size, rank, seed=cfg.seed)
    loader = DataLoader(work.train, batch_size=cfg.batch_size, sampler=sampler)
    total = cfg.epochs * math.ceil(len(loader) / cfg.grad_accum)
    heldout = DataLoader(work.heldout, batch_size=64 if cfg.data == "text" else 512)
    return RankData(loader, heldout, min(total, cfg.max_steps or total))
