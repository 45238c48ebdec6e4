"""One process of `ddpkit train`: join the job, build data, model and strategy, train, summarise."""

from __future__ import annotations

import faulthandler
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit.distributed import shared_memory
from ddpkit.distributed.launch import (
    LaunchError,
    Placement,
    debug_mode,
    explain_failure,
    join,
    leave,
    pick_backend,
)
from ddpkit.distributed.objects import broadcast_object
from ddpkit.distributed.rank_guard import guard_rank
from ddpkit.nn import SlowMoDistributedDataParallel
from ddpkit.train import checkpoint_files
from ddpkit.train.callbacks import Checkpointer, MetricsRecorder, ProgressBar
from ddpkit.train.checkpoint import load_checkpoint
from ddpkit.train.checkpoint_files import run_settings
from ddpkit.train.config import TrainConfig
from ddpkit.train.data import Data, digits, mnist, synthetic
from ddpkit.train.models import mlp, small_cnn
from ddpkit.train.report import format_summary, gather_digests, gather_per_rank, peak_memory_mb, write_metrics
from ddpkit.train.sampler import ResumableSampler
from ddpkit.train.strategies import build_strategy
from ddpkit.train.trainer import Trainer


def load_data(cfg: TrainConfig) -> Data:
    if cfg.data == "digits":
        return digits(cfg.seed)
    if cfg.data == "mnist":
        assert cfg.data_dir is not None
        return mnist(cfg.data_dir)
    return synthetic(cfg.synthetic_samples, cfg.synthetic_features, cfg.synthetic_classes, cfg.seed)


def build_model(cfg: TrainConfig, data: Data) -> nn.Module:
    torch.manual_seed(cfg.seed)  # the same initial model on every rank (wrappers also sync from rank 0)
    if cfg.model == "cnn":
        if data.image_shape is None:
            raise ValueError("--model cnn needs image-shaped data")
        return small_cnn(data.image_shape, data.num_classes)
    return mlp(data.num_features, data.num_classes, cfg.hidden, cfg.depth)


def train(cfg: TrainConfig, placement: Placement, backend: str) -> dict[str, Any]:
    """Trains on this rank (the process group is joined) and returns the run's summary."""
    device = torch.device("cuda", placement.local_rank) if backend == "nccl" else torch.device("cpu")
    data = load_data(cfg)
    strategy = build_strategy(cfg, build_model(cfg, data).to(device), device)
    sampler = ResumableSampler(data.train, placement.world_size, placement.rank, seed=cfg.seed)
    loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler)
    recorder = MetricsRecorder(DataLoader(data.test, batch_size=512))
    steps_per_epoch = math.ceil(len(loader) / cfg.grad_accum)
    label = f"{cfg.strategy} x{placement.world_size}"
    callbacks = [
        ProgressBar(cfg.epochs * steps_per_epoch, placement.rank, placement.world_size, label, cfg.progress),
        recorder,
    ]
    settings = run_settings(cfg)
    if cfg.out:
        every, size = cfg.checkpoint_every, len(data.train)
        callbacks.append(
            Checkpointer(cfg.out, strategy, recorder, settings, keep=cfg.keep, every=every, epoch_size=size)
        )
    trainer = Trainer(
        strategy.model,
        strategy.optimizer,
        loader,
        grad_accum=cfg.grad_accum,
        amp_dtype=strategy.amp_dtype,
        scaler=strategy.scaler,
        callbacks=callbacks,
    )
    if cfg.resume or resume_elastic(cfg, placement):
        assert cfg.out is not None
        trainer.state = load_checkpoint(cfg.out, strategy, settings)
    start = time.perf_counter()
    trainer.fit(cfg.epochs)
    wall = time.perf_counter() - start
    if isinstance(strategy.model, SlowMoDistributedDataParallel):
        strategy.model.average_parameters()  # one model at the end, whatever step the run stopped at
    summary = summarize(cfg, placement, backend, trainer, recorder, wall)
    if placement.rank == 0:
        print(format_summary(summary), flush=True)
        if cfg.out:
            for path in write_metrics(cfg.out, summary, trainer.state.history, recorder.step_rows()):
                print(f"wrote {path}")
    return summary


