"""`srun ddpkit train ...` without rank flags: each task reads its rank, the task count and the first node from the
variables srun sets (as Lightning does), so a Slurm job step of N tasks is one job of N ranks.

No Slurm here: the variables are set by hand, for processes on loopback. The reference is Slurm's documented
meaning of each variable, written in the test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from ddpkit.distributed import launch

ROOT = Path(__file__).resolve().parents[1]
SRUN_TASK = {  # what srun sets for task 1 of a 4-task step over 2 nodes (batch scripts lack the SLURM_STEP_* ones)
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NAME": "train",
}
CLEARED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_first_host_of_a_node_list():
    assert launch.first_host("gpu[07-08]") == "gpu07"
    assert launch.first_host("node[3,5-9],big1") == "node3"
    assert launch.first_host("a-[10-11]") == "a-10"
    assert launch.first_host("n1,n2") == "n1"


def test_an_srun_task_is_a_rank_and_other_slurm_environments_are_not(monkeypatch):
    for name in CLEARED:  # absent now, and again when the test ends: what from_slurm exports must not leak into
        monkeypatch.setenv(name, "")  # later tests' commands (Lightning's ranks then waited for a master at gpu07;
        monkeypatch.delenv(name)  # a bare delenv of an absent variable would not undo from_slurm's export)
    for name, value in SRUN_TASK.items():
        monkeypatch.setenv(name, value)
    placement = launch.from_slurm()
    assert (placement.rank, placement.world_size, placement.local_rank) == (1, 4, 1)
    assert (placement.master_addr, placement.master_port) == ("gpu07", 15000 + 3456)  # the job id's last 4 digits
    assert (os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]) == ("2", "0")
    assert launch.from_slurm(29600).master_port == 29600  # --master-port wins
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")  # an interactive allocation's shell: ddpkit starts its own ranks
    assert launch.from_slurm() is None
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")  # an sbatch script itself, not one of srun's tasks
    assert launch.from_slurm() is None


def _free_port_in(low: int, high: int) -> int:
    for port in range(low, high):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def test_two_srun_tasks_train_as_one_job(tmp_path):
    port = _free_port_in(15000 + 2000, 15000 + 9999)
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in CLEARED and not k.startswith("SLURM_")}
        env.update(SRUN_TASK, PYTHONPATH=str(ROOT), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))
        env.update(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="127.0.0.1")
        env.update(SLURM_JOB_ID=str(90000 + port - 15000))  # the port every task derives: 15000 + last 4 digits
        out = tmp_path / f"out{rank}"
        args = [sys.executable, "-m", "ddpkit", "train", "--max-steps", "3", "--no-progress", "--out", str(out)]
        procs.append(
            subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    summary = json.loads((tmp_path / "out0" / "metrics.json").read_text())["summary"]
    assert summary["world_size"] == 2 and summary["replicas_equal"] is True, outputs[0]
    assert not (tmp_path / "out1" / "metrics.json").exists()  # rank 1 of the same job writes no metrics
