"""Run on each of two network-namespace hosts, two ranks per host: the bytes that leave this host per training
step of torch DDP and of hierarchical ZeRO-2 (OSS + ShardedDataParallel), read from the host's interface
counter (``/proc/net/dev`` of its namespace), and each strategy's parameters against DDP's.

``python tests/hier_probe.py HOST MASTER_ADDR PORT`` prints one JSON line; used by
tests/test_hierarchical_netns.py.
"""

import json
import multiprocessing as mp
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS

PER_HOST, HOSTS, STEPS = 2, 2, 3


def _tx(ifname: str) -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])  # transmit bytes
    raise RuntimeError(f"no interface {ifname} in /proc/net/dev")


def _interface() -> str:
    """The namespace's one interface besides the loopback (the host's link)."""
    with open("/proc/net/dev") as f:
        names = [line.partition(":")[0].strip() for line in f if ":" in line]
    others = [name for name in names if name != "lo"]
    if len(others) != 1:
        raise RuntimeError(f"expected one interface besides lo, found {others}")
    return others[0]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))


def _rank(local: int, host: int, master: str, port: str, ifname: str, queue: mp.Queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    rank = host * PER_HOST + local
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=HOSTS * PER_HOST)
    torch.set_num_threads(1)
    ddp = DDP(_model())
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    module = _model()
    oss = OSS(module.parameters(), optim=torch.optim.Adam, lr=1e-3)
    sdp = ShardedDataParallel(module, oss)
    out: dict = {"rank": rank}
    for name, model, opt in (("ddp", ddp, ddp_opt), ("hierarchical", sdp, oss)):
        sent = 0
        for step in range(STEPS + 1):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(16, 256, generator=g), torch.randint(0, 10, (16,), generator=g)
            dist.barrier()
            before = _tx(ifname)
            dist.barrier()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            dist.barrier()
            if step > 0:  # the first step also sets up (shared memory, hosts, process groups)
                sent += _tx(ifname) - before
        out[name] = sent / STEPS
    out["param_diff"] = max(
        (p - q).abs().max().item() for p, q in zip(module.parameters(), ddp.parameters(), strict=True)
    )
    out["two_stage"] = sdp._two_stage is not None
    out["model_bytes"] = sum(p.numel() * 4 for p in module.parameters())
    queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    host, master, port, ifname = int(sys.argv[1]), sys.argv[2], sys.argv[3], _interface()
    ctx = mp.get_context("forkserver")  # (ranks forked from one interpreter that imported torch)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(local, host, master, port, ifname, queue)) for local in range(PER_HOST)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    print(json.dumps(sorted(results, key=lambda r: r["rank"])))


if __name__ == "__main__":
    main()
