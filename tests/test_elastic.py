"""A lost machine does not end the job, and a machine that comes back rejoins it: `ddpkit train` under torchrun's
elastic rendezvous on two hosts (network namespaces joined by a veth pair, as root; skipped where not permitted).

Every process of host B is killed mid-run. Host A's rank fails its collective at once, torchrun restarts it in a
new rendezvous round of one node, and ddpkit resumes by itself from the newest complete checkpoint (in --out, a
folder both hosts see) at world size 1: OSS's state re-split, the epoch's remaining samples divided over the one
rank. Host B is then started again: torchrun on host A sees a node waiting, stops its worker and opens a round of
two, and both ranks resume from the newest checkpoint at world size 2. The final model equals, bit for bit, a run
on one host that trained on 2 ranks up to the first checkpoint, on 1 rank up to the second and on 2 ranks from
there; steps.csv counts every step once.

The model is the digits MLP with a pause in its forward (`paced_mlp`, loaded by the ranks through `--model`), so
that a step takes long enough on any machine for a host to leave and come back while the job runs.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train_cli import DDPKIT, _env, latest_checkpoint, wait_for
from torch import nn

from ddpkit.train.workloads.models import mlp

pytestmark = [pytest.mark.slow, pytest.mark.netns]

PAUSE_SECONDS = 0.02
EPOCHS = 10
TRAINING = ["--strategy", "oss", "--batch-size", "16", "--lr", "0.01", "--no-progress", "--timeout", "20"]
TRAINING += ["--checkpoint-every", "5", "--keep", "1000", "--model", "test_elastic:paced_mlp", "--data", "digits"]
STEPS_AT_TWO = 45  # digits: 1,437 samples, 719 per rank, batches of 16
RESUMED = r"resuming from step (\d+) \(epoch \d+\); world size {} -> {}"


class PacedMLP(nn.Module):
    """The digits MLP, pausing `PAUSE_SECONDS` in every forward (the pause changes no number)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(PAUSE_SECONDS)
        return self.net(x)


def paced_mlp() -> nn.Module:
    return PacedMLP()


def environment():
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    return _env(PYTHONPATH=path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # see README: a host that comes back


def torchrun(host, address, out):
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1"]
    args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.78.0.1:29400", "--rdzv-id", "elastic-test"]
    args += ["--rdzv-conf", f"last_call_timeout=10,is_host={int(host)}", "--local-addr", address]
    args += ["--max-restarts", "3", "-m", "ddpkit", "train", *TRAINING, "--epochs", EPOCHS, "--out", out]
    return args


def model_of(folder):
    return torch.load(folder / "shared.pt", weights_only=False)["model"]


def assert_equal_models(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def wait_for_text(proc, pattern, timeout):
    """The first match of `pattern` in `proc`'s stderr, waiting while it runs."""
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, proc.err_path.read_text())):
        proc.watch()
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{proc.name} did not print {pattern!r} within {timeout} s:\n{proc.result()}")
        time.sleep(0.2)
    return found


def committed(out, world_size, after_step):
    """Whether --out holds a complete checkpoint written at `world_size` after step `after_step`."""
    for marker in sorted(Path(out).glob("checkpoint/step-*/COMMIT.json")):
        commit = json.loads(marker.read_text())
        if commit["world_size"] == world_size and int(marker.parent.name[5:]) > after_step:
            return True
    return False


def kill_every_process_of(namespace):
    for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split():
        subprocess.run(["kill", "-9", pid])


def checkpoint(out, step):
    return Path(out) / "checkpoint" / f"step-{step:08d}"


def reference_run(tmp_path, procs, left, rejoined):
    """One host: 2 ranks up to `left`, 1 rank up to `rejoined`, 2 ranks to the end; returns its --out."""
    reference = tmp_path / "reference"
    phases = [
        ["--epochs", EPOCHS, "--max-steps", left],
        ["--epochs", EPOCHS, "--max-steps", rejoined, "--nproc-per-node", "1", "--resume"],
        ["--epochs", EPOCHS, "--resume"],
    ]
    for k, flags in enumerate(phases):
        done = procs([*DDPKIT, "train", *TRAINING, *flags, "--out", reference], f"ref{k}", env=environment()).wait(300)
        assert done.returncode == 0, str(done)
    return reference


def test_a_lost_host_leaves_the_job_running_and_rejoins_when_it_comes_back(tmp_path, procs, two_hosts):
    out = tmp_path / "shared-out"  # both "hosts" see this folder, as on a cluster's shared filesystem
    host_a, host_b = two_hosts
    on = {host: ["ip", "netns", "exec", host] for host in two_hosts}
    b = procs([*on[host_b], *torchrun(False, "10.78.0.2", out)], "hostB", env=environment())
    a = procs([*on[host_a], *torchrun(True, "10.78.0.1", out)], "hostA", env=environment())
    wait_for(checkpoint(out, 10) / "COMMIT.json", [a, b], timeout=240)
    first = json.loads(sorted((out / "checkpoint").glob("step-*/COMMIT.json"))[0].read_text())
    assert first["world_size"] == 2, "the first rendezvous round did not gather both hosts"
    kill_every_process_of(host_b)  # its torchrun agent and its rank
    killed = time.monotonic()
    left = int(wait_for_text(a, RESUMED.format(2, 1), timeout=200).group(1))
    assert 10 <= left < STEPS_AT_TWO and left % 5 == 0
    assert time.monotonic() - killed < 200
    deadline = time.monotonic() + 120
    while not committed(out, 1, left):  # host A trains alone and checkpoints before host B comes back
        assert a.popen.poll() is None and time.monotonic() < deadline, str(a.result())
        time.sleep(0.2)
    b_again = procs([*on[host_b], *torchrun(False, "10.78.0.2", out)], "hostB-again", env=environment())
    for proc in (a, b_again):
        result = proc.wait(400)
        assert result.returncode == 0, str(result)
    rejoined = int(re.search(RESUMED.format(1, 2), a.result().stderr).group(1))
    assert left < rejoined and rejoined % 5 == 0
    assert json.loads((checkpoint(out, rejoined) / "COMMIT.json").read_text())["world_size"] == 1
    reference = reference_run(tmp_path, procs, left, rejoined)
    for step in (left, rejoined):  # each phase across hosts equals the same phase on one host
        assert_equal_models(model_of(checkpoint(out, step)), model_of(checkpoint(reference, step)))
    assert_equal_models(model_of(latest_checkpoint(out)), model_of(latest_checkpoint(reference)))
    with open(out / "steps.csv", newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    assert steps == list(range(summary["steps"])), "a step was counted twice or lost"
    assert summary["world_size"] == 2 and summary["steps"] > rejoined
    shutil.rmtree(tmp_path / "reference")
