"""The end-of-run report of `ddpkit train` says what happened: the model's real size, how far the run went, a
held-out loss where accuracy does not apply (null in metrics.json), the command's wall time apart from the
training time, and held-out evaluations during an epoch (the held-out curve of a short run)."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit.train.loop.callbacks import MetricsRecorder
from ddpkit.train.loop.report import format_summary, write_metrics
from ddpkit.train.loop.trainer import Trainer
from ddpkit.train.settings.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _summary(**changes: Any) -> dict[str, Any]:
    """A summary as `ddpkit train` builds it (ddpkit.train.loop.summary.summarize), written out by hand."""
    settings = {
        "optimizer": "adam",
        "optimizer_arguments": {"lr": 0.001},
        "batch_size_per_process": 16,
        "world_size": 2,
        "grad_accum": 1,
        "samples_per_step": 32,
        "amp": "off",
        "adascale": False,
        "slowmo": None,
        "model": "mlp",
        "model_size": "2 hidden layers of 256; 85,002 parameters",
        "parameters": 85_002,
        "data": "digits",
        "epochs": 5,
        "seed": 0,
        "hosts": ["h"],
        "torch_version": "2.13.0",
        "ddpkit_version": "0.1.0",
    }
    summary = {
        "strategy": "sharded",
        "world_size": 2,
        "backend": "gloo",
        "epochs": 5,
        "epochs_completed": 5,
        "last_epoch": 4,
        "steps_per_epoch": 23,
        "stopped_by_max_steps": False,
        "steps": 115,
        "test_accuracy": 0.96,
        "test_loss": 0.12,
        "train_loss": 0.08,
        "wall_seconds": 16.0,
        "training_seconds": 2.5,
        "evaluation_seconds": 0.5,
        "resumed": False,
        "samples_per_second": 2000.0,
        "sent_bytes_per_step": 2e5,
        "sent_bytes_total": 4e6,
        "peak_memory_mb": [300.0, 301.0],
        "replicas_equal": True,
        "parameter_digests": [1, 1],
        "settings": settings,
    }
    return {**summary, **changes}


def _row(table: str, name: str) -> str:
    rows = [line[len(name) :].strip() for line in table.splitlines() if line.startswith(name + "  ")]
    assert len(rows) == 1, f"{name!r} in\n{table}"
    return rows[0]


def test_a_regression_reports_its_heldout_loss_not_an_accuracy_of_nan() -> None:
    table = format_summary(_summary(test_accuracy=math.nan, test_loss=0.0774))
    assert "nan" not in table.lower(), table
    assert "test accuracy" not in table
    assert _row(table, "held-out loss").startswith("0.0774 (no accuracy: the targets are not class indices)")
    classified = format_summary(_summary())
    assert _row(classified, "test accuracy") == "0.9600" and "held-out loss" not in classified


def test_metrics_json_holds_null_where_an_accuracy_does_not_apply(tmp_path: Path) -> None:
    history = [{"epoch": 0, "steps": 4, "train_loss": 0.3, "train_accuracy": math.nan, "test_accuracy": math.nan}]
    heldout = [{"step": 2, "epoch": 0, "test_loss": 0.5, "test_accuracy": math.nan}]
    steps = [{"epoch": 0, "step": i, "loss": 1.0} for i in range(4)]
    paths = write_metrics(str(tmp_path), _summary(test_accuracy=math.nan), history, steps, heldout)

    def refuse(constant: str) -> None:
        raise ValueError(f"metrics.json holds {constant}, which is not JSON")

    metrics = json.loads(Path(paths[0]).read_text(), parse_constant=refuse)  # strict JSON: NaN is refused
    assert metrics["summary"]["test_accuracy"] is None and metrics["summary"]["test_loss"] == 0.12
    assert metrics["epochs"][0]["train_accuracy"] is None and metrics["epochs"][0]["test_accuracy"] is None
    assert metrics["heldout"] == [{"step": 2, "epoch": 0, "test_loss": 0.5, "test_accuracy": None}]


def test_the_run_length_says_where_max_steps_stopped() -> None:
    table = format_summary(_summary())
    assert _row(table, "length") == "5 epoch(s), 115 steps"
    assert _row(table, "model and data") == "mlp (2 hidden layers of 256; 85,002 parameters) on digits, seed 0"
    # 50 steps of 23 per epoch: epochs 1 and 2 whole, stopped 4 steps into epoch 3 (which keeps its place)
    cut = format_summary(_summary(steps=50, epochs_completed=2, last_epoch=2, stopped_by_max_steps=True))
    assert _row(cut, "length") == "stopped by --max-steps at step 50, in epoch 3 of 5 (23 steps per epoch)"
    assert "5 epoch(s)" not in cut
    edge = format_summary(_summary(steps=46, epochs_completed=2, last_epoch=1, stopped_by_max_steps=True))
    assert _row(edge, "length") == "stopped by --max-steps at step 46, at the end of epoch 2 of 5 (23 steps per epoch)"


def test_wall_time_is_the_commands_and_training_time_is_labelled_apart() -> None:
    table = format_summary(_summary())
    assert _row(table, "wall time") == "16.0 s (this command, from its start to this summary)"
    assert _row(table, "training time") == "2.5 s (the training loop; held-out evaluations another 0.5 s)"
    assert _row(table, "samples/s") == "2000 (over the training time)"
    resumed = format_summary(_summary(resumed=True))
    assert "across resumed runs" in _row(resumed, "training time")


def test_model_size_names_the_gpt_shape_and_the_parameter_count() -> None:
    from ddpkit.train.loop.report import model_size  # (here: the other tests run without it)

    cfg = TrainConfig(model="gpt", data="text", gpt_layers=2, gpt_width=64, gpt_heads=2, context=64)
    assert model_size(cfg, 120_576) == "2 layers, width 64, 2 heads, context 64; 120,576 parameters"
    assert model_size(TrainConfig(hidden=32, depth=3), 5_000) == "3 hidden layers of 32; 5,000 parameters"
    assert model_size(TrainConfig(hidden=32, depth=1), 5_000) == "1 hidden layer of 32; 5,000 parameters"
    assert model_size(TrainConfig(model="pkg.mod:build", data="pkg.mod:data"), 1_153) == "1,153 parameters"
    assert "default" not in model_size(TrainConfig(model="cnn"), 19_000)


def _regression() -> tuple[TensorDataset, TensorDataset]:
    x = torch.randn(300, 4, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    return TensorDataset(x[:240], y[:240]), TensorDataset(x[240:], y[240:])


def test_heldout_is_evaluated_every_eval_every_steps_within_an_epoch() -> None:
    train, held = _regression()
    torch.manual_seed(0)
    module = nn.Linear(4, 1)
    recorder = MetricsRecorder(DataLoader(held, batch_size=25), eval_every=3)
    trainer = Trainer(
        module,
        torch.optim.SGD(module.parameters(), lr=0.05),
        DataLoader(train, batch_size=30),
        F.mse_loss,
        callbacks=[recorder],
    )
    trainer.fit(epochs=3, max_steps=13)  # 8 steps per epoch: epoch 0 whole, epoch 1 cut after 5 steps
    rows = recorder.heldout_rows()
    # every 3 steps, and at the end of each epoch (8; 13, where --max-steps stopped): one evaluation per step
    assert [(r["step"], r["epoch"]) for r in rows] == [(3, 0), (6, 0), (8, 0), (9, 1), (12, 1), (13, 1)]
    x, y = held.tensors
    with torch.no_grad():
        expected = F.mse_loss(module(x), y).item()  # the model as it ended, on all 60 held-out samples at once
    assert rows[-1]["test_loss"] == pytest.approx(expected, rel=1e-5)
    assert all(math.isnan(r["test_accuracy"]) for r in rows)  # float targets: no accuracy
    assert [h["test_loss"] for h in trainer.state.history] == [rows[2]["test_loss"], rows[-1]["test_loss"]]
    assert rows[0]["test_loss"] > rows[-1]["test_loss"]  # it learned: the curve goes down
    assert trainer.state.carried["heldout"] == rows  # kept in the checkpoint's state: a resumed run's curve goes on


def test_eval_every_zero_evaluates_at_epoch_ends_only() -> None:
    train, held = _regression()
    module = nn.Linear(4, 1)
    recorder = MetricsRecorder(DataLoader(held, batch_size=60), eval_every=0)
    trainer = Trainer(
        module,
        torch.optim.SGD(module.parameters(), lr=0.05),
        DataLoader(train, batch_size=30),
        F.mse_loss,
        callbacks=[recorder],
    )
    trainer.fit(epochs=2)
    assert [r["step"] for r in recorder.heldout_rows()] == [8, 16]


def test_seconds_since_process_start_counts_the_interpreter_start_and_imports() -> None:
    code = (
        "import time; time.sleep(1.5)\n"
        "from ddpkit.train.loop.launcher import seconds_since_process_start\n"
        "print(seconds_since_process_start())"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    age = float(done.stdout)
    assert 1.5 <= age <= elapsed + 0.05  # the sleep and torch's import, within the process's whole life


def test_the_wall_time_starts_with_the_command_not_with_the_shell_that_exec_d_it() -> None:
    """``bash -c 'pip install ... && ddpkit train'`` execs ddpkit in bash's process, whose start the kernel keeps:
    the command's start is then ddpkit's import, not the shell's start."""
    code = (
        "import time, ddpkit\n"
        "from ddpkit.train.loop.launcher import command_started, seconds_since_process_start\n"
        "now = time.time()\n"
        "print(now - command_started(), now - ddpkit._imported_at, seconds_since_process_start())"
    )
    shell = f"sleep 6; exec {sys.executable} -c {shlex.quote(code)}"
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    since_start, since_import, process_age = (float(v) for v in done.stdout.split())
    assert process_age >= 6.0  # the kernel's start is the shell's, before the sleep
    assert abs(since_start - since_import) < 0.5 and since_start < process_age - 5.0


