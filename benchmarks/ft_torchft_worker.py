"""One replica of the torchft side of `python -m benchmarks fault_tolerance` (run by it, not by hand).

The same model, data split and optimizer as `ddpkit train --strategy ddp` (built by ddpkit's own workload code, so
both sides train the same thing), under torchft 0.2.0: its `Manager` (a quorum per step through the lighthouse
the benchmark hosts, healing from a live replica), its `DistributedDataParallel` and `OptimizerWrapper` (the
commit before each step). Each replica is a replica group of one process.

Usage: ``python -m benchmarks.ft_torchft_worker REPLICA REPLICAS STEPS LIGHTHOUSE OUT.json QUORUM_TIMEOUT GO``
(each replica waits for the file GO before its first step, so that both start together).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ddpkit.distributed.launch import free_port
from ddpkit.train.loop.strategies import optimizer_arguments
from ddpkit.train.settings.config import TrainConfig
from ddpkit.train.workloads.sampler import ResumableSampler
from ddpkit.train.workloads.workload import build_workload


def main(replica: int, replicas: int, steps: int, lighthouse: str, out: str, quorum_timeout: float, go: str) -> None:
    from torchft import Manager
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    cfg = TrainConfig(strategy="ddp", optimizer="sgd", lr=0.05, batch_size=16)  # the bench's ddp flags
    torch.manual_seed(cfg.seed)
    work = build_workload(cfg, torch.device("cpu"))
    inner = torch.optim.SGD(work.module.parameters(), **optimizer_arguments(cfg))
    state: dict[str, Any] = {}

    def load(saved: dict[str, Any]) -> None:
        work.module.load_state_dict(saved["model"])
        inner.load_state_dict(saved["optim"])

    def save() -> dict[str, Any]:
        return {"model": work.module.state_dict(), "optim": inner.state_dict()}

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the group's own
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=quorum_timeout)),
        load_state_dict=load,
        state_dict=save,
        min_replica_size=1,
        replica_id=f"replica{replica}",
        lighthouse_addr=lighthouse,
        store_addr="127.0.0.1",
        store_port=port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=quorum_timeout),
        quorum_timeout=timedelta(seconds=60),
    )
    model = DistributedDataParallel(manager, work.module)
    optimizer = OptimizerWrapper(manager, inner)
    sampler = ResumableSampler(work.train, replicas, replica, seed=cfg.seed)
    loader = DataLoader(work.train, batch_size=cfg.batch_size, sampler=sampler)
    Path(out + ".ready").touch()  # both replicas start together: the benchmark creates GO once both are ready
    while not Path(go).exists():
        time.sleep(0.05)
    started, epoch, participants = time.perf_counter(), 0, []
    while manager.current_step() < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = work.loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            participants.append(manager.num_participants())
            if manager.current_step() % 10 == 0:  # where it is, for the benchmark's failure schedule
                with open(out + ".step", "w") as f:
                    f.write(str(manager.current_step()))
            if manager.current_step() >= steps:
                break
        epoch += 1
    training = time.perf_counter() - started
    work.module.eval()
    with torch.no_grad():
        losses = [(float(work.loss_fn(work.module(x), y)) * len(y), len(y)) for x, y in DataLoader(work.heldout, 512)]
    state.update(
        steps=manager.current_step(),
        training_seconds=training,
        test_loss=sum(s for s, _ in losses) / sum(n for _, n in losses),
        participants=participants,
    )
    with open(out, "w") as f:
        json.dump(state, f)
    manager.shutdown(wait=False)
    del store


if __name__ == "__main__":
    replica, replicas, steps, lighthouse, out, quorum_timeout, go = sys.argv[1:8]
    main(int(replica), int(replicas), int(steps), lighthouse, out, float(quorum_timeout), go)
