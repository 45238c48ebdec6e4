"""The callbacks `ddpkit train` uses: a progress bar, per-step/epoch metrics, and a checkpoint every epoch."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any

from torch.utils.data import DataLoader
from tqdm import tqdm

from ddpkit.train.checkpoints.checkpoint import save_checkpoint
from ddpkit.train.loop.report import gather_per_rank
from ddpkit.train.loop.strategies import Strategy
from ddpkit.train.loop.trainer import Callback, StepRecord, Trainer


class ProgressBar(Callback):
    """One tqdm bar on rank 0: loss, accuracy (when the targets are classes), samples/s and MB this rank sent per
    step.

    The bar is written by one thread of one process, so tqdm gets a thread lock. Its default lock adds a
    multiprocessing lock, a named semaphore registered with the launcher's resource tracker; a rank ends without
    the interpreter's teardown (`ddpkit.distributed.launch.exit_without_teardown`), so that semaphore was never
    unregistered and every run ended with the tracker's "1 leaked semaphore objects" warning."""

    def __init__(self, total_steps: int, rank: int, world_size: int, label: str, enabled: bool = True) -> None:
        self.total_steps = total_steps
        self.world_size = world_size
        self.enabled = enabled and rank == 0
        self.label = label
        self.bar: tqdm | None = None

    def on_train_start(self, trainer: Trainer) -> None:
        if self.enabled:
            tqdm.set_lock(threading.RLock())  # before the first bar: tqdm then creates no multiprocessing lock
            self.bar = tqdm(total=self.total_steps, initial=trainer.state.step, desc=self.label, unit="step")

    def after_step(self, trainer: Trainer) -> None:
        if self.bar is None or trainer.last is None:
            return
        last = trainer.last
        shown = {"epoch": last.epoch, "loss": f"{last.loss:.3f}"}
        if not math.isnan(last.accuracy):  # no classes (e.g. --loss mse): no accuracy to show
            shown["acc"] = f"{last.accuracy:.2f}"
        shown["samples_s"] = f"{last.samples * self.world_size / max(last.seconds, 1e-9):.0f}"
        self.bar.set_postfix(shown, MB_sent=f"{last.sent_bytes / 1e6:.3f}")
        self.bar.update()

    def on_train_end(self, trainer: Trainer) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsRecorder(Callback):
    """Keeps every step's record; each epoch, the training loss/accuracy and this replica's held-out accuracy and
    loss; and with `eval_every`, this replica's held-out accuracy and loss every `eval_every` optimizer steps as
    well as at each epoch's end (`heldout_rows`: a curve even for a run shorter than an epoch; 0: epoch ends only).

    What a resumed run needs to report the whole run lives in ``trainer.state.carried`` (saved with checkpoints):
    every earlier step's row (for steps.csv), every earlier held-out evaluation and the totals over all ranks up
    to the checkpoint (`totals`: ``wall_seconds`` is the time spent in `Trainer.fit`, ``eval_seconds`` the part of it
    the held-out evaluations took). Each step's row also has ``loop_seconds``: this run's time in the loop up to
    that step's record, held-out evaluations left out (one clock for everything a step costs, the work after it
    included: differences of it time any stretch of steps)."""

    def __init__(self, test_loader: DataLoader, eval_every: int = 0) -> None:
        self.test_loader = test_loader
        self.eval_every = eval_every
        self.steps: list[StepRecord] = []  # this run's
        self.resumed = False  # whether this run went on from a checkpoint's steps
        self._epoch_steps: list[StepRecord] = []
        self._rows: list[dict[str, Any]] = []
        self._heldout: list[dict[str, Any]] = []
        self._base = {"samples": 0.0, "sent_bytes": 0.0, "wall_seconds": 0.0, "eval_seconds": 0.0}
        self._start = time.perf_counter()
        self._eval_seconds = 0.0  # this run's

    def on_train_start(self, trainer: Trainer) -> None:
        carried = trainer.state.carried
        self._rows = carried.setdefault("steps", [])
        self._heldout = carried.setdefault("heldout", [])
        self._base = {**self._base, **carried.get("totals", {})}  # (checkpoints before 0.1.0's eval_seconds lack it)
        fields = {f.name for f in dataclasses.fields(StepRecord)}  # rows may carry more columns (annotate_last)
        rows = [r for r in self._rows if r["epoch"] == trainer.state.epoch]
        self._epoch_steps = [StepRecord(**{k: v for k, v in r.items() if k in fields}) for r in rows]
        self.resumed = trainer.state.step > 0
        self._start = time.perf_counter()

    def after_step(self, trainer: Trainer) -> None:
        assert trainer.last is not None
        self.steps.append(trainer.last)
        self._epoch_steps.append(trainer.last)
        loop_seconds = time.perf_counter() - self._start - self._eval_seconds  # this run's loop, to this step's end
        self._rows.append({**dataclasses.asdict(trainer.last), "loop_seconds": round(loop_seconds, 6)})
        if self.eval_every and trainer.state.step % self.eval_every == 0:
            self._evaluate(trainer, trainer.last.epoch)

    def annotate_last(self, **columns: Any) -> None:
        """Adds `columns` to the last step's row of steps.csv (a fault-tolerant job's members, for example)."""
        if self._rows:
            self._rows[-1].update(columns)

    def _evaluate(self, trainer: Trainer, epoch: int) -> tuple[float, float]:
        """This replica's (held-out accuracy, loss) now, added to the held-out series; an evaluation at this step
        already made (every `eval_every` steps) is reused rather than repeated at the epoch's end."""
        if self._heldout and self._heldout[-1]["step"] == trainer.state.step:
            point = self._heldout[-1]
            return point["test_accuracy"], point["test_loss"]
        start = time.perf_counter()
        accuracy, test_loss = trainer.evaluate(self.test_loader)
        self._eval_seconds += time.perf_counter() - start
        self._heldout.append(
            {"step": trainer.state.step, "epoch": epoch, "test_loss": test_loss, "test_accuracy": accuracy}
        )
        return accuracy, test_loss

    def heldout_rows(self) -> list[dict[str, Any]]:
        """Every held-out evaluation of the whole run (earlier runs included): step (optimizer steps taken),
        epoch, test_loss, test_accuracy (NaN without class targets)."""
        return list(self._heldout)

    def on_epoch_end(self, trainer: Trainer) -> None:
        records, self._epoch_steps = self._epoch_steps, []
        samples = sum(r.samples for r in records) or 1
        targets = sum(r.targets for r in records)
        epoch = records[-1].epoch if records else trainer.state.epoch - 1  # a cut-short epoch keeps its number
        accuracy, test_loss = self._evaluate(trainer, epoch)
        entry: dict[str, Any] = {
            "epoch": epoch,
            "steps": trainer.state.step,
            "samples": samples,
            "train_loss": sum(r.loss * r.samples for r in records) / samples,
            "train_accuracy": sum(r.correct for r in records) / targets if targets else float("nan"),
            "test_loss": test_loss,
            "test_accuracy": accuracy,
            "seconds": sum(r.seconds for r in records),
            "sent_bytes": sum(r.sent_bytes for r in records),
        }
        history = trainer.state.history
        if history and history[-1]["epoch"] == epoch:  # an epoch cut short (--max-steps) and resumed: one entry
            history.pop()
        history.append(entry)

    def totals(self) -> dict[str, float]:
        """Samples trained, bytes sent (all ranks), seconds in `Trainer.fit` and, of those, in held-out evaluations
        (the slowest rank's) of the whole run, earlier runs it resumed included, up to now (a collective: small
        all-gathers)."""
        samples = gather_per_rank(sum(r.samples for r in self.steps))
        sent = gather_per_rank(sum(r.sent_bytes for r in self.steps))
        wall = gather_per_rank(time.perf_counter() - self._start)
        evaluations = gather_per_rank(self._eval_seconds)
        return {
            "samples": self._base["samples"] + sum(samples),
            "sent_bytes": self._base["sent_bytes"] + sum(sent),
            "wall_seconds": self._base["wall_seconds"] + max(wall),
            "eval_seconds": self._base["eval_seconds"] + max(evaluations),
        }

    def step_rows(self) -> list[dict[str, Any]]:
        """Every step's row of the whole run (this rank's batches), earlier runs included."""
        return list(self._rows)


