"""ddpkit's fault-tolerant Lightning and Fabric strategies (ddpkit.integrations.lightning_fault_tolerant): two
replicas, one killed inside a round (after its backward, before its gradients travel) and started again; the
survivor's fit completes, the restarted replica rejoins with the members' loop counters, and both end with the
same parameters. Each replica is a process of tests/lightning_fault_tolerant_runs.py; the test hosts the store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("lightning")
import torch
import torch.distributed as dist
import warm_processes

from ddpkit.distributed.launch import free_port
from ddpkit.fault_tolerance import Manager

HERE = Path(__file__).parent
DIE_AT, WAIT_AT, STEPS = 6, 9, 24


def _start(out: Path, rank: int, port: int, mode: str, *flags: object) -> warm_processes.Command:
    path = os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(HERE / "lightning_fault_tolerant_runs.py"), out, rank, 2, port, mode, *flags]
    log = out / f"{mode}-{rank}-{uuid.uuid4().hex[:8]}.log"
    env = {**os.environ, "PYTHONPATH": path}
    return warm_processes.popen(cmd, log, log, env, HERE.parent, preload=("lightning",))


def _finish(process: warm_processes.Command, timeout: float = 240) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate(30)
        output += f"\n(killed after {timeout} s)"
    return process.returncode, output


def _batches(rank: int) -> list[str]:
    """The digest of each batch of an epoch of replica `rank`'s share of the data, read here from the definition
    (every 2nd sample from `rank` on, batches of BATCH in order)."""
    from lightning_fault_tolerant_runs import BATCH, tensor_digest
    from lightning_runs import _data

    data = _data()
    share = [data[i][0] for i in range(rank, len(data), 2)]
    return [tensor_digest(torch.stack(share[i : i + BATCH])) for i in range(0, len(share), BATCH)]


@pytest.mark.parametrize("mode", ["trainer", "fabric"])
def test_a_replica_killed_in_a_round_rejoins_and_ends_equal(tmp_path, mode):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=240))
    survivor = _start(tmp_path, 0, port, mode, "--wait-for-joiner", WAIT_AT)
    victim = _start(tmp_path, 1, port, mode, "--die-after-backward", DIE_AT)
    code, victim_log = _finish(victim)
    assert code == -signal.SIGKILL, victim_log
    code, restarted_log = _finish(_start(tmp_path, 1, port, mode))
    survivor_code, survivor_log = _finish(survivor)
    assert code == 0 and survivor_code == 0, restarted_log[-4000:] + survivor_log[-4000:]
    del store
    first = json.loads((tmp_path / f"{mode}.rank0.json").read_text())
    back = json.loads((tmp_path / f"{mode}.rank1.json").read_text())

    # the round the victim died in failed on the survivor and left its parameters as they were before it
    failed = [e for e in first["events"] if e["committed"] is False]
    assert failed, first["events"]
    digests = {s["step"]: s["digest"] for s in first["steps"]}
    trained = [s["step"] for s in first["steps"]]
    # (Lightning's global_step, like the Fabric loop's own step, counts the dropped step too)
    assert digests[DIE_AT] == digests[DIE_AT - 1], first["steps"][: DIE_AT + 1]
    assert trained[-1] == STEPS, trained

    # the restarted replica took the survivor's state and loop counters, then trained the same steps to the end
    assert back["rejoined"] >= 1 and any(1 in e["joined"] for e in first["events"]), first["events"]
    tail = [(s["step"], s["epoch"], s["digest"]) for s in back["steps"]]
    assert tail and tail[0][0] > DIE_AT, tail  # (it resumes past the round it died in, not from step 0)
    assert tail == [(s["step"], s["epoch"], s["digest"]) for s in first["steps"]][-len(tail) :]
    assert torch.equal(torch.tensor(first["params"]), torch.tensor(back["params"]))
    # after every step, the next step's quorum was being formed in the background (taken after its backward)
    assert all(s["forming"] for s in first["steps"] + back["steps"]), first["steps"]
    # every step of each replica read the batch an uninterrupted replica of its rank reads at that step: the
    # restarted one resumed at the members' data position (the same epoch and batch of its share)
    for rank, record in ((0, first), (1, back)):
        batches = _batches(rank)
        assert [s["batch"] for s in record["steps"]] == [
            batches[(s["step"] - 1) % len(batches)] for s in record["steps"]
        ], (rank, record["steps"])


def test_the_strategies_refuse_what_they_cannot_do(tmp_path):
    import lightning as L
    from lightning_fault_tolerant_runs import SGDNet
    from torch.utils.data import DataLoader, TensorDataset

    from ddpkit.integrations.lightning_fault_tolerant import (
        DDPKitFabricFaultTolerantStrategy,
        DDPKitFaultTolerantStrategy,
    )

    for strategy in (DDPKitFaultTolerantStrategy, DDPKitFabricFaultTolerantStrategy):
        with pytest.raises(TypeError, match=r"manager must be a ddpkit\.fault_tolerance\.Manager"):
            strategy(object())  # type: ignore[arg-type]
    data = DataLoader(TensorDataset(torch.randn(8, 16), torch.zeros(8, dtype=torch.long)), batch_size=4)
    for options, message in (
        ({"accumulate_grad_batches": 2}, "accumulate_grad_batches must be 1, got 2"),
        ({}, "manual optimization is not supported"),
    ):
        model = SGDNet()
        model.automatic_optimization = "accumulate_grad_batches" in options
        manager = Manager(dist.HashStore(), 0, 1, report=None)
        trainer = L.Trainer(
            strategy=DDPKitFaultTolerantStrategy(manager),
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            default_root_dir=tmp_path,
            **options,
        )
        with pytest.raises(ValueError, match=message):
            trainer.fit(model, data)
        manager.close()
