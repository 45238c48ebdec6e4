"""A lost machine does not end the job: `ddpkit train` under torchrun's elastic rendezvous on two hosts (network
namespaces joined by a veth pair, as root; skipped where not permitted).

Every process of host B is killed mid-run. Host A's rank fails its collective at once, torchrun restarts it in a
new rendezvous round of one node, and ddpkit resumes by itself from the newest complete checkpoint (in --out, a
folder both hosts see) at world size 1: OSS's state re-split, the epoch's remaining samples divided over the one
rank. The final model equals, bit for bit, a run on one host that trained on 2 ranks up to that checkpoint and
went on with 1 rank from it; steps.csv counts every step once.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from test_train_cli import DDPKIT, latest_checkpoint, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.netns]

TRAINING = ["--strategy", "oss", "--batch-size", "16", "--lr", "0.01", "--no-progress", "--timeout", "20"]
TRAINING += ["--checkpoint-every", "5", "--keep", "1000"]
STEPS_AT_TWO = 45  # digits: 1,437 samples, 719 per rank, batches of 16


def torchrun(host, address, out, epochs):
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1"]
    args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.78.0.1:29400", "--rdzv-id", "elastic-test"]
    args += ["--rdzv-conf", f"last_call_timeout=10,is_host={int(host)}", "--local-addr", address]
    args += ["--max-restarts", "3", "-m", "ddpkit", "train", *TRAINING, "--epochs", epochs, "--out", out]
    return args


def model_of(folder):
    return torch.load(folder / "shared.pt", weights_only=False)["model"]


def assert_equal_models(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_lost_host_leaves_the_job_running_on_the_other(tmp_path, procs, two_hosts):
    out = tmp_path / "shared-out"  # both "hosts" see this folder, as on a cluster's shared filesystem
    host_a, host_b = two_hosts
    b = procs(["ip", "netns", "exec", host_b, *torchrun(False, "10.78.0.2", out, 2)], "hostB")
    a = procs(["ip", "netns", "exec", host_a, *torchrun(True, "10.78.0.1", out, 2)], "hostA")
    wait_for(out / "checkpoint" / "step-0000001[05]" / "COMMIT.json", [a, b], timeout=240)
    first = json.loads(sorted((out / "checkpoint").glob("step-*/COMMIT.json"))[0].read_text())
    assert first["world_size"] == 2, "the first rendezvous round did not gather both hosts"
    pids = subprocess.run(["ip", "netns", "pids", host_b], capture_output=True, text=True).stdout.split()
    for pid in pids:  # every process of host B: its torchrun agent and its rank
        subprocess.run(["kill", "-9", pid])
    killed = time.monotonic()
    result = a.wait(300)
    assert result.returncode == 0, str(result)
    resumed = re.search(r"resuming from step (\d+) \(epoch 0\); world size 2 -> 1", result.stderr)
    assert resumed, str(result)
    step = int(resumed.group(1))
    assert 10 <= step < STEPS_AT_TWO and step % 5 == 0
    assert time.monotonic() - killed < 200
    # the reference: the same run on one host, 2 ranks up to the checkpoint, then 1 rank from it
    reference = tmp_path / "reference"
    shutil.copytree(out / "checkpoint" / f"step-{step:08d}", reference / "checkpoint" / f"step-{step:08d}")
    jobs = [
        procs([*DDPKIT, "train", *TRAINING, "--epochs", "1", "--out", tmp_path / "two"], "two"),
        procs([*DDPKIT, "train", *TRAINING, "--epochs", "2", "--nproc-per-node", "1", "--resume", "--out", reference],
              "one"),
    ]  # fmt: skip
    for job in jobs:
        done = job.wait(300)
        assert done.returncode == 0, str(done)
    # the 2-rank phase across hosts equals the one on one host, and so does what followed on 1 rank
    checkpoint = f"step-{step:08d}"
    assert_equal_models(
        model_of(out / "checkpoint" / checkpoint), model_of(tmp_path / "two" / "checkpoint" / checkpoint)
    )
    assert_equal_models(model_of(latest_checkpoint(out)), model_of(latest_checkpoint(reference)))
    with open(out / "steps.csv", newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    assert steps == list(range(summary["steps"])), "a step was counted twice or lost"
    assert summary["world_size"] == 1 and summary["steps"] > step
