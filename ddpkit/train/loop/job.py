"""One `ddpkit train` run, assembled once (`run_job`): the rank's data, the held-out recorder, the progress bar, the
run's events and the Trainer, then fitted and summarised. What a kind of job adds is its `JobSync`: the plain job's
(`ddpkit.train.loop.run.PlainJob`: a process group spanning the job, --out's checkpoints, --resume) or the
fault-tolerant job's (`ddpkit.train.loop.fault_tolerant_run.FaultTolerantJob`: rounds through the `Manager`, live
state, the outputs of one writer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ddpkit.distributed.launch import Placement
from ddpkit.train.loop.callbacks import MetricsRecorder, ProgressBar, RunEvents
from ddpkit.train.loop.loaders import rank_data
from ddpkit.train.loop.trainer import Callback, Trainer
from ddpkit.train.settings.config import TrainConfig
from ddpkit.train.workloads.workload import Workload


@dataclass
class JobParts:
    """What a job trains with: the model to call, the optimizer to step, the loss scaler and autocast's dtype, the
    optimizer whose AdaScale gain the run's events record (None: none), and where the progress bar stands (its
    label, the rank and world it counts, whether it shows)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    amp_dtype: torch.dtype | None
    adascale: torch.optim.Optimizer | None
    label: str
    bar_rank: int
    bar_world: int
    show_bar: bool


class JobSync(Protocol):
    """How a kind of job builds its parts, adds its callbacks, fits and finishes (`run_job` calls them in turn)."""

    def parts(self, work: Workload) -> JobParts: ...

    def callbacks(self, parts: JobParts, recorder: MetricsRecorder, total_steps: int) -> list[Callback]: ...

    def fit(self, trainer: Trainer) -> None: ...

    def finish(self, trainer: Trainer, recorder: MetricsRecorder, started: float) -> dict[str, Any] | None: ...


def default_eval_every(total_steps: int) -> int:
    """Optimizer steps between held-out evaluations when --eval-every is not given: about 15 in a run of
    `total_steps`, so that metrics.png draws a curve even for a run shorter than one epoch."""
    return max(1, round(total_steps / 15))


def run_job(
    cfg: TrainConfig, placement: Placement, work: Workload, sync: JobSync, started: float
) -> dict[str, Any] | None:
    """Trains this rank with `sync`'s parts and returns the summary `sync.finish` gives (None where this rank
    writes none). `started`: when the command began (``time.time()``)."""
    parts = sync.parts(work)
    data = rank_data(cfg, work, placement.rank, placement.world_size)
    every = cfg.eval_every if cfg.eval_every is not None else default_eval_every(data.total_steps)
    recorder = MetricsRecorder(data.heldout, eval_every=every)
    callbacks = [
        ProgressBar(data.total_steps, parts.bar_rank, parts.bar_world, parts.label, parts.show_bar),
        recorder,
        RunEvents(parts.scaler, parts.adascale),  # (after the recorder: it adds to the epochs' rows)
        *sync.callbacks(parts, recorder, data.total_steps),
    ]
    trainer = Trainer(
        parts.model,
        parts.optimizer,
        data.loader,
        work.loss_fn,
        grad_accum=cfg.grad_accum,
        amp_dtype=parts.amp_dtype,
        scaler=parts.scaler,
        callbacks=callbacks,
    )
    sync.fit(trainer)
    return sync.finish(trainer, recorder, started)
