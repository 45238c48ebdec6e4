"""Train an MLP on scikit-learn's bundled handwritten digits, data-parallel over local CPU processes.

    python examples/train_digits.py                      # 2 processes, OSS + ShardedDataParallel, Adam
    python examples/train_digits.py --strategy ddp       # plain torch DDP for comparison
    python examples/train_digits.py --nproc 4 --epochs 10

Nothing is downloaded: the digits ship with scikit-learn. Each process sees its own part of every epoch
(DistributedSampler); rank 0 shows a progress bar and, at the end, the test accuracy, the bytes each strategy
sent per step (from ddpkit's CommStats), the optimizer state held per rank, and a checksum that shows every
replica holds the same parameters.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from ddpkit.distributed import comm_stats, counting_allreduce_hook
from ddpkit.distributed.launch import free_port, leave
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS
from ddpkit.train.loop.bench import optimizer_state_bytes
from ddpkit.train.loop.report import gather_digests
from ddpkit.train.workloads.data import digits

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def build(strategy: str, optimizer: str, lr: float) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    cls = OPTIMIZERS[optimizer]
    if strategy == "ddp":
        wrapped = DDP(model)
        wrapped.register_comm_hook(None, counting_allreduce_hook)
        return model, wrapped, cls(model.parameters(), lr=lr)
    opt = OSS(model.parameters(), optim=cls, lr=lr)
    if strategy == "oss":
        wrapped = DDP(model)
        wrapped.register_comm_hook(None, counting_allreduce_hook)
        return model, wrapped, opt
    return model, ShardedDataParallel(model, opt), opt


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc, timeout=timedelta(seconds=60)
    )
    try:
        train_and_report(rank, args)
    finally:
        leave()  # once the model, optimizer and wrapper are gone: nothing may outlive the process group


def train_and_report(rank: int, args: argparse.Namespace) -> None:
    data = digits()
    train, test = data.train, data.test
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    model, wrapped, optimizer = build(args.strategy, args.optimizer, args.lr)
    steps = args.epochs * len(loader)
    bar = tqdm(total=steps, desc=f"{args.strategy} x{args.nproc}", disable=rank != 0)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            with comm_stats.measure() as sent:
                loss = nn.functional.cross_entropy(wrapped(x), y)
                loss.backward()
                optimizer.step()
            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", kB_sent=f"{sent.sent_bytes() / 1e3:.1f}")
            bar.update()
    bar.close()
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    digests = gather_digests(model)
    per_rank_state = [torch.zeros(1, dtype=torch.int64) for _ in range(args.nproc)]
    dist.all_gather(per_rank_state, torch.tensor([optimizer_state_bytes(optimizer)]))
    if rank == 0:
        print(f"test accuracy        {accuracy:.3f}")
        print(f"wall time            {elapsed:.1f} s ({steps * args.batch_size * args.nproc / elapsed:.0f} samples/s)")
        print(f"sent per step        {sent.sent_bytes() / 1e3:.1f} kB (this rank, modelled wire bytes)")
        print(f"optimizer state      {', '.join(f'{int(s.item()) / 1e3:.0f} kB' for s in per_rank_state)} per rank")
        print(f"replicas equal       {len(set(digests)) == 1} (parameter digests {digests})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="local processes (default 2)")
    parser.add_argument("--strategy", choices=["ddp", "oss", "sharded"], default="sharded")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    for name in ("nproc", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    mp.spawn(worker, args=(args, free_port()), nprocs=args.nproc)


if __name__ == "__main__":
    main()
