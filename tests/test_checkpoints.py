"""Checkpoints that cannot be lost: committed folders, checksums, torn and corrupt files, a full disk, --keep,
--checkpoint-every, --resume at another world size / strategy / lr (or refused), and optimizer state that does
not fit the model.
"""

from __future__ import annotations

import csv
import errno
import json
import shutil
import subprocess
import time

import pooled_train
import pytest
import torch
from test_train_cli import DDPKIT, TRAIN, Proc, latest_checkpoint, run, wait_for

from ddpkit.optim import OSS
from ddpkit.optim.state_dict import check_state_shapes
from ddpkit.testing import run_distributed
from ddpkit.train.checkpoints import checkpoint_files as files
from ddpkit.train.checkpoints.checkpoint_files import CheckpointError
from ddpkit.train.workloads.sampler import ResumableSampler

SETTINGS = {
    "strategy": "oss",
    "world_size": 2,
    "optimizer": "adam",
    "adascale": False,
    "amp": "off",
    "lr": 0.01,
    "momentum": None,
    "weight_decay": 0.0,
}


def commit(out, step, payload):
    folder = out / "checkpoint" / files.folder_name(step)
    folder.mkdir(parents=True)
    digest = files.save_file(payload, str(folder / files.SHARED))
    manifest = {"step": step, "epoch": 0, "world_size": 2, "strategy": "oss", "settings": SETTINGS}
    files.write_marker(str(folder), {**manifest, "files": {files.SHARED: digest}})
    return folder


# ------------------------------------------------------------------------------------------- files, one process


def test_torn_corrupt_truncated_and_missing_files_are_named(tmp_path):
    old = commit(tmp_path, 10, {"x": torch.arange(4)})
    new = commit(tmp_path, 20, {"x": torch.arange(8)})
    torn = tmp_path / "checkpoint" / files.folder_name(30)  # a rank died while saving: no marker
    torn.mkdir()
    (torn / files.SHARED).write_bytes(b"half")
    assert files.latest(str(tmp_path)) == str(new)
    manifest = files.read_marker(str(new))
    assert torch.equal(files.load_verified(str(new), files.SHARED, manifest)["x"], torch.arange(8))
    path = new / files.SHARED
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checkpoint file {path} is corrupt: its SHA-256 differs"):
        files.load_verified(str(new), files.SHARED, manifest)
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match=f"{path} is corrupt"):
        files.load_verified(str(new), files.SHARED, manifest)
    path.unlink()
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint file {path}"):
        files.load_verified(str(new), files.SHARED, manifest)
    (old / files.MARKER).write_text('{"step": 10, "epo')  # truncated marker
    with pytest.raises(CheckpointError, match=f"checkpoint marker {old / files.MARKER} is corrupt"):
        files.read_marker(str(old))
    files.prune(str(tmp_path), [new.name])
    assert [f for _, f in files.step_folders(str(tmp_path))] == [str(new)]


class _RunsCodeWhenUnpickled:
    """What a tampered checkpoint file could hold: unpickling it would call `Path.write_text` on a flag file."""

    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return (type(self.flag).write_text, (self.flag, "code ran"))


def test_a_checkpoint_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    flag = tmp_path / "flag"
    folder = commit(tmp_path, 10, {"model": {"w": torch.ones(2)}, "evil": _RunsCodeWhenUnpickled(flag)})
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint file {folder / files.SHARED}: Unpickling"):
        files.load_verified(str(folder), files.SHARED, files.read_marker(str(folder)))
    assert not flag.exists(), "loading a checkpoint file ran code it named"
    kinds = {"t": torch.arange(3), "f": 0.5, "i": 3, "s": "adam", "n": None, "l": [1, (2, 3)], "b": True}
    folder = commit(tmp_path, 20, {"trainer": kinds, "betas": (0.9, 0.999)})  # what ddpkit's checkpoints hold
    loaded = files.load_verified(str(folder), files.SHARED, files.read_marker(str(folder)))
    assert loaded["trainer"]["l"] == [1, (2, 3)] and torch.equal(loaded["trainer"]["t"], torch.arange(3))


def test_a_full_disk_names_the_path_and_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "shared.pt"
    files.save_file({"v": 1}, str(path))
    before = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(CheckpointError, match=f"no space left on device writing {path}$"):
        files.save_file({"v": 2}, str(path))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["shared.pt"]  # the temporary file is gone