def resume_elastic(cfg: TrainConfig, placement: Placement) -> bool:
    """Whether this torchrun job restarts with fault tolerance (``--max-restarts`` > 0, or already restarted) and
    --out holds a complete checkpoint, as rank 0 sees it (a collective): then every rank resumes from it."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) + int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    if not cfg.out or restarts == 0:
        return False
    found = checkpoint_files.latest(cfg.out) is not None if placement.rank == 0 else None
    return bool(broadcast_object(found, 0))


def summarize(
    cfg: TrainConfig, placement: Placement, backend: str, trainer: Trainer, recorder: MetricsRecorder, wall: float
) -> dict[str, Any]:
    """The run's figures, gathered over ranks (a collective)."""
    steps = recorder.steps
    sent_per_step = gather_per_rank(statistics.fmean(r.sent_bytes for r in steps) if steps else 0.0)
    shared_per_step = gather_per_rank(statistics.fmean(r.shared_bytes for r in steps) if steps else 0.0)
    totals = recorder.totals()  # the whole run, across resumes
    memory = gather_per_rank(peak_memory_mb())
    digests = gather_digests(getattr(trainer.model, "module", trainer.model))
    accuracy, test_loss = trainer.evaluate(recorder.test_loader)
    return {
        "strategy": cfg.strategy,
        "world_size": placement.world_size,
        "backend": backend,
        "epochs": cfg.epochs,
        "steps": trainer.state.step,
        "test_accuracy": accuracy,
        "test_loss": test_loss,
        "train_loss": steps[-1].loss if steps else float("nan"),
        "wall_seconds": totals["wall_seconds"],
        "samples_per_second": totals["samples"] / max(totals["wall_seconds"], 1e-9),
        "sent_bytes_per_step": statistics.fmean(sent_per_step),
        "sent_bytes_total": totals["sent_bytes"],
        "shared_memory_bytes_per_step": statistics.fmean(shared_per_step),
        "peak_memory_mb": memory,
        "replicas_equal": len(set(digests)) == 1,
        "parameter_digests": digests,
    }


def process_main(local_rank: int, cfg: TrainConfig, master_port: int) -> None:
    """Entry point of each process `ddpkit train` spawns on this machine."""
    placement = Placement(
        rank=cfg.node_rank * cfg.nproc_per_node + local_rank,
        world_size=cfg.world_size,
        local_rank=local_rank,
        master_addr=cfg.master_addr,
        master_port=master_port,
    )
    run_placed(cfg, placement)


def run_placed(cfg: TrainConfig, placement: Placement) -> dict[str, Any]:
    """Joins, trains and leaves; any failure ends this process with a message naming the rank.

    A crash inside torch's C++ (SIGSEGV, SIGABRT, ...) prints every thread's Python stack to stderr, so the
    report says where the process was. SIGTERM, SIGHUP or the launcher's death end the rank at once
    (`guard_rank`); shared-memory files it created are removed on every way out."""
    guard_rank(f"rank {placement.rank}", shared_memory.remove_own_files)
    shared_memory.sweep_stale(min_age=0)  # what a killed job on this host left, whatever this job's strategy
    faulthandler.enable()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(cfg.nproc_per_node, 1)))
    backend = pick_backend(cfg.backend)
    try:
        join(placement, backend, cfg.timeout, multi_node=cfg.nnodes > 1)
        return train(cfg, placement, backend)
    except LaunchError as exc:
        print(f"ddpkit: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as exc:
        if debug_mode():
            raise
        print(f"ddpkit: rank {placement.rank} failed: {explain_failure(exc, cfg.timeout)}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        shared_memory.remove_own_files()
        leave()
