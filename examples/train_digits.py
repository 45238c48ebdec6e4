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
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from ddpkit.distributed import comm_stats, counting_allreduce_hook
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 8x8 digits, standardised, split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    split = int(0.8 * len(x))
    train, test = order[:split], order[split:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def build(strategy: str, optimizer: str, lr: float) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
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


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def checksum(model: nn.Module) -> list[float]:
    """Every rank's sum of parameters, gathered: equal numbers mean equal replicas."""
    mine = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    all_sums = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(all_sums, mine)
    return [s.item() for s in all_sums]


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc, timeout=timedelta(seconds=60)
    )
    train, test = digits()
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
    sums = checksum(model)
    per_rank_state = [torch.zeros(1, dtype=torch.int64) for _ in range(args.nproc)]
    dist.all_gather(per_rank_state, torch.tensor([state_bytes(optimizer)]))
    if rank == 0:
        print(f"test accuracy        {accuracy:.3f}")
        print(f"wall time            {elapsed:.1f} s ({steps * args.batch_size * args.nproc / elapsed:.0f} samples/s)")
        print(f"sent per step        {sent.sent_bytes() / 1e3:.1f} kB (this rank, modelled wire bytes)")
        print(f"optimizer state      {', '.join(f'{int(s.item()) / 1e3:.0f} kB' for s in per_rank_state)} per rank")
        print(f"replicas equal       {len(set(sums)) == 1} (parameter sums {sums})")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
