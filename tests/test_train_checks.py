"""`ddpkit train` jobs whose ranks disagree fail at start-up on every rank, naming the setting and the ranks;
settings that belong to one machine may differ; the run records what it was and what happened; every model x
data pair that is accepted trains. Ranks run `ddpkit.train.loop.run.train` in the test pool (cheap), and one job runs
as two real `ddpkit train --world-size 2 --rank R` commands."""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import math
import os
import shutil
import socket
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import warm_processes
from torch import nn

from ddpkit.distributed.agreement import RanksDisagree
from ddpkit.distributed.launch import TORCHRUN_VARIABLES, Placement, free_port
from ddpkit.testing import run_distributed
from ddpkit.train.loop.callbacks import RunEvents
from ddpkit.train.loop.run import train
from ddpkit.train.loop.trainer import Callback, Trainer
from ddpkit.train.settings.config import TrainConfig, validate

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(data="synthetic", synthetic_samples=96, synthetic_features=16, hidden=8, depth=1, epochs=1)
TINY |= dict(batch_size=16, progress=False, timeout=60.0)


def write_tiny_mnist(folder: Path, train: int = 48, test: int = 16) -> None:
    """Four MNIST-format IDX files (28x28 images, labels 0-9): random pixels, the training pair gzipped."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n, gz in (("train", train, True), ("t10k", test, False)):
        arrays = {"images-idx3": rng.integers(0, 256, (n, 28, 28)), "labels-idx1": rng.integers(0, 10, n)}
        for kind, array in arrays.items():
            header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
            raw = header + array.astype(np.uint8).tobytes()
            name = f"{prefix}-{kind}-ubyte"
            (folder / (name + ".gz" if gz else name)).write_bytes(gzip.compress(raw) if gz else raw)


def _train(rank: int, world_size: int, cfgs: list[TrainConfig]) -> dict | str:
    """Runs rank `rank` of a job with its own config; the summary, or the start-up check's message."""
    placement = Placement(rank, world_size, 0, "127.0.0.1", 0)
    try:
        return train(cfgs[rank], placement, "gloo")
    except RanksDisagree as exc:
        return f"RanksDisagree: {exc}"


def _two(base: TrainConfig, **other) -> list[TrainConfig]:
    return [base, dataclasses.replace(base, **other)]


def test_ranks_that_disagree_fail_at_start_naming_the_setting(tmp_path):
    base = TrainConfig(**TINY, nproc_per_node=2)
    cases = {
        "--lr": (_two(base, lr=0.02), "--lr: 0.001 on rank 0; 0.02 on rank 1"),
        "--hidden": (_two(base, hidden=12), "--hidden: 8 on rank 0; 12 on rank 1 | model parameter 0: 1.weight: "),
        "--slowmo-frequency": (
            _two(dataclasses.replace(base, strategy="slowmo"), strategy="slowmo", slowmo_frequency=6),
            "--slowmo-frequency: 48 on rank 0; 6 on rank 1",
        ),
        "--out": (
            [dataclasses.replace(base, out=str(tmp_path / "only-here")), base],
            "--out given: yes on rank 0; no on rank 1",
        ),
        "--optimizer": (
            _two(base, optimizer="adamw"),
            "--optimizer: adam on rank 0; adamw on rank 1 | --weight-decay: 0.0 on rank 0; 0.01 on rank 1",
        ),
    }
    for flag, (cfgs, needle) in cases.items():
        seen = run_distributed(_train, 2, cfgs)
        for rank, message in enumerate(seen):
            assert isinstance(message, str), f"{flag}: rank {rank} trained"
            assert message.startswith(f"RanksDisagree: ddpkit train: ranks disagree (seen from rank {rank}): ")
            assert needle in message, message
            assert "shared-memory" not in message
    assert not (tmp_path / "only-here").exists()  # nothing was written before the check


def test_settings_of_one_machine_may_differ_and_the_run_says_what_it_was(tmp_path):
    """Different --out paths, progress, --timeout and data folders; AdaScale at 2 ranks records its gain."""
    data = [tmp_path / "data0", tmp_path / "data1"]
    for folder in data:
        write_tiny_mnist(folder)
    base = TrainConfig(**TINY | dict(data="mnist", nproc_per_node=2, strategy="ddp", optimizer="sgd", adascale=True))
    cfgs = [
        dataclasses.replace(
            base, data_dir=str(data[r]), out=str(tmp_path / f"out{r}"), progress=r == 0, timeout=60.0 + r
        )
        for r in (0, 1)
    ]
    summaries = run_distributed(_train, 2, cfgs)
    assert all(isinstance(s, dict) for s in summaries), summaries
    summary = summaries[0]
    settings = summary["settings"]
    assert settings["hosts"] == [socket.gethostname()] * 2 and settings["world_size"] == 2
    assert settings["optimizer_arguments"] == {"lr": 0.05, "weight_decay": 0.0, "momentum": 0.9}
    assert (settings["strategy"], settings["optimizer"], settings["lr"], settings["adascale"]) == (
        "ddp",
        "sgd",
        0.05,
        True,
    )
    assert settings["samples_per_step"] == 32 and settings["seed"] == 0 and settings["amp"] == "off"
    assert settings["torch_version"] == torch.__version__ and settings["ddpkit_version"]
    gains = summary["adascale_gain_per_epoch"]
    assert len(gains) == 1 and 1.0 <= gains[0] <= 2.0 + 1e-6  # the gain lies in [1, S] with S = 2 workers
    assert summary["fp16_skipped_steps"] is None
    metrics = json.loads((tmp_path / "out0" / "metrics.json").read_text())
    assert metrics["summary"]["settings"]["config"]["data_dir"] == str(data[0])  # rank 0's machine's view
    assert metrics["epochs"][-1]["adascale_gain"] == gains[0]
    assert not (tmp_path / "out1" / "metrics.json").exists()  # only rank 0 writes the metrics
    assert list((tmp_path / "out0" / "checkpoint").glob("step-*/COMMIT.json"))  # rank 0 writes the checkpoint
    assert not list((tmp_path / "out1").rglob("*.pt"))  # (with slowmo each rank would also write its replica)


