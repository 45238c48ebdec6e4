"""The callbacks `ddpkit train` uses: a progress bar, per-step/epoch metrics, and a checkpoint every epoch."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.utils.data import DataLoader
from tqdm import tqdm

from ddpkit.train.checkpoint import save_checkpoint
from ddpkit.train.strategies import Strategy
from ddpkit.train.trainer import Callback, StepRecord, Trainer


class ProgressBar(Callback):
    """One tqdm bar on rank 0: loss, accuracy, samples/s and MB this rank sent per step."""

    def __init__(self, total_steps: int, rank: int, world_size: int, label: str, enabled: bool = True) -> None:
        self.total_steps = total_steps
        self.world_size = world_size
        self.enabled = enabled and rank == 0
        self.label = label
        self.bar: tqdm | None = None

    def on_train_start(self, trainer: Trainer) -> None:
        if self.enabled:
            self.bar = tqdm(total=self.total_steps, initial=trainer.state.step, desc=self.label, unit="step")

    def after_step(self, trainer: Trainer) -> None:
        if self.bar is None or trainer.last is None:
            return
        last = trainer.last
        self.bar.set_postfix(
            epoch=last.epoch,
            loss=f"{last.loss:.3f}",
            acc=f"{last.accuracy:.2f}",
            samples_s=f"{last.samples * self.world_size / max(last.seconds, 1e-9):.0f}",
            MB_sent=f"{last.sent_bytes / 1e6:.3f}",
        )
        self.bar.update()

    def on_train_end(self, trainer: Trainer) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsRecorder(Callback):
    """Keeps every step's record and, each epoch, the training loss/accuracy and this replica's test accuracy."""

    def __init__(self, test_loader: DataLoader) -> None:
        self.test_loader = test_loader
        self.steps: list[StepRecord] = []
        self._epoch_steps: list[StepRecord] = []

    def after_step(self, trainer: Trainer) -> None:
        assert trainer.last is not None
        self.steps.append(trainer.last)
        self._epoch_steps.append(trainer.last)

    def on_epoch_end(self, trainer: Trainer) -> None:
        records, self._epoch_steps = self._epoch_steps, []
        samples = sum(r.samples for r in records) or 1
        targets = sum(r.targets for r in records)
        accuracy, test_loss = trainer.evaluate(self.test_loader)
        entry: dict[str, Any] = {
            "epoch": trainer.state.epoch - 1,
            "steps": trainer.state.step,
            "train_loss": sum(r.loss * r.samples for r in records) / samples,
            "train_accuracy": sum(r.correct for r in records) / targets if targets else float("nan"),
            "test_loss": test_loss,
            "test_accuracy": accuracy,
            "seconds": sum(r.seconds for r in records),
            "sent_bytes": sum(r.sent_bytes for r in records),
        }
        trainer.state.history.append(entry)

    def step_rows(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(r) for r in self.steps]


class Checkpointer(Callback):
    """Writes a checkpoint to `out` at the end of every epoch (a collective: on every rank)."""

    def __init__(self, out: str, strategy: Strategy) -> None:
        self.out = out
        self.strategy = strategy

    def on_epoch_end(self, trainer: Trainer) -> None:
        save_checkpoint(self.out, self.strategy, trainer.state)
