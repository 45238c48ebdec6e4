"""What every rank of a `ddpkit train` job must share, compared once at start-up, before any wrapper is built.

Every setting that changes what is computed or communicated must be equal on every rank: the resolved
configuration (flags and TOML, learning rate and weight decay resolved), the data's sizes and a digest of a
sample of its items (a factory that gives each rank other data is refused), the model's parameter
names, shapes and dtypes, and the optimizer's arguments. Settings that belong to one machine may differ:
`PER_MACHINE` (the data's folder, --out's path, the progress bar, this machine's --node-rank, the master's
address as this machine reaches it, --timeout). Whether --out is given at all must agree, since writing a
checkpoint is a collective. One all-gather of 8 bytes when they agree (`ddpkit.distributed.agreement`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any

import numpy as np
import torch

from ddpkit.distributed.agreement import canonical, check_same_across_ranks, parameter_settings
from ddpkit.train.loop.strategies import optimizer_arguments
from ddpkit.train.settings.config import TrainConfig, flag
from ddpkit.train.workloads.workload import Workload

PER_MACHINE = ("data_dir", "out", "progress", "node_rank", "master_addr", "master_port", "timeout")


def agreed_settings(cfg: TrainConfig, backend: str) -> dict[str, Any]:
    """The resolved settings that must be equal on every rank, keyed by their flags."""
    settings: dict[str, Any] = {
        flag(name): value for name, value in dataclasses.asdict(cfg).items() if name not in PER_MACHINE
    }
    settings.update({"--lr": cfg.learning_rate, "--weight-decay": cfg.resolved_weight_decay, "--backend": backend})
    settings["--out given"] = "yes" if cfg.out else "no"
    return settings


def _sample_shapes(dataset: Any) -> str:
    """The shapes and dtypes of a dataset's first sample (tensors, or a tuple of them), '' when it has none."""
    if len(dataset) == 0:
        return ""
    sample = dataset[0]
    parts = sample if isinstance(sample, tuple | list) else (sample,)
    return ", ".join(canonical(p) if not torch.is_tensor(p) or p.numel() > 1 else str(p.dtype) for p in parts)


SAMPLED_ITEMS = 8
"""Items per dataset that `data_digest` reads (evenly spread): enough to tell two datasets apart, cheap to read."""


def _feed(h: Any, item: Any) -> None:
    if torch.is_tensor(item):
        value = item.detach().cpu().contiguous()
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    elif isinstance(item, tuple | list):
        for part in item:
            _feed(h, part)
    else:
        h.update(repr(item).encode())


def data_digest(dataset: Any) -> str:
    """A digest of `SAMPLED_ITEMS` items spread over `dataset` (their dtypes, shapes and bytes), read with every
    random generator seeded alike (torch, random, NumPy; restored after), so that random augmentation gives every
    rank the same digest while data that differs between ranks (a clock- or rank-seeded factory) does not."""
    h = hashlib.sha256()
    size = len(dataset)
    indices = sorted({k * size // SAMPLED_ITEMS for k in range(SAMPLED_ITEMS)}) if size else []
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            random.seed(0)
            np.random.seed(0)
            for index in indices:
                _feed(h, dataset[index])
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return h.hexdigest()[:16]


def data_settings(work: Workload) -> str:
    """The data's sizes, the first sample's shapes and a digest of a sample of items (`data_digest`): equal on
    every rank that reads the same data."""
    return (
        f"{len(work.train)} training and {len(work.heldout)} held-out samples, first sample "
        f"({_sample_shapes(work.train)}), items {data_digest(work.train)}/{data_digest(work.heldout)}"
    )


def job_settings(cfg: TrainConfig, backend: str, work: Workload) -> list[tuple[str, Any]]:
    """Everything the ranks of a job must share (module doc), by name: the settings, the data, the optimizer's
    arguments and the model's parameters."""
    settings = agreed_settings(cfg, backend)
    settings["data"] = data_settings(work)
    settings["optimizer arguments"] = optimizer_arguments(cfg)
    return [*settings.items(), *(("model " + key, value) for key, value in parameter_settings(work.module))]


def check_job_agrees(cfg: TrainConfig, backend: str, work: Workload) -> None:
    """Raises `RanksDisagree` on every rank, naming the settings and ranks, unless all ranks agree (a collective:
    call it on every rank, after joining and before building the strategy). A fault-tolerant job compares the
    same `job_settings` through its store instead (`ddpkit.fault_tolerance.manager.Manager`)."""
    check_same_across_ranks(job_settings(cfg, backend, work), what="ddpkit train")
