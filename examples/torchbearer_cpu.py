"""torchbearer on several CPU machines, data-parallel: the classic tutorial, done right.

Run one process per machine (here two terminals on one machine work too):

    python examples/torchbearer_cpu.py --world-size 2 --rank 0 --host 10.0.0.1
    python examples/torchbearer_cpu.py --world-size 2 --rank 1 --host 10.0.0.1

`--host` is rank 0's address. Compared with the tutorial: the arguments are typed and checked, the data ships with
scikit-learn (nothing is downloaded), the gradients are averaged once (the tutorial wraps the model in DDP *and*
all-reduces the gradients itself), the sampler's epoch is set every epoch, only rank 0 prints, and the end
prints a checksum of every rank's parameters, which must all be equal.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchbearer import Trial

from ddpkit.distributed.launch import leave
from ddpkit.integrations.torchbearer import distributed_callbacks, rank_zero_verbosity
from ddpkit.train.loop.report import gather_digests
from ddpkit.train.workloads.data import digits
from ddpkit.train.workloads.models import mlp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, required=True, help="number of processes (machines)")
    parser.add_argument("--rank", type=int, required=True, help="this process's rank, 0 .. world-size - 1")
    parser.add_argument("--host", required=True, help="address of the rank-0 machine")
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a missing peer is an error")
    args = parser.parse_args()
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}), got {args.rank}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.host}:{args.port}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        train_and_report(args)
    finally:
        leave()  # once the model, trial and loaders are gone: nothing may outlive the process group


def train_and_report(args: argparse.Namespace) -> None:
    data = digits()
    sampler = DistributedSampler(data.train, shuffle=True, seed=0)
    train_loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(data.test, batch_size=256)
    torch.manual_seed(args.rank)  # deliberately different on each rank: the sync callback must fix it
    model = mlp(data.num_features, data.num_classes, hidden=128)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trial = Trial(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        metrics=["loss", "acc"],
        callbacks=distributed_callbacks(model),
        verbose=rank_zero_verbosity(),
    )
    trial.with_generators(train_generator=train_loader, test_generator=test_loader)
    trial.run(epochs=args.epochs)
    accuracy = trial.evaluate(data_key=torchbearer_test_key(), verbose=0)
    digests = gather_digests(model)
    if args.rank == 0:
        print(f"test accuracy: {float(next(v for k, v in accuracy.items() if 'acc' in k)):.3f}")
        print(f"parameter checksums per rank: {json.dumps(digests)}")
        print(f"replicas equal: {len(set(digests)) == 1}")


def torchbearer_test_key() -> object:
    import torchbearer

    return torchbearer.TEST_DATA


if __name__ == "__main__":
    main()
