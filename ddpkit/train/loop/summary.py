"""The summary of a `ddpkit train` run: its figures gathered over ranks, and the settings a plot title names."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from ddpkit.distributed.launch import Placement
from ddpkit.train.loop.callbacks import MetricsRecorder
from ddpkit.train.loop.report import (
    gather_digests,
    gather_per_rank,
    last_epoch_train_loss,
    peak_memory_mb,
    run_settings,
)
from ddpkit.train.loop.trainer import Trainer
from ddpkit.train.settings.config import TrainConfig
from ddpkit.train.workloads.text import bits_per_byte


def title_settings(cfg: TrainConfig, world_size: int) -> str:
    """The settings a plot title names, e.g. "adam lr 0.001, batch 32 x 2, amp bf16"."""
    text = f"{cfg.optimizer} lr {cfg.learning_rate:g}, batch {cfg.batch_size} x {world_size}"
    if cfg.grad_accum > 1:
        text += f" x {cfg.grad_accum} accumulated"
    if cfg.amp != "off":
        text += f", amp {cfg.amp}"
    if cfg.strategy == "slowmo":
        text += f", localsgd every {cfg.localsgd_frequency}, slowmo every {cfg.slowmo_frequency}"
    return text


def shared_memory_per_step(recorder: MetricsRecorder) -> float:
    """The mean over the group's ranks of each rank's shared-memory bytes per step (a collective)."""
    steps = recorder.steps
    return statistics.fmean(gather_per_rank(statistics.fmean(r.shared_bytes for r in steps) if steps else 0.0))


def group_figures(trainer: Trainer, recorder: MetricsRecorder) -> dict[str, Any]:
    """The figures of a run whose ranks share a process group, gathered over it (a collective): what each rank sent
    and held, the replicas' digests and the last epoch's training loss."""
    steps = recorder.steps
    sent_per_step = gather_per_rank(statistics.fmean(r.sent_bytes for r in steps) if steps else 0.0)
    digests = gather_digests(getattr(trainer.model, "module", trainer.model))
    return {
        "train_loss": last_epoch_train_loss(trainer.state.history),
        "sent_bytes_per_step": statistics.fmean(sent_per_step),
        "shared_memory_bytes_per_step": shared_memory_per_step(recorder),
        "peak_memory_mb": gather_per_rank(peak_memory_mb()),
        "replicas_equal": len(set(digests)) == 1,
        "parameter_digests": digests,
    }


def summarize(
    cfg: TrainConfig,
    placement: Placement,
    backend: str,
    trainer: Trainer,
    recorder: MetricsRecorder,
    started: float,
    figures: dict[str, Any],
) -> dict[str, Any]:
    """The run's summary (a collective of the ranks that share a process group: the settings' hosts). `started`:
    when the command began (``time.time()`` on rank 0's machine: its wall time is rank 0's). `figures`: what the
    ranks sent, held and trained (`group_figures`, or a fault-tolerant job's, from its members' reports)."""
    totals = recorder.totals()  # the whole run, across resumes
    training = totals["wall_seconds"] - totals["eval_seconds"]  # the loop without its held-out evaluations
    module = getattr(trainer.model, "module", trainer.model)
    accuracy, test_loss = trainer.evaluate(recorder.test_loader)
    history = trainer.state.history
    extra = {"heldout_bits_per_byte": bits_per_byte(test_loss)} if cfg.data == "text" else {}
    parameters = sum(p.numel() for p in module.parameters())
    summary = {
        "workload": f"{cfg.model} on {cfg.data}",
        "title": title_settings(cfg, placement.world_size),
        "strategy": f"{cfg.strategy} (fault-tolerant)" if cfg.fault_tolerant else cfg.strategy,
        "world_size": placement.world_size,
        "backend": backend,
        "device": str(next(trainer.model.parameters()).device.type),
        "epochs": cfg.epochs,
        "epochs_completed": trainer.state.epoch,
        "last_epoch": history[-1]["epoch"] if history else 0,
        "steps_per_epoch": math.ceil(len(trainer.train_loader) / cfg.grad_accum),
        "stopped_by_max_steps": trainer.state.epoch < cfg.epochs,
        "steps": trainer.state.step,
        "test_accuracy": accuracy,
        "test_loss": test_loss,
        "train_loss": None,
        "wall_seconds": time.time() - started,
        "training_seconds": training,
        "evaluation_seconds": totals["eval_seconds"],
        "resumed": recorder.resumed,
        "samples_per_second": totals["samples"] / max(training, 1e-9),
        "sent_bytes_per_step": None,
        "sent_bytes_total": totals["sent_bytes"],
        "shared_memory_bytes_per_step": None,
        "peak_memory_mb": None,
        "replicas_equal": None,
        "parameter_digests": None,
        "settings": run_settings(cfg, placement.world_size, backend, parameters),
        "fp16_skipped_steps": sum(h.get("fp16_skipped_steps", 0) for h in history) if cfg.amp == "fp16" else None,
        "adascale_gain_per_epoch": [h.get("adascale_gain", math.nan) for h in history] if cfg.adascale else None,
        **extra,
    }
    return summary | figures
