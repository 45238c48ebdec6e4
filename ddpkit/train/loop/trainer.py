"""A small data-parallel training loop with callbacks."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit.distributed import comm_stats
from ddpkit.nn import SlowMoDistributedDataParallel
from ddpkit.optim import AdaScale

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Callback:
    """Hooks into `Trainer.fit`; override what you need. Every rank calls every hook."""

    def on_train_start(self, trainer: Trainer) -> None: ...
    def on_train_end(self, trainer: Trainer) -> None: ...
    def on_epoch_start(self, trainer: Trainer) -> None: ...
    def on_epoch_end(self, trainer: Trainer) -> None: ...
    def after_backward(self, trainer: Trainer) -> None: ...
    def after_step(self, trainer: Trainer) -> None: ...


@dataclass
class StepRecord:
    """What one optimizer step did on this rank.

    Attributes:
        epoch: the epoch it belongs to (0-based).
        step: the optimizer steps taken when it ended (1-based).
        loss: the mean loss of its batches on this rank.
        correct: the predictions its batches got right (0 without classes).
        samples: the samples this rank trained on in it.
        seconds: its wall time on this rank.
        sent_bytes: what this rank sent on the wire in it (modelled wire bytes, `comm_stats`).
        shared_bytes: what it handed to other ranks of this host through shared memory (not on the wire).
        targets: the predictions `correct` counts (a sequence model predicts several per sample; 0: no classes).
    """

    epoch: int
    step: int
    loss: float
    correct: int
    samples: int
    seconds: float
    sent_bytes: float
    shared_bytes: float = 0.0  # handed to other ranks of this host through shared memory (not on the wire)
    targets: int = 0  # predictions `correct` counts (a sequence model predicts several per sample; 0: no classes)

    @property
    def accuracy(self) -> float:
        return self.correct / self.targets if self.targets else float("nan")


@dataclass
class TrainerState:
    """Counters a checkpoint must restore for a resumed run to continue exactly.

    Attributes:
        epoch: the next epoch to run.
        step: the optimizer steps taken.
        history: one entry per finished epoch.
        epoch_samples: the positions of this epoch's permutation the ranks consumed together (a mid-epoch resume).
        carried: what callbacks keep across resumes (metrics, totals).
    """

    epoch: int = 0  # the next epoch to run
    step: int = 0  # optimizer steps taken
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per finished epoch
    epoch_samples: int = 0  # positions of this epoch's permutation the ranks consumed together (mid-epoch resume)
    carried: dict[str, Any] = field(default_factory=dict)  # what callbacks keep across resumes (metrics, totals)


class Trainer:
    """Trains a data-parallel model: gradient accumulation, mixed precision, and the extra calls each wrapper needs.

    `model` is the wrapped model (torch DDP, `ShardedDataParallel`, `SlowMoDistributedDataParallel`, or a plain
    module on one process) and `optimizer` the optimizer that steps it (`OSS`, `AdaScale`, a torch optimizer).
    Each optimizer step consumes `grad_accum` batches; all but the last backward run under the wrapper's
    `no_sync()` when it has one. With `amp_dtype`, forward runs under autocast; with `scaler` (a GradScaler or
    ShardedGradScaler) the loss is scaled. SlowMo models get ``zero_grad(set_to_none=True)`` and
    ``perform_slowmo(optimizer)`` after each step. The sampler's epoch is set every epoch. What each step sent is
    read from `comm_stats`.

    Args:
        model: the wrapped model (or a plain module on one process).
        optimizer: the optimizer that steps it.
        train_loader: the training batches of this rank; a `DistributedSampler` in it gets its epoch set.
        loss_fn: ``loss_fn(output, target)`` (default: cross entropy).
        grad_accum: batches per optimizer step.
        amp_dtype: autocast's dtype for forward (None: full precision).
        scaler: a GradScaler or ShardedGradScaler for fp16 (None: no loss scaling).
        callbacks: called at each event of the loop (`Callback`).

    Raises:
        ValueError: `grad_accum` below 1.

    Example::

        trainer = Trainer(ShardedDataParallel(model, optimizer), optimizer, loader, callbacks=[MyCallback()])
        trainer.fit(epochs=5)
        accuracy, loss = trainer.evaluate(test_loader)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: DataLoader,
        loss_fn: LossFn = nn.functional.cross_entropy,
        *,
        grad_accum: int = 1,
        amp_dtype: torch.dtype | None = None,
        scaler: torch.amp.GradScaler | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise ValueError(f"Trainer: grad_accum must be an int >= 1, got {grad_accum!r}")
        self.model = model
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.loss_fn = loss_fn
        self.grad_accum = grad_accum
        self.amp_dtype = amp_dtype
        self.scaler = scaler
        self.callbacks = list(callbacks)
        self.state = TrainerState()
        self.skip_step = False  # set by a callback in after_backward: this step's update is dropped (no scaler update)
        self.last: StepRecord | None = None
        self.device = next(model.parameters()).device

    def _emit(self, hook: str) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self)

    def fit(self, epochs: int, max_steps: int | None = None) -> None:
        """Runs epochs ``state.epoch .. epochs - 1`` (so a restored state resumes where it stopped, also in the
        middle of an epoch: the sampler skips what ``state.epoch_samples`` says was consumed).

        With `max_steps`, training stops once ``state.step`` reaches it; an epoch cut short still ends with
        ``on_epoch_end`` (its metrics and checkpoint) but keeps its place (``state.epoch`` and
        ``state.epoch_samples``), so a resumed run goes on with the rest of that epoch."""
        self._emit("on_train_start")
        while self.state.epoch < epochs and (max_steps is None or self.state.step < max_steps):
            self._emit("on_epoch_start")
            self.model.train()
            replicas = getattr(getattr(self.train_loader, "sampler", None), "num_replicas", 1)
            cut_short = False
            for batches in _chunks(self._epoch_batches(), self.grad_accum):
                self.last = self.train_step(batches)
                self.state.step += 1
                self.state.epoch_samples += self.last.samples * replicas
                self._emit("after_step")
                if max_steps is not None and self.state.step >= max_steps:
                    cut_short = True
                    break
            if not cut_short or self.state.epoch_samples >= _length(self.train_loader.dataset):
                self.state.epoch += 1
                self.state.epoch_samples = 0
            self._emit("on_epoch_end")
        self._emit("on_train_end")

    def _epoch_batches(self) -> Iterator[Any]:
        """This epoch's batches from ``state.epoch_samples`` on: the sampler skips them when it can
        (`ResumableSampler.set_start`), else the first batches are drawn and dropped."""
        sampler = getattr(self.train_loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.state.epoch)
        skip = self.state.epoch_samples
        if hasattr(sampler, "set_start"):
            sampler.set_start(skip)
            skip = 0
        batches = iter(self.train_loader)
        replicas = getattr(sampler, "num_replicas", 1)
        if skip > 0:
            for _, y in batches:
                skip -= len(y) * replicas
                if skip <= 0:
                    break
        return batches

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepRecord:
        start = time.perf_counter()
        loss_sum, correct, samples, targets = 0.0, 0, 0, 0
        with comm_stats.measure() as sent, self._short_update(len(batches)):
            for i, (x, y) in enumerate(batches):
                x, y = x.to(self.device), y.to(self.device)
                sync = i == len(batches) - 1
                with self._maybe_no_sync(sync):
                    with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                        out = self.model(x)
                        loss = self.loss_fn(out.float(), y)
                    scaled = loss / len(batches)
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                loss_sum += loss.item() * len(y)
                hits, predicted = count_correct(out, y)
                correct, targets, samples = correct + hits, targets + predicted, samples + len(y)
            self._emit("after_backward")
            self._optimizer_step()
        seconds = time.perf_counter() - start
        loss_mean = loss_sum / samples
        shared = float(sent.payload_bytes("shared_memory"))
        return StepRecord(
            self.state.epoch, self.state.step, loss_mean, correct, samples, seconds, sent.sent_bytes(), shared, targets
        )

    @contextlib.contextmanager
    def _short_update(self, micro_batches: int) -> Iterator[None]:
        """An epoch's last accumulation may have fewer than `grad_accum` batches: AdaScale is told that this update
        has `micro_batches` backward passes, so it measures them as such (else it warns and steps with its old
        estimates), and is set back afterwards. A single process with one batch left has no spread to measure:
        AdaScale then steps with the current gain, as it says."""
        optimizer = self.optimizer
        short = isinstance(optimizer, AdaScale) and micro_batches < optimizer.num_gradients_to_accumulate
        if not short or optimizer.world_size * micro_batches < 2:
            yield
            return
        full = optimizer.num_gradients_to_accumulate
        optimizer.set_num_gradients_to_accumulate(micro_batches, update_smoothing=False)
        yield  # a failed update ends training: nothing to set back then
        optimizer.set_num_gradients_to_accumulate(full, update_smoothing=False)

    def _maybe_no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        if sync or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _optimizer_step(self) -> None:
        if self.skip_step:  # a callback dropped this step (a fault-tolerant round that failed on some member)
            self.skip_step = False
            self.optimizer.zero_grad(set_to_none=True)
            return
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if isinstance(self.model, SlowMoDistributedDataParallel):
            self.model.zero_grad(set_to_none=True)
            self.model.perform_slowmo(self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, loader: DataLoader) -> tuple[float, float]:
        """(accuracy, mean loss) of this rank's replica on `loader`; no communication."""
        module = getattr(self.model, "module", self.model)
        was_training = module.training
        module.eval()
        correct, predicted, total, loss_sum = 0, 0, 0, 0.0
        for x, y in loader:
            x, y = x.to(self.device), y.to(self.device)
            out = module(x).float()
            loss_sum += float(self.loss_fn(out, y)) * len(y)
            hits, count = count_correct(out, y)
            correct, predicted, total = correct + hits, predicted + count, total + len(y)
        module.train(was_training)
        return (correct / predicted if predicted else float("nan")), loss_sum / max(total, 1)


def count_correct(output: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """(correct predictions, predictions): the arg-max over the class dimension (the last one for outputs of 3+
    dimensions, as `ddpkit.train.workloads.factories.cross_entropy`) against integer targets; (0, 0) for float
    targets."""
    if target.is_floating_point() or output.dim() < 2:
        return 0, 0
    predicted = output.argmax(-1 if output.dim() > 2 else 1)
    if predicted.shape != target.shape:
        return 0, 0
    return int((predicted == target).sum()), target.numel()


def _length(dataset: Any) -> float:
    """The number of samples in `dataset`; infinite for one without a length (an iterable dataset)."""
    try:
        return len(dataset)
    except TypeError:
        return math.inf


def _chunks(batches: Iterator[Any], size: int) -> Iterator[list[Any]]:
    """Groups consecutive batches by `size`; the last group of an epoch may be shorter."""
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group