def _matrix(rank: int, world_size: int, cfgs: list[TrainConfig]) -> list[dict]:
    placement = Placement(0, 1, 0, "127.0.0.1", 0)
    return [train(cfg, placement, "gloo") for cfg in cfgs]


def test_every_accepted_model_and_data_pair_trains(tmp_path):
    """One process, one short epoch per pair; the summary's train loss is the last epoch's mean."""
    write_tiny_mnist(tmp_path / "mnist")
    from test_config_checks import MATRIX

    cfgs = []
    for (model, data), trains in MATRIX.items():
        if trains is not True:
            continue
        cfg = TrainConfig(**TINY | dict(model=model, data=data, strategy="ddp", nproc_per_node=1, batch_size=64))
        if data == "mnist":
            cfg = dataclasses.replace(cfg, data_dir=str(tmp_path / "mnist"))
        if data == "synthetic":
            cfg = dataclasses.replace(cfg, synthetic_features=64)  # a square: 1x8x8 for the CNN
        if model == "gpt":  # a tiny GPT for a few steps: an epoch of the stdlib's text is far too long here
            cfg = dataclasses.replace(cfg, gpt_layers=1, gpt_width=32, gpt_heads=2, context=32, max_steps=3)
        cfgs.append(cfg)
    cfgs[-1] = dataclasses.replace(cfgs[-1], out=str(tmp_path / "out"), epochs=2)
    for cfg in cfgs:
        validate(cfg)
    summaries = run_distributed(_matrix, 1, cfgs)[0]
    for cfg, summary in zip(cfgs, summaries, strict=True):
        assert summary["settings"]["model"] == cfg.model and summary["settings"]["data"] == cfg.data
        assert summary["steps"] >= 1 and math.isfinite(summary["train_loss"]) and summary["replicas_equal"]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    with open(tmp_path / "out" / "steps.csv", newline="") as f:
        last_step_loss = float(list(csv.DictReader(f))[-1]["loss"])
    assert summaries[-1]["train_loss"] == pytest.approx(metrics["epochs"][-1]["train_loss"], rel=1e-12)
    assert summaries[-1]["train_loss"] != last_step_loss


def test_fp16_skipped_steps_are_counted():
    """A batch with an infinite input makes the scaler skip that step (and halve its scale): counted once."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(6, 4)
    bad = x.clone()
    bad[0, 0] = math.inf
    batches = [(x, torch.tensor([0, 1, 2, 0, 1, 2])), (bad, torch.tensor([0, 1, 2, 0, 1, 2]))] * 2
    events = RunEvents(scaler, None)
    trainer = Trainer(model, optimizer, batches, scaler=scaler, callbacks=[_Epochs(), events])  # type: ignore[arg-type]
    trainer.fit(1)
    assert trainer.state.history[-1]["fp16_skipped_steps"] == 2
    assert scaler.get_scale() == 2.0**8


class _Epochs(Callback):
    """Opens each epoch's history entry, as MetricsRecorder does."""

    def on_epoch_end(self, trainer: Trainer) -> None:
        trainer.state.history.append({"epoch": trainer.state.epoch - 1})


# ------------------------------------------------------------------------------------ two real commands


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*TORCHRUN_VARIABLES, "LOCAL_WORLD_SIZE", "DDPKIT_DEBUG")}
    return env | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_two_commands_with_different_flags_fail_on_both_before_training(tmp_path):
    """Machine 0 has --lr 0.01 and --out, machine 1 neither: both end with the reason within seconds."""
    port = str(free_port())
    command = [shutil.which("ddpkit") or sys.executable, *([] if shutil.which("ddpkit") else ["-m", "ddpkit"])]
    common = ["train", "--world-size", "2", "--host", "127.0.0.1", "--master-port", port, "--no-progress"]
    common += ["--data", "synthetic", "--synthetic-samples", "64", "--hidden", "8", "--depth", "1", "--timeout", "60"]
    flags = [["--rank", "0", "--lr", "0.01", "--out", str(tmp_path / "out")], ["--rank", "1"]]
    procs = []
    for rank, extra in enumerate(flags):
        log = tmp_path / f"rank{rank}.err"
        procs.append((warm_processes.popen([*command, *common, *extra], os.devnull, log, _env(), ROOT), log))
    start = time.monotonic()
    try:
        codes = [p.wait(timeout=180) for p, _ in procs]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    errors = [(tmp_path / f"rank{r}.err").read_text() for r in (0, 1)]
    assert codes == [1, 1], errors
    for rank, err in enumerate(errors):
        assert f"ddpkit: rank {rank} failed: RanksDisagree: ddpkit train: ranks disagree" in err, err
        assert "--lr: 0.01 on rank 0; 0.05" not in err  # adam's default is 0.001
        assert "--lr: 0.01 on rank 0; 0.001 on rank 1" in err and "--out given: yes on rank 0; no on rank 1" in err
        assert "Traceback" not in err and "shared-memory" not in err
    assert time.monotonic() - start < 120
    assert not (tmp_path / "out").exists()


def test_an_elastic_job_on_a_shared_rendezvous_store_is_told_that_machines_cannot_rejoin(monkeypatch):
    from ddpkit.distributed.launch import rejoin_blocked_note

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in rejoin_blocked_note()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives
    assert rejoin_blocked_note() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # not elastic: nothing to rejoin
    assert rejoin_blocked_note() is None
