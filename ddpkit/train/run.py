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
from torch.utils.data.distributed import DistributedSampler

from ddpkit.distributed.launch import LaunchError, Placement, join, leave, pick_backend
from ddpkit.nn import SlowMoDistributedDataParallel
from ddpkit.train.callbacks import Checkpointer, MetricsRecorder, ProgressBar
from ddpkit.train.checkpoint import load_checkpoint
from ddpkit.train.config import TrainConfig
from ddpkit.train.data import Data, digits, mnist, synthetic
from ddpkit.train.models import mlp, small_cnn
from ddpkit.train.report import format_summary, gather_digests, gather_per_rank, peak_memory_mb, write_metrics
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


def rank_device(cfg: TrainConfig, placement: Placement, backend: str) -> torch.device:
    """This rank's device: its own GPU with NCCL; with gloo the CPU, or with ``--device cuda`` a GPU (shared when
    there are fewer GPUs than local processes)."""
    if backend != "nccl" and cfg.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", placement.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def train(cfg: TrainConfig, placement: Placement, backend: str) -> dict[str, Any]:
    """Trains on this rank (the process group is joined) and returns the run's summary."""
    device = rank_device(cfg, placement, backend)
    data = load_data(cfg)
    strategy = build_strategy(cfg, build_model(cfg, data).to(device), device)
    sampler = DistributedSampler(data.train, placement.world_size, placement.rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler)
    recorder = MetricsRecorder(DataLoader(data.test, batch_size=512))
    steps_per_epoch = math.ceil(len(loader) / cfg.grad_accum)
    label = f"{cfg.strategy} x{placement.world_size}"
    callbacks = [
        ProgressBar(cfg.epochs * steps_per_epoch, placement.rank, placement.world_size, label, cfg.progress),
        recorder,
    ]
    if cfg.out:
        callbacks.append(Checkpointer(cfg.out, strategy))
    trainer = Trainer(
        strategy.model,
        strategy.optimizer,
        loader,
        grad_accum=cfg.grad_accum,
        amp_dtype=strategy.amp_dtype,
        scaler=strategy.scaler,
        callbacks=callbacks,
    )
    if cfg.resume:
        assert cfg.out is not None
        trainer.state = load_checkpoint(cfg.out, strategy)
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


def summarize(
    cfg: TrainConfig, placement: Placement, backend: str, trainer: Trainer, recorder: MetricsRecorder, wall: float
) -> dict[str, Any]:
    """The run's figures, gathered over ranks (a collective)."""
    steps = recorder.steps
    sent_per_step = gather_per_rank(statistics.fmean(r.sent_bytes for r in steps) if steps else 0.0)
    sent_total = gather_per_rank(sum(r.sent_bytes for r in steps))
    shared_per_step = gather_per_rank(statistics.fmean(r.shared_bytes for r in steps) if steps else 0.0)
    samples = gather_per_rank(sum(r.samples for r in steps))
    walls = gather_per_rank(wall)
    memory = gather_per_rank(peak_memory_mb())
    digests = gather_digests(getattr(trainer.model, "module", trainer.model))
    accuracy, test_loss = trainer.evaluate(recorder.test_loader)
    return {
        "strategy": cfg.strategy,
        "world_size": placement.world_size,
        "backend": backend,
        "device": str(next(trainer.model.parameters()).device.type),
        "epochs": cfg.epochs,
        "steps": trainer.state.step,
        "test_accuracy": accuracy,
        "test_loss": test_loss,
        "train_loss": steps[-1].loss if steps else float("nan"),
        "wall_seconds": max(walls),
        "samples_per_second": sum(samples) / max(max(walls), 1e-9),
        "sent_bytes_per_step": statistics.fmean(sent_per_step),
        "sent_bytes_total": sum(sent_total),
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
    report says where the process was."""
    faulthandler.enable()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(cfg.nproc_per_node, 1)))
    backend = pick_backend(cfg.backend, cfg.nproc_per_node, cfg.device)
    try:
        join(placement, backend, cfg.timeout, multi_node=cfg.nnodes > 1)
        return train(cfg, placement, backend)
    except LaunchError as exc:
        print(f"ddpkit: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as exc:
        if os.environ.get("DDPKIT_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"ddpkit: rank {placement.rank} failed: {type(exc).__name__}: {first}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        leave()
