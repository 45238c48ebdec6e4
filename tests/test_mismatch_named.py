"""A loop of the user's own whose ranks call different collectives: the failure names each rank's last
collective and the state that differs, as `ddpkit train` does, instead of gloo's bare "Timed out".

Two plain processes (no ddpkit launcher, no test runner catching the exception) run a ShardedDataParallel loop in
which one rank takes an extra ``optimizer.step()`` or clears a layer's ``requires_grad``; the process group's
timeout is short, so both fail, and the uncaught failure must print, before its traceback, what the ledger knows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import warm_processes

from ddpkit.distributed.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
LOOP = """
import datetime, sys, torch, torch.distributed as dist
from torch import nn
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=8))
rank, case = dist.get_rank(), sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
sdp = ShardedDataParallel(model, optimizer)
for step in range(4):
    if case == "frozen" and rank == 1 and step == 2:
        model[0].weight.requires_grad_(False)  # on one rank only
    optimizer.zero_grad()
    sdp(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    if case == "extra_step" and rank == 0 and step == 1:
        optimizer.step()  # once more on rank 0 only
"""


@pytest.mark.parametrize("case", ["extra_step", "frozen"])
def test_an_uncaught_mismatch_names_each_ranks_collective(tmp_path, case):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER", "LOCAL"))}
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
            PYTHONUNBUFFERED="1",
        )
        out, err = tmp_path / f"rank{rank}.out", tmp_path / f"rank{rank}.err"
        procs.append(warm_processes.popen([sys.executable, script, case], out, err, env, tmp_path))
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (proc, err) in enumerate(zip(procs, errors, strict=True)):
        assert proc.returncode != 0, err
        assert f"ddpkit: rank {rank} saw rank 0: collective #" in err, err
        assert f"ddpkit: rank {rank} saw rank 1: collective #" in err, err
    if case == "frozen":
        assert any("ShardedDataParallel trainable parameters differ" in err for err in errors), errors