def test_resume_policy_continues_or_refuses_with_the_reason():
    manifest = {"step": 40, "epoch": 0, "world_size": 2, "strategy": "oss", "settings": SETTINGS}
    now = {**SETTINGS, "strategy": "sharded", "world_size": 4, "lr": 0.02}
    notes = files.resume_notes(manifest, now)
    assert notes[0] == "resuming from step 40 (epoch 0)"
    assert "strategy oss -> sharded: model and optimizer state carried over" in notes
    assert any(n.startswith("world size 2 -> 4: optimizer state re-split") for n in notes)
    assert "lr 0.01 -> 0.02: the new value takes effect" in notes
    # other data of the same shapes is not refused, but said
    notes = files.resume_notes({**manifest, "settings": {**SETTINGS, "data": "digits"}}, {**SETTINGS, "data": "mnist"})
    assert any(n.startswith("data digits -> mnist: training goes on with the new data") for n in notes), notes
    with pytest.raises(ValueError, match="with --optimizer adam; its state cannot drive --optimizer sgd"):
        files.resume_notes(manifest, {**SETTINGS, "optimizer": "sgd"})
    with pytest.raises(ValueError, match="cannot continue as --strategy slowmo"):
        files.resume_notes(manifest, {**SETTINGS, "strategy": "slowmo"})
    slowmo = {**manifest, "strategy": "slowmo"}
    notes = files.resume_notes(slowmo, {**SETTINGS, "strategy": "slowmo", "world_size": 4})
    assert "every rank starts from the mean of the 2 saved SlowMo replicas and optimizer states" in notes[-1]


def test_resumable_sampler_skips_what_was_consumed_at_any_world_size():
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(101))
    for world in (1, 2, 3):
        for rank in range(world):
            whole = list(DistributedSampler(data, world, rank, shuffle=True, seed=5))
            sampler = ResumableSampler(data, world, rank, seed=5)
            assert list(sampler) == whole
            sampler.set_start(4 * world * 3)  # 3 batches of 4 on every rank
            assert list(sampler) == whole[12:] and len(sampler) == len(whole) - 12
    order = torch.randperm(101, generator=torch.Generator().manual_seed(5)).tolist()
    seen = []  # 2 ranks took 3 batches of 4, then 3 ranks take the rest: every sample once, plus padding
    for rank in range(3):
        sampler = ResumableSampler(data, 3, rank, seed=5)
        sampler.set_start(24)
        seen += list(sampler)
    assert set(order[24:]) <= set(seen) and len(seen) == 3 * 26  # 77 left: 1 of padding
    assert set(seen) - set(order[24:]) == {order[0]}  # padded from the permutation's beginning


# ------------------------------------------------------------------------------------------- optimizer state


