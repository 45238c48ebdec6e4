"""One replica of a fault-tolerant Lightning (or Fabric) job, for tests/test_lightning_fault_tolerant.py:
``python tests/lightning_fault_tolerant_runs.py OUT RANK MAX_WORLD STORE_PORT trainer|fabric [--die-after-backward
STEP] [--wait-for-joiner STEP]``.

The job's store is hosted by the test. The replica trains `STEPS` optimizer steps of SGD with momentum on its
share of tests/lightning_runs.py's data (every MAX_WORLD-th sample from RANK on). ``--die-after-backward S`` kills
the process (SIGKILL) right after its backward at step S, inside the round, before its gradients travel;
``--wait-for-joiner S`` holds this replica at step S until OUT/joiner-started exists and then steps slowly until a
rank joined, so a restarted replica finds the job still running. Writes OUT/<mode>.rank<R>.json: per optimizer
step the global step and epoch Lightning reported (or the loop's own step) and a digest of the parameters after
it, the final parameters, the manager's events.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning_runs import Net, _data
from torch.utils.data import DataLoader, Subset

from ddpkit.fault_tolerance import Manager
from ddpkit.integrations.lightning_fault_tolerant import (
    DDPKitFabricFaultTolerantStrategy,
    DDPKitFaultTolerantStrategy,
)

STEPS = 24
BATCH = 16  # 512 samples / 2 replicas / 16 = 16 batches per epoch: the run crosses an epoch boundary


class SGDNet(Net):
    def __init__(self) -> None:
        super().__init__({"optimizer": "sgd"})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def digest(module: torch.nn.Module) -> str:
    return tensor_digest(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))


class Watch:
    """What the replica records per optimizer step, and the kill and the wait of the test's schedule."""

    def __init__(self, args: argparse.Namespace, manager: Manager) -> None:
        self.args, self.manager = args, manager
        self.steps: list[dict] = []
        self.batch = ""  # the digest of the step's input batch
        self.deadline = time.monotonic() + 150

    def after_backward(self, step: int) -> None:
        if self.args.die_after_backward == step:
            os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, step: int, epoch: int, module: torch.nn.Module) -> None:
        self.steps.append(
            {
                "step": step,
                "epoch": epoch,
                "digest": digest(module),
                "forming": self.manager.forming,
                "batch": self.batch,
            }
        )
        if self.args.wait_for_joiner is None or step < self.args.wait_for_joiner:
            return
        started = Path(self.args.out, "joiner-started")
        while not started.exists() and time.monotonic() < self.deadline:
            time.sleep(0.05)
        if not any(e.joined for e in self.manager.events) and time.monotonic() < self.deadline:
            time.sleep(0.3)  # one slow step at a time, until the restarted replica is in

    def write(self, mode: str, module: torch.nn.Module) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()
        events = [
            {"step": e.step, "joined": e.joined, "left": e.left, "committed": e.committed} for e in self.manager.events
        ]
        record = {"steps": self.steps, "params": flat, "events": events, "rejoined": self.manager.rejoined}
        Path(self.args.out, f"{mode}.rank{self.args.rank}.json").write_text(json.dumps(record))


class _Callbacks(L.Callback):
    def __init__(self, watch: Watch) -> None:
        self.watch = watch

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: object, *args: object) -> None:
        self.watch.batch = tensor_digest(batch[0])

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.watch.after_backward(trainer.global_step + 1)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        self.watch.after_step(trainer.global_step, trainer.current_epoch, module)


def loader(args: argparse.Namespace) -> DataLoader:
    data = _data()
    return DataLoader(Subset(data, range(args.rank, len(data), args.max_world)), batch_size=BATCH)


def run_trainer(args: argparse.Namespace, manager: Manager, watch: Watch) -> torch.nn.Module:
    model = SGDNet()
    trainer = L.Trainer(
        strategy=DDPKitFaultTolerantStrategy(manager),
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        callbacks=[_Callbacks(watch)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, loader(args))
    return model


def run_fabric(args: argparse.Namespace, manager: Manager, watch: Watch) -> torch.nn.Module:
    fabric = L.Fabric(strategy=DDPKitFabricFaultTolerantStrategy(manager), accelerator="cpu", devices=1)
    net = SGDNet()
    model, optimizer = fabric.setup(net, net.configure_optimizers())
    position = {"step": 0}
    manager.register_state("step", lambda: dict(position), position.update)
    data = fabric.setup_dataloaders(loader(args))
    fabric.strategy.open_round()  # a joiner receives the live state (and the step) here, before reading data
    while position["step"] < STEPS:
        skip = position["step"] % len(data)  # (a joiner starts at the members' batch)
        for index, (x, y) in enumerate(data):
            if index < skip:
                continue
            watch.batch = tensor_digest(x)
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            watch.after_backward(position["step"] + 1)
            optimizer.step()
            optimizer.zero_grad()
            position["step"] += 1
            watch.after_step(position["step"], -1, net)
            if position["step"] >= STEPS:
                break
    return net


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("out", "rank", "max_world", "port", "mode"):
        parser.add_argument(name, type=int if name in ("rank", "max_world", "port") else str)
    parser.add_argument("--die-after-backward", type=int)
    parser.add_argument("--wait-for-joiner", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=120))
    manager = Manager(
        store,
        args.rank,
        args.max_world,
        min_replicas=1,
        quorum_timeout=4.0,
        start_timeout=120.0,
        settings={"lr": 0.1, "mode": args.mode},
        report=print,
    )
    if manager.under_way():
        Path(args.out, "joiner-started").touch()
    watch = Watch(args, manager)
    module = (run_trainer if args.mode == "trainer" else run_fabric)(args, manager, watch)
    watch.write(args.mode, module)
    manager.close()


if __name__ == "__main__":
    main()