class RunEvents(Callback):
    """What happened while training, added to each epoch's history entry (so put it after `MetricsRecorder`):
    ``fp16_skipped_steps``, the steps the loss scaler skipped (inf/nan gradients: the scale went down and the
    optimizer did not step), and ``adascale_gain``, AdaScale's mean gain over the epoch's steps. No communication:
    the scaler and AdaScale already agree across ranks."""

    def __init__(self, scaler: Any | None, adascale: Any | None) -> None:
        self.scaler = scaler
        self.adascale = adascale
        self._scale_before = 0.0
        self._skipped = 0
        self._gains: list[float] = []

    def after_backward(self, trainer: Trainer) -> None:
        if self.scaler is not None:
            self._scale_before = self.scaler.get_scale()

    def after_step(self, trainer: Trainer) -> None:
        if self.scaler is not None and self.scaler.get_scale() < self._scale_before:
            self._skipped += 1
        if self.adascale is not None:
            self._gains.append(float(self.adascale.gain()))

    def on_epoch_end(self, trainer: Trainer) -> None:
        entry = trainer.state.history[-1]
        if self.scaler is not None:
            entry["fp16_skipped_steps"] = self._skipped
        if self.adascale is not None:
            entry["adascale_gain"] = sum(self._gains) / len(self._gains) if self._gains else 1.0
        self._skipped, self._gains = 0, []


class Checkpointer(Callback):
    """Writes a checkpoint to `out` at the end of every epoch and, with `every`, every `every` optimizer steps
    (a collective: on every rank); the last `keep` stay. `epoch_size`: the dataset's length (an epoch's last step
    is left to the end-of-epoch checkpoint)."""

    def __init__(
        self,
        out: str,
        strategy: Strategy,
        recorder: MetricsRecorder,
        settings: dict[str, Any],
        *,
        keep: int = 2,
        every: int | None = None,
        epoch_size: int = 0,
    ) -> None:
        self.out, self.strategy, self.recorder, self.settings = out, strategy, recorder, settings
        self.keep, self.every, self.epoch_size = keep, every, epoch_size

    def _save(self, trainer: Trainer) -> None:
        trainer.state.carried["totals"] = self.recorder.totals()
        save_checkpoint(self.out, self.strategy, trainer.state, self.settings, self.keep)

    def after_step(self, trainer: Trainer) -> None:
        last_of_epoch = trainer.state.epoch_samples >= self.epoch_size
        if self.every and trainer.state.step % self.every == 0 and not last_of_epoch:
            self._save(trainer)

    def on_epoch_end(self, trainer: Trainer) -> None:
        self._save(trainer)