def _load_another_models_state(rank, world):
    torch.manual_seed(0)
    mine = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))  # weights 4x6 and 2x4
    other = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))  # as many tensors, other shapes
    source = OSS(other.parameters(), optim=torch.optim.Adam, lr=0.1)
    other(torch.ones(3, 4)).sum().backward()
    source.step()
    source.consolidate_state_dict(recipient_rank=0)
    box = [source.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    saved = box[0]
    target = OSS(mine.parameters(), optim=torch.optim.Adam, lr=0.1)
    try:
        target.load_state_dict(saved)
    except ValueError as exc:
        return str(exc)
    return None


def test_optimizer_state_of_another_model_with_as_many_parameters_is_refused():
    """Before: the counts match, the fused kernel then wrote past the state's end (SIGABRT/SIGSEGV)."""
    for message in run_distributed(_load_another_models_state, 2):
        assert message is not None and "state 'exp_avg' of parameter 0 has shape (6, 4)" in message
        assert "the parameter has shape (4, 6)" in message
    a, b = torch.zeros(4, 6), torch.zeros(2)
    state = {
        "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(24)}},
        "param_groups": [{"params": [0, 1]}],
    }
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 0 has shape \(24,\)"):
        check_state_shapes(state, [a, b])
    state["state"][0]["exp_avg"] = torch.zeros(4, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match="expected floating-point state"):
        check_state_shapes(state, [a, b])
    state["state"][0]["exp_avg"] = torch.zeros(4, 6, dtype=torch.float64)  # torch casts to the parameter's dtype
    check_state_shapes(state, [a, b])


# ------------------------------------------------------------------------------------------- ddpkit train


def steps_of(out):
    with open(out / "steps.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def test_keep_checkpoint_every_and_resume_at_another_world_size_strategy_and_lr(tmp_path):
    """oss on 2 ranks, a checkpoint every 10 steps, the last 2 kept; resumed from step 40 (mid-epoch) on 1 rank
    as sharded with another lr: the lr takes effect, the epoch's remaining samples are trained once, steps.csv
    holds every step once, and the result equals a plain torch Adam (ddp) resumed the same way."""
    first = tmp_path / "first"
    result = pooled_train.train([*TRAIN, "--strategy", "oss", "--checkpoint-every", "10", "--out", first], tmp_path)
    assert result.returncode == 0, str(result)
    kept = [f.name for f in sorted((first / "checkpoint").iterdir())]
    assert kept == ["step-00000040", "step-00000045"], kept  # 10, 20, 30 pruned; the epoch's end is 45
    marker = json.loads((first / "checkpoint" / "step-00000040" / "COMMIT.json").read_text())
    assert marker["step"] == 40 and marker["epoch"] == 0 and marker["epoch_samples"] == 40 * 16 * 2
    assert set(marker["files"]) == {"shared.pt"} and len(marker["files"]["shared.pt"]) == 64
    results = {}
    for strategy in ("sharded", "ddp"):
        out = tmp_path / strategy
        shutil.copytree(first / "checkpoint" / "step-00000040", out / "checkpoint" / "step-00000040")
        flags = [*TRAIN, "--strategy", strategy, "--nproc-per-node", "1", "--lr", "0.02", "--resume", "--out", out]
        results[strategy] = pooled_train.train(flags, tmp_path)
    remaining = 1437 - 40 * 16 * 2  # 157 samples on 1 rank: 10 steps
    for strategy, result in results.items():
        out = tmp_path / strategy
        assert result.returncode == 0, str(result)
        assert "resuming from step 40 (epoch 0)" in result.stderr, str(result)
        assert "world size 2 -> 1: optimizer state re-split" in result.stderr
        assert f"strategy oss -> {strategy}" in result.stderr
        assert "lr 0.01 -> 0.02: the new value takes effect" in result.stderr
        assert steps_of(out) == list(range(40 + -(-remaining // 16)))
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["summary"]["steps"] == 50
        final = torch.load(latest_checkpoint(out) / "shared.pt", weights_only=False)
        assert [g["lr"] for g in final["optimizer"]["param_groups"]] == [0.02]
        assert final["trainer"]["step"] == 50 and final["trainer"]["epoch"] == 1
    carried = torch.load(first / "checkpoint" / "step-00000040" / "shared.pt", weights_only=False)
    totals = carried["trainer"]["carried"]["totals"]  # the first run's, up to step 40
    assert totals["samples"] == 40 * 16 * 2 and totals["sent_bytes"] > 0 and totals["wall_seconds"] > 0
    summary = json.loads((tmp_path / "ddp" / "metrics.json").read_text())["summary"]  # ddp sends nothing on 1 rank
    training = totals["wall_seconds"] - totals["eval_seconds"]  # the first run's, without its evaluations
    assert summary["sent_bytes_total"] == totals["sent_bytes"] and summary["training_seconds"] > training
    assert summary["samples_per_second"] == pytest.approx((totals["samples"] + remaining) / summary["training_seconds"])
    a, b = (torch.load(latest_checkpoint(tmp_path / s) / "shared.pt", weights_only=False)["model"] for s in results)
    for name in a:  # OSS's fused Adam against torch's foreach Adam: the same update up to rounding
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


def test_resume_refusals_and_a_corrupt_file_are_clear_errors(tmp_path):
    out = tmp_path / "out"
    commit(out, 10, {"x": torch.zeros(1)})
    started = time.monotonic()
    result = run(
        [*DDPKIT, "train", *TRAIN, "--strategy", "oss", "--optimizer", "sgd", "--resume", "--out", out],
        120,
        tmp_path,
        "sgd",
    )
    assert result.returncode == 1 and "its state cannot drive --optimizer sgd" in result.stderr, str(result)
    assert "Traceback" not in result.stderr
    # a corrupt file in the newest committed checkpoint (a torn newer folder is ignored): every rank stops
    folder = out / "checkpoint" / "step-00000010"
    (folder / "shared.pt").write_bytes(b"\0" * 10)
    (out / "checkpoint" / "step-00000011").mkdir()
    result = run([*DDPKIT, "train", *TRAIN, "--strategy", "oss", "--resume", "--out", out], 240, tmp_path, "bad")
    assert result.returncode == 1, str(result)
    for rank in (0, 1):
        assert f"ddpkit: rank {rank} failed: CheckpointError: checkpoint file {folder / 'shared.pt'} is corrupt" in (
            result.stderr
        ), str(result)
    assert "Traceback" not in result.stderr and time.monotonic() - started < 200


def _mount_tmpfs(path, size):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


def test_a_real_full_disk_fails_naming_the_path_and_keeps_the_last_checkpoint(tmp_path, procs):
    """--out on a 4 MB tmpfs: once training checkpoints, the disk is filled; the next save fails on every rank
    with "no space left on device" and the path, and the newest committed checkpoint still verifies."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "4m")
    try:
        out = disk / "out"
        job = procs(
            [
                *DDPKIT,
                "train",
                *TRAIN,
                "--epochs",
                "1000",
                "--checkpoint-every",
                "5",
                "--hidden",
                "32",
                "--depth",
                "1",
                "--out",
                out,
            ],
            "full",
        )
        wait_for(out / "checkpoint" / "step-*" / "COMMIT.json", [job])
        with open(disk / "filler", "wb", buffering=0) as f:  # (unbuffered: nothing left for close to write)
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        result = job.wait(120)
        assert result.returncode == 1, str(result)
        assert f"no space left on device writing {out / 'checkpoint'}" in result.stderr, str(result)
        assert "Traceback" not in result.stderr
        folder = files.latest(str(out))
        manifest = files.read_marker(folder)
        state = files.load_verified(folder, files.SHARED, manifest)
        assert state["trainer"]["step"] == manifest["step"] and manifest["step"] % 5 == 0
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_an_unreadable_checkpoint_does_not_start_processes(tmp_path):
    out = tmp_path / "out"
    folder = commit(out, 3, {"x": 1})
    (folder / files.MARKER).write_text("{")
    proc = Proc([*DDPKIT, "train", *TRAIN, "--resume", "--out", out], tmp_path, "marker")
    result = proc.wait(120)
    assert result.returncode == 1 and f"checkpoint marker {folder / files.MARKER} is corrupt" in result.stderr


def test_slowmo_resumed_at_another_world_size_starts_from_the_mean_of_the_replicas(tmp_path):
    """SlowMo's replicas differ between ranks at the checkpoint (45 steps, averaging every 4); resumed on 1 rank
    without training further, the model is exactly the mean of the 2 saved replicas and the slow buffers are kept."""
    from ddpkit.train.checkpoints.checkpoint import mean_state
    from ddpkit.train.loop.report import parameter_digest
    from ddpkit.train.workloads.models import mlp

    out = tmp_path / "out"
    flags = [*TRAIN, "--strategy", "slowmo", "--slowmo-frequency", "8", "--localsgd-frequency", "4", "--out", out]
    result = pooled_train.train(flags, tmp_path)
    assert result.returncode == 0, str(result)
    folder = latest_checkpoint(out)
    saved = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert any(not torch.equal(saved[0]["model"][k], saved[1]["model"][k]) for k in saved[0]["model"])
    result = pooled_train.train([*flags, "--nproc-per-node", "1", "--resume"], tmp_path)
    assert result.returncode == 0, str(result)
    assert "every rank starts from the mean of the 2 saved SlowMo replicas" in result.stderr, str(result)
    model = mlp(64, 10, 256, 2)
    model.load_state_dict({k: torch.stack([s["model"][k] for s in saved]).mean(0) for k in saved[0]["model"]})
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    assert summary["parameter_digests"] == [parameter_digest(model)]  # 0 steps on 1 rank: the mean, exactly
    mean = mean_state([s["optimizer"] for s in saved])
    assert torch.equal(
        mean["state"][0]["exp_avg"],
        (saved[0]["optimizer"]["state"][0]["exp_avg"] + saved[1]["optimizer"]["state"][0]["exp_avg"]) / 2,
    )


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_committed_one(tmp_path):
    """A checkpoint damaged after it was committed is passed over, with a note, for the previous committed one
    (it used to be refused with no way forward named)."""
    out = tmp_path / "out"
    flags = [*TRAIN, "--max-steps", "10", "--checkpoint-every", "5", "--keep", "2", "--out", out]
    first = pooled_train.train(flags, tmp_path)
    assert first.returncode == 0, str(first)
    steps = [step for step, _ in files.committed(str(out))]
    assert steps == [5, 10], steps
    newest = out / "checkpoint" / "step-00000010" / "shared.pt"
    newest.write_bytes(b"\0" * 16)
    again = pooled_train.train([*TRAIN, "--max-steps", "12", "--resume", "--out", out], tmp_path)
    assert again.returncode == 0, str(again)
    assert f"skipped the checkpoint of step 10: checkpoint file {newest} is corrupt" in again.stderr, str(again)
    assert "resuming from step 5" in again.stderr, str(again)