def test_eval_every_is_checked_before_start() -> None:
    from ddpkit.train.settings.config import validate

    with pytest.raises(ValueError, match=r"--eval-every must be an integer >= 0; got -1"):
        validate(TrainConfig(eval_every=-1))
    validate(TrainConfig(eval_every=0))  # epoch ends only


def test_the_progress_bar_shows_no_accuracy_without_classes() -> None:
    from types import SimpleNamespace

    from ddpkit.train.loop.callbacks import ProgressBar
    from ddpkit.train.loop.trainer import StepRecord, TrainerState

    bar = ProgressBar(2, rank=0, world_size=2, label="ddp x2")
    trainer = SimpleNamespace(state=TrainerState(), last=None)
    bar.on_train_start(trainer)  # type: ignore[arg-type]
    try:
        trainer.last = StepRecord(0, 0, 0.5, correct=0, samples=8, seconds=0.01, sent_bytes=0.0, targets=0)
        bar.after_step(trainer)  # type: ignore[arg-type]
        assert bar.bar is not None and "loss=0.500" in bar.bar.postfix and "acc" not in bar.bar.postfix
        trainer.last = StepRecord(0, 1, 0.4, correct=6, samples=8, seconds=0.01, sent_bytes=0.0, targets=8)
        bar.after_step(trainer)  # type: ignore[arg-type]
        assert "acc=0.75" in bar.bar.postfix
    finally:
        bar.on_train_end(trainer)  # type: ignore[arg-type]
