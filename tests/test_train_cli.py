"""`ddpkit train` and `ddpkit bench` run as real commands: every strategy at 2 processes, resume, torchrun, the
plain --world-size/--rank/--host form, the torchbearer example, two hosts in network namespaces, and failures
(a killed rank, a stalled rank, a wrong master, Ctrl-C, flags that cannot work).

Every command runs in its own session with a timeout, so a hang fails the test instead of blocking it, and
whatever a test started is killed when it ends. Each start of `ddpkit train` costs several seconds (torch is
imported by the launcher and by every process), so runs are short (1 epoch of digits) and share their outputs.
"""

from __future__ import annotations

import csv
import glob
import gzip
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pooled_train
import pytest
import torch
import warm_processes
from pooled_train import Result

from ddpkit.distributed.launch import TORCHRUN_VARIABLES, free_port
from ddpkit.distributed.local_processes import RANK_NAME_PREFIX
from ddpkit.train.settings.config import STRATEGIES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DDPKIT = [shutil.which("ddpkit") or sys.executable, *([] if shutil.which("ddpkit") else ["-m", "ddpkit"])]
TORCHBEARER_EXAMPLE = ROOT / "examples" / "torchbearer_cpu.py"
# 1 epoch of digits: 1,437 training samples, 719 per rank, 45 steps of 16
TRAIN = ["--epochs", "1", "--no-progress", "--lr", "0.01", "--batch-size", "16", "--timeout", "60"]
DIGITS_STEPS_PER_EPOCH = math.ceil(math.ceil(1437 / 2) / 16)
# SlowMo with its flags: local SGD every 4 steps and a slow-momentum step every 8, so an epoch (45 steps) ends
# between averagings (replicas differ at the checkpoint) and after several slow-momentum updates
SLOWMO = ["--slowmo-frequency", "8", "--localsgd-frequency", "4"]
SGP = ["--slowmo-base", "sgp", "--graph", "ring", "--overlap", "--synch-freq", "2"]
# over slow links: int8 pseudo-gradients with error feedback, 2 fragments merged 2 steps late; the epoch's 45th
# step falls between fragment 1's start (step 44) and its merge (46), so the checkpoint holds a sync in flight
DILOCO = ["--slowmo-compression", "int8", "--slowmo-fragments", "2", "--slowmo-sync-delay", "2"]
DILOCO += ["--slowmo-error-feedback", "--slowmo-nesterov"]
ACCURACY_FLOOR = 0.8  # measured 0.90-0.92 for every strategy after this one epoch
LONG_RUN = ["--epochs", "100000", "--no-progress", "--data", "synthetic", "--synthetic-samples", "512"]
LONG_RUN += ["--hidden", "32", "--depth", "1"]
SLACK = 45.0  # seconds for starting python + torch (launcher and workers) on a busy 2-core machine
PNG = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------- process helpers


