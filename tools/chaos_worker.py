"""One rank of the chaos run (`tools/chaos.py`): the fault-tolerant Manager loop on a real model, its history kept.

    python tools/chaos_worker.py --rank R --world N --store etcd://... | tcp://HOST:PORT --history FILE --steps S

The digits MLP (scikit-learn's 8x8 digits, 64-64-10, SGD with momentum) trained as DDP through `Manager`: each
round every member computes the gradient of its own batch (the batch a rank reads at a step is fixed by the step
and the rank), the round averages them, and a committed round steps the optimizer. Every round this process takes
part in is appended to `FILE` as one JSON line: its number, members, verdict, the step it was and a digest of the
parameters after it, so the checker can compare what every rank saw. At the end: the final digest and the
held-out loss. A process that must stop (its store lost, too few replicas) writes why and exits 3; the job over
before it could join: exit 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpkit.fault_tolerance import Manager
from ddpkit.fault_tolerance.etcd_store import EtcdStore
from ddpkit.fault_tolerance.manager import StoreLost
from ddpkit.fault_tolerance.membership import JobFinished, PeersUnreachable, TooFewReplicas

BATCH, LR, MOMENTUM = 32, 0.05, 0.9


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits, scaled to [0, 1]: 1,500 for training, the rest held out (the same split on every rank)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    return x[:1500], y[:1500], x[1500:], y[1500:]


def batch(x: torch.Tensor, y: torch.Tensor, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.randint(0, len(x), (BATCH,), generator=torch.Generator().manual_seed(step * 1009 + rank))
    return x[index], y[index]


def digest(model: nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def open_store(url: str) -> Any:
    if url.startswith("etcd://"):
        return EtcdStore(url, timeout=30)
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    return torch.distributed.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))


def train(args: argparse.Namespace, log: Any) -> None:
    x, y, held_x, held_y = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    progress = {"step": 0}
    manager = Manager(
        open_store(args.store),
        args.rank,
        args.world,
        quorum_timeout=args.quorum_timeout,
        start_timeout=60,
        join_timeout=600,
        settings={"lr": LR},
        report=None,
    )
    manager.register("model", model)
    manager.register("optimizer", optimizer)
    manager.register_state("progress", progress.copy, progress.update)
    while progress["step"] < args.steps:
        manager.start_round()
        bx, by = batch(x, y, progress["step"], args.rank)
        nn.functional.cross_entropy(model(bx), by).backward()
        manager.average_gradients(model.parameters())
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad()
        quorum = manager.quorum
        assert quorum is not None
        log(
            {
                "round": quorum.round,
                "members": quorum.members,
                "committed": quorum.committed,  # (None: unknown)
                "step": progress["step"],
                "digest": digest(model) if committed else None,
                "t": time.time(),
            }
        )
        if committed:
            progress["step"] += 1
        if args.step_seconds:
            time.sleep(args.step_seconds)
    manager.finish()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(held_x), held_y).item()
    log({"final": digest(model), "heldout_loss": loss, "t": time.time()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True, help="etcd://HOST:PORT,.../JOB or tcp://HOST:PORT")
    parser.add_argument("--history", required=True, help="the JSON-lines file this process appends to")
    parser.add_argument("--steps", type=int, default=300, help="committed steps to train")
    parser.add_argument("--quorum-timeout", type=float, default=3.0)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="a pause per step (a bigger model)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with open(args.history, "a") as history:

        def log(entry: dict[str, Any]) -> None:
            history.write(json.dumps(entry) + "\n")
            history.flush()

        log({"start": os.getpid(), "t": time.time()})
        try:
            train(args, log)
        except JobFinished:
            log({"end": "JobFinished", "t": time.time()})
            return 0
        except (StoreLost, TooFewReplicas, PeersUnreachable) as exc:
            log({"end": type(exc).__name__, "why": str(exc)[:300], "t": time.time()})
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
