"""One replica of the torchft side of `python -m benchmarks fault_tolerance` (run by it, not by hand).

The same workload, data split and optimizer as the `ddpkit train` run it stands beside (built by ddpkit's own code
from the same `TrainConfig` fields, so both sides train the same thing), under torchft 0.2.0: its `Manager` (a
quorum per round through the lighthouse the benchmark hosts, healing from a live replica) and one of

* ``ddp``: its `DistributedDataParallel` and `OptimizerWrapper` (a quorum, an average and a commit every step),
  beside ``ddpkit train --strategy ddp``;
* ``localsgd``: its `LocalSGD` (the parameters averaged every H = ``--localsgd-frequency`` local steps of the plain
  torch optimizer), beside ``--strategy slowmo`` with slow momentum 0 and slow learning rate 1 (which is local SGD);
* ``diloco``: its `DiLoCo` (every H steps the averaged pseudo-gradient goes through an outer
  ``SGD(lr=--slowmo-lr, momentum=--slowmo-momentum, nesterov=--slowmo-nesterov)``), beside ``--strategy slowmo``
  with the same three settings: ddpkit's slow step ``d = (x0 - x)/lr; u = beta u + d; x0 -= alpha lr (d + beta u)``
  is torch's Nesterov SGD on the pseudo-gradient ``x0 - x``.

Each replica is a replica group of one process, built from the same seed as the other (as ddpkit's ranks), so
without torchft's initial sync (which would heal replica 1 from replica 0 at the first round and drop that round's
work): without failures both sides train exactly the same. STEPS counts local steps, as ``--max-steps``; the loop
ends once STEPS / H rounds are committed (a round that failed is not counted). Its clock is the loop's wall time
from its first step to its last, everything after each step included (the averaging, the commit).

Usage: ``python -m benchmarks.ft_torchft_worker MODE REPLICA REPLICAS STEPS LIGHTHOUSE OUT.json QUORUM_TIMEOUT GO
CONFIG.json`` (CONFIG: TrainConfig fields; each replica waits for the file GO before its first step, so that
both start together; it writes OUT.json.ready when it is ready and the committed round to OUT.json.step).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ddpkit.distributed.launch import free_port
from ddpkit.train.loop.loaders import rank_data
from ddpkit.train.loop.strategies import OPTIMIZER_CLASSES, optimizer_arguments
from ddpkit.train.settings.config import TrainConfig
from ddpkit.train.workloads.workload import Workload, build_workload

MODES = ("ddp", "localsgd", "diloco")


def sync_every(mode: str, cfg: TrainConfig) -> int:
    """Local steps per round: 1 for ddp, H for the local modes (whose ddpkit run averages and slow-steps alike)."""
    if mode == "ddp":
        return 1
    if cfg.localsgd_frequency != cfg.slowmo_frequency:
        raise ValueError("the ddpkit run beside it must average and slow-step at once (--localsgd/--slowmo-frequency)")
    if mode == "localsgd" and (cfg.slowmo_momentum, cfg.slowmo_lr, cfg.slowmo_nesterov) != (0.0, 1.0, False):
        raise ValueError("localsgd stands beside --slowmo-momentum 0 --slowmo-lr 1 (plain averaging)")
    return cfg.localsgd_frequency


def make_manager(replica: int, lighthouse: str, quorum_timeout: float, sync: bool, state: tuple) -> tuple:
    """torchft's Manager for a replica group of one process, and the group's store (kept alive beside it);
    `state`: (load_state_dict, state_dict)."""
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the group's own
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=quorum_timeout)),
        load_state_dict=state[0],
        state_dict=state[1],
        min_replica_size=1,
        use_async_quorum=not sync,  # DiLoCo needs the quorum before the step
        init_sync=False,  # both replicas build the same model from the seed, as ddpkit's ranks (with True, the
        # first round would heal replica 1 from replica 0 and drop its first round's work: a different training)
        replica_id=f"replica{replica}",
        lighthouse_addr=lighthouse,
        store_addr="127.0.0.1",
        store_port=port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=quorum_timeout),
        quorum_timeout=timedelta(seconds=60),
    )
    return manager, store


def wrap(mode: str, manager: Any, work: Workload, inner: torch.optim.Optimizer, cfg: TrainConfig) -> tuple:
    """(model to call, optimizer to step, context around the loop) for `mode`."""
    if mode == "ddp":
        from torchft.ddp import DistributedDataParallel
        from torchft.optim import OptimizerWrapper

        return DistributedDataParallel(manager, work.module), OptimizerWrapper(manager, inner), contextlib.nullcontext()
    from torchft.local_sgd import DiLoCo, LocalSGD

    every = sync_every(mode, cfg)
    if mode == "localsgd":
        return work.module, inner, LocalSGD(manager, work.module, inner, sync_every=every)
    outer = torch.optim.SGD(
        work.module.parameters(), lr=cfg.slowmo_lr, momentum=cfg.slowmo_momentum, nesterov=cfg.slowmo_nesterov
    )
    return work.module, inner, DiLoCo(manager, [work.module], inner, outer, sync_every=every)


def train(manager: Any, model: Any, optimizer: Any, loss_fn: Any, data: Any, rounds: int, every: int, out: str) -> dict:
    """Steps until `rounds` rounds are committed; the loop's wall time (and its time at each step's end), local
    steps and participants per round."""
    steps, epoch, participants, ends = 0, 0, [], []
    started = time.perf_counter()
    while manager.current_step() < rounds:
        data.loader.sampler.set_epoch(epoch)
        for x, y in data.loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()  # ddp: the commit; localsgd, diloco: every `every` steps, the round
            steps += 1
            ends.append(round(time.perf_counter() - started, 6))  # (the bench's windowed figure: one clock)
            if steps % every == 0:
                participants.append(manager.num_participants())
                if every > 1 or manager.current_step() % 10 == 0:  # where it is, for the failure schedule
                    Path(out + ".step").write_text(str(manager.current_step()))
            if manager.current_step() >= rounds:
                break
        epoch += 1
    return {
        "training_seconds": time.perf_counter() - started,
        "steps": steps,
        "rounds": manager.current_step(),
        "participants": participants,
        "step_ends": ends,
    }


def heldout_loss(work: Workload, loader: Any) -> float:
    work.module.eval()
    with torch.no_grad():
        losses = [(float(work.loss_fn(work.module(x), y)) * len(y), len(y)) for x, y in loader]
    return sum(s for s, _ in losses) / sum(n for _, n in losses)


def main(
    mode: str,
    replica: int,
    replicas: int,
    steps: int,
    lighthouse: str,
    out: str,
    quorum_timeout: float,
    go: str,
    fields: dict[str, Any],
) -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(**fields)
    every = sync_every(mode, cfg)
    torch.manual_seed(cfg.seed)
    work = build_workload(cfg, torch.device("cpu"))
    data = rank_data(cfg, work, replica, replicas)
    inner = OPTIMIZER_CLASSES[cfg.optimizer](work.module.parameters(), **optimizer_arguments(cfg))

    def load(saved: dict[str, Any]) -> None:
        work.module.load_state_dict(saved["model"])
        inner.load_state_dict(saved["optim"])

    def save() -> dict[str, Any]:
        return {"model": work.module.state_dict(), "optim": inner.state_dict()}

    manager, _store = make_manager(replica, lighthouse, quorum_timeout, mode == "diloco", (load, save))
    model, optimizer, context = wrap(mode, manager, work, inner, cfg)
    Path(out + ".ready").touch()  # both replicas start together: the benchmark creates GO once both are ready
    while not Path(go).exists():
        time.sleep(0.05)
    with context:
        figures = train(manager, model, optimizer, work.loss_fn, data, steps // every, every, out)
    figures["test_loss"] = heldout_loss(work, data.heldout)
    Path(out).write_text(json.dumps({"mode": mode, "sync_every": every, **figures}))
    manager.shutdown(wait=False)


if __name__ == "__main__":
    mode, replica, replicas, steps, lighthouse, out, quorum_timeout, go, config = sys.argv[1:10]
    if mode not in MODES:
        sys.exit(f"MODE must be one of {', '.join(MODES)}; got {mode!r}")
    fields = json.loads(Path(config).read_text())
    main(mode, int(replica), int(replicas), int(steps), lighthouse, out, float(quorum_timeout), go, fields)
