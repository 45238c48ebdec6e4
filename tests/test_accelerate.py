"""ddpkit's accelerate recipe against accelerate's own DDP path.

One job started by ``accelerate launch`` (its multi-process launcher works on the CPU) runs the same accelerate loop
(Adam, StepLR, accumulation over 2 micro-batches, clipping by norm, `save_state` midway) through
``accelerator.prepare`` (torch DDP) and through `prepare_sharded` (OSS + ShardedDataParallel,
tests/accelerate_runs.py). The reference is accelerate's DDP run: losses and parameters must agree to 1e-6 on every
rank, the optimizer state must be split over the ranks, and a fresh model and optimizer that `load_state` the
checkpoint must end exactly where the uninterrupted run ended. With accelerate's own ``clip_grad_norm_`` (the norm
of one shard) the parameters end 0.002 away from DDP's. Then the loop under the loss scaler accelerate makes for
fp16 on a GPU (set by hand: on the CPU accelerate makes none), with one gradient that overflows on rank 0 only: the
sharded run must skip the same steps as accelerate's DDP (with torch's GradScaler left in place, rank 1 steps alone
and the job hangs) and end on its parameters.
"""

from __future__ import annotations

import json
import sys

import pytest
from test_lightning import HERE, _close, _run

from ddpkit.distributed.launch import free_port

pytest.importorskip("accelerate", reason="the accelerate recipe needs accelerate: pip install accelerate")

pytestmark = pytest.mark.slow


def _accelerate_launch(world: int, script: str, *args: object) -> None:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", world]
    launch += ["--num_machines", 1, "--mixed_precision", "no", "--dynamo_backend", "no"]
    _run([*launch, "--main_process_port", free_port(), HERE / script, *args])


def test_prepare_sharded_refuses_when_accelerate_counts_other_processes(monkeypatch):
    """`accelerate launch --multi_gpu` on a CPU machine without cpu=True: accelerate sees one process while
    torch.distributed has two, so the data would not be split; refused, saying what to do. (The
    process group's size is what torch.distributed would report on each of two ranks.)"""
    from types import SimpleNamespace

    import torch
    from torch import nn

    import ddpkit.integrations.accelerate as integration

    monkeypatch.setattr(integration.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(integration, "group_size", lambda group=None: 2)
    model = nn.Linear(4, 2)
    seen_as_one = SimpleNamespace(num_processes=1, distributed_type="DistributedType.NO")
    with pytest.raises(ValueError) as refused:
        integration.prepare_sharded(seen_as_one, model, torch.optim.SGD(model.parameters(), lr=0.1))
    message = str(refused.value)
    assert "accelerate counts 1 process(es)" in message and "torch.distributed has 2 ranks" in message
    assert "Accelerator(cpu=True)" in message and "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu" in message
    # the command it suggests is one accelerate accepts (it said --multi_cpu, which accelerate rejects)
    from accelerate.commands.launch import launch_command_parser

    suggested = message.split("`ACCELERATE_USE_CPU=1 accelerate launch ")[1].split("`")[0].replace("N", "2").split()
    launch_command_parser().parse_args([*suggested, "train.py"])


def test_prepare_sharded_refuses_a_model_and_optimizer_prepared_by_accelerate():
    """`accelerator.prepare(model, optimizer)` first, then `prepare_sharded`: refused by name, saying what to do (it
    failed inside OSS with "unexpected keyword argument 'lr'")."""
    import torch
    from accelerate import Accelerator
    from torch import nn

    import ddpkit.integrations.accelerate as integration

    accelerator = Accelerator(cpu=True)
    model = nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"the model and the optimizer went through accelerator\.prepare already"):
        integration.prepare_sharded(accelerator, model, optimizer)


def test_the_sharded_recipe_trains_checkpoints_and_resumes_as_accelerates_ddp(tmp_path):
    _accelerate_launch(2, "accelerate_runs.py", tmp_path)
    for rank in range(2):
        modes = ("ddp", "sharded")
        ddp, sharded = (json.loads((tmp_path / f"{mode}.rank{rank}.json").read_text()) for mode in modes)
        assert (ddp["model"], sharded["model"]) == ("DistributedDataParallel", "ShardedDataParallel")
        assert _close(sharded["losses"], ddp["losses"]) < 1e-6 and _close(sharded["params"], ddp["params"]) < 1e-6
        for run in (ddp, sharded):  # load_state, then the same steps: the uninterrupted run's end (to an fp32 ulp:
            # bit for bit up to accelerate 1.14; with 1.15 accelerate's own DDP resume differs in the last bit too)
            assert _close(run["resumed"], run["params"]) < 1e-7, rank
            tail = run["losses"][-len(run["resumed_losses"]) :]
            assert _close(run["resumed_losses"], tail) < 1e-7, rank
        assert 0 < sharded["state_bytes"] < ddp["state_bytes"], (sharded["state_bytes"], ddp["state_bytes"])
        for run in (ddp, sharded):  # load_state into the model that trained on: back to the saved point, same run
            assert run["reloaded"] == run["saved"], rank
            assert _close(run["reloaded_losses"], run["losses"][-len(run["reloaded_losses"]) :]) < 1e-7, rank
        assert sharded["whole_state_here"] == (rank == 0)  # only the rank that writes gathered the whole state
        documented = json.loads((tmp_path / f"documented.rank{rank}.json").read_text())  # docs/integrations.md
        assert documented["checkpoint"] and documented["params"] != documented["start"]
        assert documented["params"] == json.loads((tmp_path / "documented.rank0.json").read_text())["params"]
        ddp, sharded = (json.loads((tmp_path / f"{mode}-scaled.rank{rank}.json").read_text()) for mode in modes)
        assert (ddp["scaler"], sharded["scaler"]) == ("GradScaler", "ShardedGradScaler")
        assert ddp["scale"] == sharded["scale"] == 2.0**24, (ddp["scale"], sharded["scale"])  # 3 skips from 2**36
        assert _close(sharded["losses"], ddp["losses"]) < 1e-6 and _close(sharded["params"], ddp["params"]) < 1e-6