def _env(**extra):
    dropped = (*TORCHRUN_VARIABLES, "LOCAL_WORLD_SIZE", "DDPKIT_DEBUG", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


class Proc:
    """A command in its own session (forked warm where it can be: `warm_processes`); output goes to files (no
    pipe can fill up)."""

    def __init__(self, args, log_dir, name, env=None, cwd=None, warm=True):
        self.name = name
        self.out_path = Path(log_dir) / f"{name}.out"
        self.err_path = Path(log_dir) / f"{name}.err"
        self.start = time.monotonic()
        self.out_path.write_text("")
        self.err_path.write_text("")
        self.popen = warm_processes.popen(args, self.out_path, self.err_path, env or _env(), cwd or ROOT, warm)
        self.pid = self.popen.pid
        self.seen: set[tuple[int, int]] = set()  # (pid, start time) of every descendant ever seen: none may outlive

    def watch(self):
        if self.popen.returncode is None:  # once reaped, its pid may belong to another process
            table = _proc_table()
            self.seen |= {(pid, table[pid][3]) for pid in descendants(self.pid, table)}
        return self.seen

    def wait(self, timeout):
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.popen.wait(timeout=10)
            pytest.fail(f"{self.name} did not finish within {timeout:.0f} s:\n{self.result()}")
        return self.result()

    def result(self):
        return Result(
            self.popen.returncode if self.popen.returncode is not None else -999,
            self.out_path.read_text(),
            self.err_path.read_text(),
            time.monotonic() - self.start,
        )

    def kill(self):
        for pid, _ in alive(self.watch()):
            _signal(pid, signal.SIGCONT)
            _signal(pid, signal.SIGKILL)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _proc_table():
    """{pid: (parent pid, state, command line, start time, name)} of every process. A pid alone does not name a
    process: pids are reused (pid_max is often 32768), a pid and its start time (in clock ticks since boot) do."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (
            int(fields[1]),
            fields[0],
            cmdline,
            int(fields[19]),
            stat[stat.index("(") + 1 : stat.rindex(")")],
        )
    return table


def descendants(pid, table=None):
    """The processes below `pid`, without the tests' own spare fork server (`warm_processes.SPARE_NAME`), which
    ends with the command."""
    table = _proc_table() if table is None else table
    found, frontier = set(), {pid}
    while frontier:
        children = {p for p, (ppid, *_) in table.items() if ppid in frontier} - found
        found |= children
        frontier = children
    return {p for p in found if table[p][4] != warm_processes.SPARE_NAME}


def alive(processes):
    """The (pid, start time) pairs whose process still runs (zombies count as ended)."""
    table = _proc_table()
    return {(p, t) for p, t in processes if p in table and table[p][3] == t and table[p][1] not in ("Z", "X")}


def workers(proc):
    """The training processes `ddpkit train` started (named ddpkit-local-N; not the fork server or the resource
    tracker)."""
    seen = proc.watch()
    table = _proc_table()
    return sorted(p for p, t in seen if p in table and table[p][3] == t and table[p][4].startswith(RANK_NAME_PREFIX))


@pytest.fixture
def procs(tmp_path):
    """Starts commands; kills whatever is left of them (their whole session and every child seen) at the end."""
    started: list[Proc] = []

    def start(args, name, **kwargs):
        proc = Proc(args, tmp_path, name, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def run(args, timeout, log_dir, name="cmd", **kwargs):
    proc = Proc(args, log_dir, name, **kwargs)
    try:
        return proc.wait(timeout)
    finally:
        proc.kill()


def train(tmp_path, *flags, name="train", timeout=240):
    return run([*DDPKIT, "train", *flags], timeout, tmp_path, name)


def latest_checkpoint(out):
    """The newest committed checkpoint folder under `out` (None if there is none)."""
    markers = sorted(Path(out).glob("checkpoint/step-*/COMMIT.json"))
    return markers[-1].parent if markers else None


def wait_for(path, procs_running, timeout=180):
    """Waits until `path` (a glob pattern) exists while every process in `procs_running` still runs."""
    deadline = time.monotonic() + timeout
    while not glob.glob(str(path)):
        for proc in procs_running:
            proc.watch()
            if proc.popen.poll() is not None:
                pytest.fail(f"{proc.name} ended before {path} appeared:\n{proc.result()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {timeout} s")
        time.sleep(0.2)
    for proc in procs_running:
        proc.watch()


def wait_gone(pids, timeout=20):
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


# ------------------------------------------------------------------------------------------- output checks


def summary_value(stdout, row):
    match = re.search(rf"^{row}\s+(.+)$", stdout, re.M)
    assert match, f"no {row!r} row in the summary:\n{stdout}"
    return match.group(1).strip()


def check_run(result, out, strategy, epochs=1, world=2, steps=DIGITS_STEPS_PER_EPOCH, floor=ACCURACY_FLOOR, here=2):
    """The summary on stdout and the files under `out` of a finished run; returns metrics.json.

    `here`: how many ranks (0, 1, ...) wrote their checkpoint into this `out` (one per machine across machines).
    """
    assert result.returncode == 0, str(result)
    assert result.stdout.count("replicas equal") == 1, str(result)  # printed once, by rank 0
    assert summary_value(result.stdout, "replicas equal") == "yes", str(result)
    assert summary_value(result.stdout, "strategy").startswith(f"{strategy} on {world} process(es), gloo")
    accuracy = float(summary_value(result.stdout, "test accuracy"))
    assert accuracy > floor, str(result)
    out = Path(out)
    for name in ("metrics.json", "steps.csv", "metrics.png"):
        assert f"wrote {out / name}" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    s = metrics["summary"]
    assert (s["strategy"], s["world_size"], s["epochs"], s["backend"]) == (strategy, world, epochs, "gloo")
    assert s["replicas_equal"] is True
    assert len(s["parameter_digests"]) == world and len(set(s["parameter_digests"])) == 1
    assert s["steps"] == steps * epochs
    assert f"{s['test_accuracy']:.4f}" == f"{accuracy:.4f}"
    assert len(s["peak_memory_mb"]) == world and all(m > 10 for m in s["peak_memory_mb"])
    assert s["wall_seconds"] > 0 and s["samples_per_second"] > 0
    assert s["sent_bytes_per_step"] > 0 and s["sent_bytes_total"] > 0
    assert [e["epoch"] for e in metrics["epochs"]] == list(range(epochs))
    for entry in metrics["epochs"]:
        assert 0 <= entry["test_accuracy"] <= 1 and 0 <= entry["train_accuracy"] <= 1
        assert math.isfinite(entry["train_loss"]) and entry["sent_bytes"] > 0
    assert metrics["epochs"][-1]["steps"] == s["steps"]
    with open(out / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    columns = {"epoch", "step", "loss", "correct", "samples", "seconds", "sent_bytes", "shared_bytes", "targets"}
    columns.add("loop_seconds")  # the loop's clock at each step's end
    assert set(rows[0]) == columns
    assert all(float(r["shared_bytes"]) >= 0 for r in rows)  # > 0 with OSS on one host (checked below)
    assert len(rows) == steps * epochs
    assert [int(r["step"]) for r in rows] == list(range(len(rows)))
    assert all(math.isfinite(float(r["loss"])) and int(r["samples"]) > 0 for r in rows)
    png = (out / "metrics.png").read_bytes()
    assert png.startswith(PNG) and len(png) > 5000
    folder = latest_checkpoint(out)
    meta = json.loads((folder / "COMMIT.json").read_text())
    assert (meta["epoch"], meta["step"], meta["world_size"], meta["strategy"]) == (epochs, s["steps"], world, strategy)
    ranks = here if strategy == "slowmo" else 0  # only SlowMo's replicas differ: the others' is in shared.pt
    for name in ["shared.pt", *(f"rank{r}.pt" for r in range(ranks))]:
        assert (folder / name).is_file()
    assert not (folder / f"rank{ranks}.pt").exists()
    return metrics


# ------------------------------------------------------------------------------------------- every strategy


# name: (strategy, extra flags, optimizer steps per epoch)
VARIANTS = {
    "ddp": ("ddp", [], DIGITS_STEPS_PER_EPOCH),
    "oss": ("oss", [], DIGITS_STEPS_PER_EPOCH),
    "sharded": ("sharded", [], DIGITS_STEPS_PER_EPOCH),
    "slowmo": ("slowmo", SLOWMO, DIGITS_STEPS_PER_EPOCH),
    # SGP on a ring, overlapped two steps: the checkpoint holds a gossip round in flight
    "sgp": ("slowmo", [*SLOWMO, *SGP], DIGITS_STEPS_PER_EPOCH),
    "diloco": ("slowmo", [*SLOWMO, *DILOCO], DIGITS_STEPS_PER_EPOCH),
    # AdaScale on OSS + ShardedDataParallel, 2 batches per step: 45 batches make 23 steps
    "adascale": ("sharded", ["--optimizer", "sgd", "--lr", "0.05", "--adascale", "--grad-accum", "2"], 23),
}


def variant_flags(name):
    strategy, extra, _ = VARIANTS[name]
    return ["--strategy", strategy, *extra]


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """`ddpkit train` for 1 epoch of digits at 2 processes, once per variant per module: (result, --out). The
    line runs on the pooled ranks (tests/pooled_train.py): these tests check training, not the launch."""
    runs = {}

    def get(name):
        if name not in runs:
            folder = tmp_path_factory.mktemp(f"one-epoch-{name}")
            result = pooled_train.train([*TRAIN, *variant_flags(name), "--out", folder / "out"], folder)
            runs[name] = (result, folder / "out")
        return runs[name]

    return get


@pytest.mark.parametrize("name", [*STRATEGIES, "adascale"])
def test_every_strategy_trains_one_epoch_at_two_processes(one_epoch, name):
    result, out = one_epoch(name)
    strategy, _, steps = VARIANTS[name]
    check_run(result, out, strategy, steps=steps)


def test_strategies_send_what_they_should(one_epoch):
    """On one host OSS's parameters and ShardedDataParallel's gradients go through shared memory: sharded puts
    only 1-byte signals on the wire, oss the same as ddp (DDP's all-reduce), slowmo less. Across hosts sharded
    sends exactly ddp's bytes (test_sharded_ddp, test_wire_bytes)."""
    sent = {}
    for strategy in STRATEGIES:
        result, out = one_epoch(strategy)
        assert result.returncode == 0, str(result)
        sent[strategy] = json.loads((out / "metrics.json").read_text())["summary"]["sent_bytes_per_step"]
    assert 0 < sent["sharded"] < 0.01 * sent["ddp"]
    shared = {}
    for strategy in STRATEGIES:
        summary = json.loads((one_epoch(strategy)[1] / "metrics.json").read_text())["summary"]
        shared[strategy] = summary["shared_memory_bytes_per_step"]
    assert shared["ddp"] == shared["slowmo"] == 0, shared
    assert shared["sharded"] > shared["oss"] > 0, shared  # gradients and parameters / parameters only
    assert sent["oss"] == pytest.approx(sent["ddp"], rel=0.02)
    assert sent["slowmo"] < 0.5 * sent["ddp"]


def test_slowmo_over_slow_links_trains_and_records_its_settings(one_epoch):
    """--slowmo-compression int8, 2 fragments, a delay of 2, error feedback, outer Nesterov: trains like SlowMo,
    sends less, records its settings, and each rank's checkpoint carries its residual and the sync in flight."""
    result, out = one_epoch("diloco")
    metrics = check_run(result, out, "slowmo")
    slowmo = metrics["summary"]["settings"]["slowmo"]
    assert {k: slowmo[k] for k in ("slowmo_compression", "slowmo_fragments", "slowmo_sync_delay")} == {
        "slowmo_compression": "int8",
        "slowmo_fragments": 2,
        "slowmo_sync_delay": 2,
    }
    assert slowmo["slowmo_error_feedback"] and slowmo["slowmo_nesterov"] and slowmo["slowmo_merge_alpha"] == 0.5
    assert "int8 pseudo-gradients in 2 fragment(s), merged 2 step(s) late (alpha 0.5), error feedback" in result.stdout
    plain = one_epoch("slowmo")[1]
    sent = json.loads((plain / "metrics.json").read_text())["summary"]["sent_bytes_total"]
    assert metrics["summary"]["sent_bytes_total"] < 0.5 * sent  # int8 instead of fp32 between the nodes
    states = [torch.load(latest_checkpoint(out) / f"rank{r}.pt", weights_only=False)["slowmo"] for r in (0, 1)]
    for state in states:
        assert list(state["outer_in_flight"]) == [1] and state["outer_in_flight"][1]["start"] == 44
        assert state["outer_residual"].abs().max() > 0
    assert not torch.equal(states[0]["outer_residual"], states[1]["outer_residual"])  # each node its own
    assert torch.equal(states[0]["outer_synced"], states[1]["outer_synced"])


@pytest.mark.parametrize("name", ["sharded", "slowmo", "sgp", "diloco", "adascale"])
def test_resume_equals_uninterrupted(one_epoch, tmp_path, name):
    """1 epoch, then --resume to 2, ends bit-identical to 2 epochs straight (optimizer, SlowMo and AdaScale
    state restored; for SlowMo the replicas differ between ranks at the checkpoint: 45 steps, averaging every 4)."""
    first, first_out = one_epoch(name)
    assert first.returncode == 0, str(first)
    strategy, _, per_epoch = VARIANTS[name]
    if name in ("slowmo", "sgp", "diloco"):  # the cases that need each rank's own replica and optimizer state back
        ckpt = [torch.load(latest_checkpoint(first_out) / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert any(not torch.equal(ckpt[0]["model"][k], ckpt[1]["model"][k]) for k in ckpt[0]["model"])
        exp_avg = [c["optimizer"]["state"][0]["exp_avg"] for c in ckpt]
        assert not torch.equal(*exp_avg)
    resumed = tmp_path / "resumed"
    shutil.copytree(first_out / "checkpoint", resumed / "checkpoint")
    flags = [*TRAIN, *variant_flags(name), "--epochs", "2"]
    again = pooled_train.train([*flags, "--resume", "--out", resumed], tmp_path)
    straight = pooled_train.train([*flags, "--out", tmp_path / "straight"], tmp_path)
    check_run(straight, tmp_path / "straight", strategy, epochs=2, steps=per_epoch)
    assert again.returncode == 0, str(again)
    a = json.loads((resumed / "metrics.json").read_text())
    b = json.loads((tmp_path / "straight" / "metrics.json").read_text())
    assert a["summary"]["parameter_digests"] == b["summary"]["parameter_digests"]
    assert a["summary"]["replicas_equal"]
    assert a["summary"]["steps"] == b["summary"]["steps"] == 2 * per_epoch
    assert a["summary"]["test_accuracy"] == b["summary"]["test_accuracy"]
    for x, y in zip(a["epochs"], b["epochs"], strict=True):  # epoch 0 comes from the checkpoint
        assert {k: v for k, v in x.items() if k not in ("seconds", "sent_bytes")} == {
            k: v for k, v in y.items() if k not in ("seconds", "sent_bytes")
        }
        # the resumed run's first OSS step agrees on shared memory again: one small object all-gather more
        assert 0 <= x["sent_bytes"] - y["sent_bytes"] < 4096, (x["sent_bytes"], y["sent_bytes"])
    with open(resumed / "steps.csv", newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == list(range(2 * per_epoch))  # the first epoch's rows were kept
    # the held-out series goes on: the first run's evaluations (by default about 15 a run: every 3 of its 45 steps,
    # every 2 of AdaScale's 23), then the same evaluations as the uninterrupted run's (every 6 of 90)
    every = round(per_epoch / 15)
    first = sorted({*range(every, per_epoch + 1, every), per_epoch})  # and at the epoch's end
    assert [p["step"] for p in a["heldout"] if p["step"] <= per_epoch] == first
    assert [p for p in a["heldout"] if p["step"] > per_epoch] == [p for p in b["heldout"] if p["step"] > per_epoch]
    # the checkpoints after epoch 2 (SlowMo: each rank's replica before the final averaging) are bit-identical too
    for file in ["rank0.pt", "rank1.pt"] if name in ("slowmo", "sgp", "diloco") else ["shared.pt"]:
        x = torch.load(latest_checkpoint(resumed) / file, weights_only=False)["model"]
        y = torch.load(latest_checkpoint(tmp_path / "straight") / file, weights_only=False)["model"]
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# ------------------------------------------------------------------------------------------- other launchers


def test_torchrun_with_a_toml_config_and_overriding_flags(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        'strategy = "ddp"\nepochs = 3\nhidden = 128\ndepth = 1\nbatch-size = 16\nlr = 0.01\n'
        "progress = false\ntimeout = 60.0\n"
    )
    out = tmp_path / "out"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args += ["-m", "ddpkit", "train", "--config", config, "--epochs", "1", "--out", out]
    result = run(args, 240, tmp_path, "torchrun")
    metrics = check_run(result, out, "ddp")  # torchrun's 2 processes, not 2 spawned by each of them
    assert metrics["summary"]["epochs"] == 1  # the flag beat the file's 3
    model = torch.load(latest_checkpoint(out) / "shared.pt", weights_only=False)["model"]
    # the file's hidden = 128 and depth = 1: Flatten, Linear(64, 128), ReLU, Linear(128, 10)
    assert {k: tuple(v.shape) for k, v in model.items() if k.endswith("weight")} == {
        "1.weight": (128, 64),
        "3.weight": (10, 128),
    }


def _idx(array):
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_tiny_mnist(folder, train=64, test=16):
    """Four MNIST-format IDX files, the training pair gzipped and the test pair not: a bright band per class."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n, gz in (("train", train, True), ("t10k", test, False)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 60, (n, 28, 28))
        for i, label in enumerate(labels):
            images[i, 2 * label + 4 : 2 * label + 6, :] = 255
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            raw = _idx(array)
            name = f"{prefix}-{kind}-ubyte"
            if gz:
                (folder / f"{name}.gz").write_bytes(gzip.compress(raw))
            else:
                (folder / name).write_bytes(raw)


def test_world_size_rank_host_two_commands_on_tiny_mnist(tmp_path, procs):
    """Two separately started commands, one process each (torchbearer's CPU tutorial), a CNN on IDX files."""
    data = tmp_path / "mnist"
    write_tiny_mnist(data)
    port = free_port()
    common = ["--world-size", "2", "--host", "127.0.0.1", "--master-port", port, "--data", "mnist"]
    common += ["--data-dir", data, "--model", "cnn", "--epochs", "1", "--batch-size", "8", "--timeout", "60"]
    ranks = [
        procs([*DDPKIT, "train", *common, "--rank", r, "--out", tmp_path / f"out{r}"], f"rank{r}") for r in (0, 1)
    ]  # progress bar on: only rank 0 shows it
    zero, one = (p.wait(240) for p in ranks)
    assert one.returncode == 0, str(one)
    # 64 images, 32 per rank, batches of 8: 4 steps, too few for an accuracy claim
    check_run(zero, tmp_path / "out0", "sharded", steps=4, floor=-1, here=1)
    assert "replicas equal" not in one.stdout
    assert "sharded x2" in zero.stderr and "step" in zero.stderr  # rank 0's tqdm bar
    assert "sharded x2" not in one.stderr
    assert not list((tmp_path / "out1").glob("checkpoint/*/*"))  # equal replicas: rank 0 writes the checkpoint
    assert not (tmp_path / "out1" / "metrics.json").exists()
    # the two commands found each other on this machine and split its cores (each took all of them before: 4x slower
    # on 2 cores than with one thread each)
    settings = json.loads((tmp_path / "out0" / "metrics.json").read_text())["summary"]["settings"]
    assert settings["threads_per_rank"] == max(1, len(os.sched_getaffinity(0)) // 2)


def test_sharded_ranks_map_large_blocks_in_huge_pages_where_the_machine_has_them(tmp_path):
    """--allocator auto with --strategy sharded: the launcher starts its ranks with glibc's huge pages for mappings
    and each maps blocks of 8 MiB or more alone, as the run's record says; with ddp nothing changes. (Started cold:
    a warm command's spare fork server started before the launcher set its ranks' environment.)"""
    huge = machine_has_huge_pages_for_glibc()
    for strategy, mapped in (("sharded", huge), ("ddp", False)):
        out = tmp_path / strategy
        flags = [*TRAIN, "--nproc-per-node", "2", "--strategy", strategy, "--max-steps", "2", "--no-checkpoints"]
        flags += ["--out", out]
        result = run([*DDPKIT, "train", *flags], 240, tmp_path, strategy, warm=False)
        assert result.returncode == 0, str(result)
        settings = json.loads((out / "metrics.json").read_text())["summary"]["settings"]
        expected = {"large_blocks_mapped_from_bytes": 8 * 2**20 if mapped else None, "huge_pages": mapped}
        assert settings["allocator"] == expected, strategy


def machine_has_huge_pages_for_glibc():
    """glibc 2.35 or later (its glibc.malloc.hugetlb tunable) and the kernel's transparent huge pages on."""
    try:
        major, minor = map(int, os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except (ValueError, OSError, AttributeError, IndexError):
        return False
    return (major, minor) >= (2, 35) and ("[always]" in mode or "[madvise]" in mode)


def test_torchbearer_example_at_two_processes(tmp_path, procs):
    pytest.importorskip("torchbearer")
    port = free_port()
    args = [sys.executable, TORCHBEARER_EXAMPLE, "--world-size", "2", "--host", "127.0.0.1", "--port", port]
    args += ["--epochs", "1", "--timeout", "60"]
    ranks = [procs([*args, "--rank", r], f"tb{r}") for r in (0, 1)]
    zero, one = (p.wait(240) for p in ranks)
    assert zero.returncode == 0 and one.returncode == 0, f"{zero}\n{one}"
    assert "replicas equal: True" in zero.stdout, str(zero)
    digests = json.loads(re.search(r"parameter checksums per rank: (\[.*\])", zero.stdout).group(1))
    assert len(digests) == 2 and digests[0] == digests[1]
    assert float(re.search(r"test accuracy: ([\d.]+)", zero.stdout).group(1)) > ACCURACY_FLOOR
    assert one.stdout.strip() == "" and "replicas equal" not in one.stderr  # only rank 0 prints


# ------------------------------------------------------------------------------------------- two hosts


def _ip(*args, check=True):
    result = subprocess.run(["ip", *map(str, args)], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(map(str, args))}: {result.stderr.strip()}")
    return result


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: 10.78.0.1/24 and 10.78.0.2/24; torn down afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("two hosts need iproute2's `ip` command")
    tag = uuid.uuid4().hex[:8]
    names = [f"ddpkit-{tag}-{side}" for side in "ab"]
    veths = [f"dk{tag}{side}" for side in "ab"]  # interface names have at most 15 characters
    created: list[str] = []
    try:
        for name in names:
            probe = _ip("netns", "add", name, check=False)
            if probe.returncode != 0:
                pytest.skip(f"network namespaces are not permitted here (`ip netns add`: {probe.stderr.strip()})")
            created.append(name)
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for name, veth, address in zip(names, veths, ("10.78.0.1/24", "10.78.0.2/24"), strict=True):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", address, "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in created:
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                _signal(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
        _ip("link", "del", veths[0], check=False)  # only left if it never moved into a namespace


@pytest.mark.netns
def test_two_hosts_in_network_namespaces(tmp_path, procs, two_hosts):
    common = ["--nnodes", "2", "--master-addr", "10.78.0.1", "--master-port", "29500", "--nproc-per-node", "1"]
    common += [*TRAIN, *variant_flags("slowmo")]
    hosts = [
        procs(
            ["ip", "netns", "exec", ns, *DDPKIT, "train", *common, "--node-rank", i, "--out", tmp_path / f"host{i}"],
            f"host{i}",
        )
        for i, ns in enumerate(two_hosts)
    ]
    first, second = (h.wait(300) for h in hosts)
    assert second.returncode == 0, str(second)
    check_run(first, tmp_path / "host0", "slowmo", here=1)
    assert list((tmp_path / "host1").glob("checkpoint/step-*/rank1.pt"))  # SlowMo: each machine its own replica


def listening(pid, port):
    """Whether a TCP socket listens on `port` in the network namespace `ip netns exec` moved process `pid` into.

    False while `pid` has not moved yet (its tables are then ours, where anything may listen on `port`); None
    when it cannot be told (the process has ended)."""
    try:
        if os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            return False
    except OSError:
        return None
    read = False
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            fields = line.split()
            if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":
                return True
    return False if read else None


@pytest.mark.netns
def test_two_hosts_that_cannot_connect_fail_within_the_timeout(tmp_path, procs, two_hosts):
    """gloo told to use loopback (a misconfiguration) cannot reach the other host: both fail within the timeout
    (plus ddpkit's join grace), where gloo alone would wait five times the timeout on the master's side."""
    timeout = 6
    common = ["--nnodes", "2", "--master-addr", "10.78.0.1", "--master-port", "29500", "--nproc-per-node", "1"]
    common += ["--no-progress", "--timeout", timeout]
    joining = time.monotonic()
    hosts = [
        procs(
            ["ip", "netns", "exec", ns, *DDPKIT, "train", *common, "--node-rank", i],
            f"host{i}",
            env=_env(GLOO_SOCKET_IFNAME="lo"),
        )
        for i, ns in enumerate(two_hosts)
    ]
    # Joining begins when the master's rendezvous store listens. A refused connection can fail the join in less
    # than one poll interval, so the master may be gone before it is ever seen listening. The last poll that saw
    # it alive and not listening is a lower bound on when joining began, which keeps the time check strict.
    deadline = time.monotonic() + 120
    while True:
        polled = time.monotonic()
        if hosts[0].popen.poll() is not None or listening(hosts[0].pid, 29500) is not False:  # or cannot tell
            break
        joining = polled
        hosts[0].watch(), hosts[1].watch()
        assert polled < deadline, "the master never started listening"
        time.sleep(0.1)
    master = hosts[0].wait(5 * timeout + 60)
    # timeout, the 5 s join grace, the launcher noticing: well under gloo's own 5 x timeout = 30 s
    assert time.monotonic() - joining < timeout + 5 + 8, str(master)
    for i, (host, result) in enumerate(zip(hosts, [master, hosts[1].wait(5 * timeout + 60)], strict=True)):
        assert result.returncode == 1, str(result)
        assert f"rank {i} could not join the job at 10.78.0.1:29500 within {timeout} s" in result.stderr, str(result)
        assert "interface lo" in result.stderr
        assert not wait_gone(host.seen), "processes outlived the job"


# ------------------------------------------------------------------------------------------- failures


def test_killed_rank_ends_the_other_machine_with_a_clear_message(tmp_path, procs):
    timeout = 15
    port = free_port()
    common = ["--world-size", "2", "--host", "127.0.0.1", "--master-port", port, *LONG_RUN, "--timeout", timeout]
    ranks = [procs([*DDPKIT, "train", *common, "--rank", r, "--out", tmp_path / f"out{r}"], f"rank{r}") for r in (0, 1)]
    wait_for(tmp_path / "out0" / "checkpoint" / "step-*" / "COMMIT.json", ranks)  # training is under way
    (victim,) = workers(ranks[1])
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    survivor = ranks[0].wait(timeout + 60)
    assert time.monotonic() - killed < timeout + 10, str(survivor)
    assert survivor.returncode == 1, str(survivor)
    assert "ddpkit: rank 0 failed:" in survivor.stderr, str(survivor)
    # the peer's socket closed, or (a loaded machine: gloo sometimes reports the send, not the reset) timed out
    assert re.search(r"closed by peer|remote worker|timed out|Connection reset", survivor.stderr, re.I), survivor
    assert "ddpkit: error: local process 0 failed" in survivor.stderr
    assert "Traceback" not in survivor.stderr
    dead = ranks[1].wait(30)
    assert dead.returncode == 1 and "terminated with signal SIGKILL" in dead.stderr, str(dead)
    assert not wait_gone(ranks[0].seen | ranks[1].seen), "processes outlived the job"


def test_a_stopped_rank_on_another_machine_is_ended_by_its_launcher(tmp_path, procs):
    """Two machines on loopback; rank 1's process is stopped (SIGSTOP): rank 0's machine fails within --timeout,
    and rank 1's launcher, whose only rank never ends by itself, ends it once it has been stopped past --timeout
    (it waited forever) and names why; no process is left on either."""
    timeout = 6
    port = free_port()
    common = ["--world-size", "2", "--host", "127.0.0.1", "--master-port", port, *LONG_RUN, "--timeout", timeout]
    ranks = [procs([*DDPKIT, "train", *common, "--rank", r, "--out", tmp_path / f"out{r}"], f"rank{r}") for r in (0, 1)]
    wait_for(tmp_path / "out0" / "checkpoint" / "step-*" / "COMMIT.json", ranks)
    (stopped,) = workers(ranks[1])
    os.kill(stopped, signal.SIGSTOP)
    since = time.monotonic()
    first = ranks[0].wait(timeout + 60)
    assert first.returncode == 1 and "ddpkit: rank 0 failed:" in first.stderr, str(first)
    second = ranks[1].wait(timeout + 15 + 60)
    assert time.monotonic() - since < timeout + 15 + 40, str(second)
    assert second.returncode == 1, str(second)
    assert "local process 0 was stopped (SIGSTOP or Ctrl-Z) for more than 21 s" in second.stderr, str(second)
    assert not wait_gone(ranks[0].seen | ranks[1].seen), "processes outlived the job"


def test_stalled_rank_fails_the_job_within_the_timeout(tmp_path, procs):
    """A rank that stops answering (SIGSTOP) without dying: the collective timeout ends the job."""
    timeout = 6
    job = procs([*DDPKIT, "train", *LONG_RUN, "--timeout", timeout, "--out", tmp_path / "out"], "job")
    wait_for(tmp_path / "out" / "checkpoint" / "step-*" / "COMMIT.json", [job])
    ranks = workers(job)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGSTOP)
    stopped = time.monotonic()
    result = job.wait(timeout + 90)
    assert result.returncode == 1, str(result)
    assert time.monotonic() - stopped < timeout + 20, str(result)
    assert re.search(r"ddpkit: rank \d failed: .*", result.stderr), str(result)
    assert "ddpkit: error: local process" in result.stderr
    # the ledger's diagnosis names where the answering rank was and that the stopped one never reported
    assert re.search(r"ddpkit: rank 0 saw rank 0: collective #\d+, \w+ of \d+ B on ", result.stderr), str(result)
    assert "ddpkit: rank 0 saw rank 1: no report" in result.stderr, str(result)
    assert not wait_gone(job.seen), "processes outlived the job (the stopped one must be killed)"


def test_wrong_master_address_fails_within_the_timeout_naming_it(tmp_path):
    timeout = 3
    port = free_port()  # nobody listens there, and outside the ephemeral range no socket is given it meanwhile
    flags = ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    flags += ["--master-port", port, "--no-progress", "--timeout", timeout]
    result = train(tmp_path, *flags, timeout=timeout + SLACK + 30)
    assert result.returncode == 1, str(result)
    assert f"rank 1 could not join the job at 127.0.0.1:{port} within {timeout} s" in result.stderr, str(result)
    assert "--master-addr" in result.stderr
    # default --timeout is 60 s: finishing well before shows the flag is honoured
    assert result.seconds < timeout + 5 + SLACK, str(result)


@pytest.mark.parametrize("target", ["launcher", "group", "ignored"])
def test_ctrl_c_stops_every_local_process(tmp_path, procs, target):
    """SIGINT to the launcher alone, or to its whole process group as a terminal's Ctrl-C does; also to a launcher
    started with SIGINT ignored, as a shell starts background jobs (it could not be stopped so)."""
    command = [*DDPKIT, "train", *LONG_RUN, "--out", tmp_path / "out"]
    if target == "ignored":
        command = ["bash", "-c", 'trap "" INT; exec "$@"', "bash", *command]
    job = procs(command, "job")
    wait_for(tmp_path / "out" / "checkpoint" / "step-*" / "COMMIT.json", [job])
    assert len(workers(job)) == 2
    if target in ("launcher", "ignored"):
        os.kill(job.pid, signal.SIGINT)
    else:
        os.killpg(job.pid, signal.SIGINT)
    result = job.wait(60)
    assert result.returncode == 130, str(result)
    assert "interrupted; stopped every local process" in result.stderr
    assert "Traceback" not in result.stderr, str(result)
    assert not wait_gone(job.seen), "processes outlived Ctrl-C"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--strategy", "zero3"], "argument --strategy: invalid choice: 'zero3'"),
        (["--data", "mnist", "--data-dir", "{empty}"], "MNIST files missing in '{empty}': train-images-idx3-ubyte"),
        (["--world-size", "2", "--rank", "2", "--host", "127.0.0.1"], "--rank must be in [0, --world-size=2)"),
    ],
)
def test_invalid_commands_fail_before_any_process_starts(tmp_path, flags, needle):
    (tmp_path / "empty").mkdir()
    flags = [f.format(empty=tmp_path / "empty") for f in flags]
    proc = Proc([*DDPKIT, "train", *flags, "--out", tmp_path / "out"], tmp_path, "bad")
    seen = set()
    while proc.popen.poll() is None and time.monotonic() - proc.start < 60:
        seen |= descendants(proc.pid)
        time.sleep(0.05)
    result = proc.wait(1)
    assert result.returncode in (1, 2), str(result)
    assert needle.format(empty=tmp_path / "empty") in result.stderr, str(result)
    assert not seen, "a process was started"
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- what the run reports


def gpt_parameters(layers, width, context, vocab=256):
    """A GPT's parameter count from its layers (independent of ddpkit's code): per block q, k, v and output
    projections with biases (4 w^2 + 4 w), a 4x MLP with biases (8 w^2 + 5 w) and two LayerNorms (4 w); token and
    position embeddings ((vocab + context) w, the output layer tied to the token embedding) and a final
    LayerNorm (2 w)."""
    block = (4 * width * width + 4 * width) + (8 * width * width + 5 * width) + 4 * width
    return layers * block + (vocab + context) * width + 2 * width


def wait_session_gone(proc, timeout=60):
    """Waits until no process of `proc`'s session is left: the multiprocessing resource tracker outlives the
    launcher for a moment, and writes its warnings to the same stderr when it ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"processes of {proc.name}'s session still run after {timeout} s")


def test_a_short_gpt_run_reports_what_happened(tmp_path, procs):
    """A custom-size GPT (smaller than the README's, whose line test_readme runs), with the progress bar, stopped by
    --max-steps in its first epoch: no warning of leaked semaphores at exit, the model's shape and parameter count
    (not "default"), where --max-steps stopped it (not "5 epoch(s)"), the command's wall time (not the training
    loop's), and a held-out curve of about 15 evaluations (not a single point at the epoch's end)."""
    assert gpt_parameters(6, 384, 128) == 10_795_008  # the README's figure for the default GPT
    out = tmp_path / "out"
    flags = ["--model", "gpt", "--data", "text", "--gpt-layers", "1", "--gpt-width", "32", "--gpt-heads", "2"]
    flags += ["--context", "32", "--lr", "3e-3", "--batch-size", "8", "--max-steps", "30", "--timeout", "60"]
    proc = procs([*DDPKIT, "train", *flags, "--out", out], "gpt")
    result = proc.wait(300)
    assert result.returncode == 0, str(result)
    wait_session_gone(proc)
    stderr = proc.err_path.read_text()  # with whatever the resource tracker wrote as it ended
    assert "step/s" in stderr, f"no progress bar:\n{stderr}"
    assert "leaked semaphore" not in stderr and "resource_tracker" not in stderr, stderr
    parameters = gpt_parameters(1, 32, 32)
    size = f"1 layer, width 32, 2 heads, context 32; {parameters:,} parameters"
    assert summary_value(result.stdout, "model and data") == f"gpt ({size}) on text, seed 0"
    metrics = json.loads((out / "metrics.json").read_text())
    s = metrics["summary"]
    assert (s["settings"]["model_size"], s["settings"]["parameters"]) == (size, parameters)
    windows = math.ceil(math.ceil(text_windows(32) / 2) / 8)  # steps per epoch: 8 windows per step per rank
    stopped = f"stopped by --max-steps at step 30, in epoch 1 of 5 ({windows} steps per epoch)"
    assert summary_value(result.stdout, "length") == stopped
    assert (s["epochs"], s["epochs_completed"], s["stopped_by_max_steps"], s["steps"]) == (5, 0, True, 30)
    wall = float(summary_value(result.stdout, "wall time").split()[0])
    assert f"{s['wall_seconds']:.1f}" == f"{wall:.1f}"
    # from the command's start to the summary: all but what follows it (metrics files, exit) of the measured time
    assert 0.5 * result.seconds < s["wall_seconds"] <= result.seconds + 0.1, (s, result.seconds)
    assert s["training_seconds"] + s["evaluation_seconds"] < s["wall_seconds"]
    assert summary_value(result.stdout, "training time").startswith(f"{s['training_seconds']:.1f} s (the training")
    # held-out every 2 steps by default (30 steps / 15), the last one where the run stopped
    assert [p["step"] for p in metrics["heldout"]] == list(range(2, 31, 2))
    bits = [p["test_loss"] / math.log(2) for p in metrics["heldout"]]
    assert bits[-1] == pytest.approx(s["heldout_bits_per_byte"], rel=1e-6) and bits[-1] < bits[0]


def text_windows(context):
    """The training windows of --data text at `context` bytes (ddpkit.train.workloads.text, read here in this
    process)."""
    from ddpkit.train.workloads.text import text

    return len(text(context)[0])


# ------------------------------------------------------------------------------------------- bench


# (`ddpkit bench` on every strategy: tests/test_readme.py runs the README's line and checks its table and rows)
