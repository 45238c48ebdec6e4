"""Run inside a fresh network namespace (its loopback carries nothing else): the bytes one training step of each
strategy puts on the wire, read from the kernel's loopback counter, next to what CommStats counted.

Prints one JSON object; used by tests/test_wire_bytes.py.
"""

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import comm_stats, counting_allreduce_hook
from ddpkit.distributed.shared_memory import ENV_VAR as SHARED_MEMORY_ENV
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed


def _tx() -> int:
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def _measure(rank: int, step) -> tuple[float, float]:
    """(bytes on the loopback during `step`, bytes this rank's CommStats counted); barriers fence the step."""
    dist.barrier()
    before = _tx()
    dist.barrier()
    with comm_stats.measure() as counted:
        step()
    dist.barrier()
    return _tx() - before, counted.sent_bytes()


def probe(rank: int, world: int) -> dict:
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(rank))
    ddp = DDP(_model())
    ddp.register_comm_hook(None, counting_allreduce_hook)
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    variants = {"ddp": (ddp, ddp_opt, None)}
    for name, shared_memory in (("sharded", "0"), ("sharded_shm", "1")):  # over gloo / through shared memory
        os.environ[SHARED_MEMORY_ENV] = shared_memory  # read by ShardedDataParallel now, by OSS at its first step
        module = _model()
        oss = OSS(module.parameters(), optim=torch.optim.Adam, lr=1e-3)
        variants[name] = (ShardedDataParallel(module, oss, reduce_buffer_size=2**16), oss, shared_memory)

    def step(model, opt):
        def run():
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        return run

    out = {
        "payload": sum(p.numel() * 4 for p in _model().parameters()),
        "buckets": len(variants["sharded"][0]._buckets),
    }
    for name, (model, opt, shared_memory) in variants.items():
        if shared_memory is not None:  # OSS reads it at its first step
            os.environ[SHARED_MEMORY_ENV] = shared_memory
        for _ in range(2):  # warm up: allocations, connection set-up, DDP's bucket rebuild on its 2nd step
            step(model, opt)()
        wire, counted = _measure(rank, step(model, opt))
        out[name] = {"wire": wire, "counted": counted}
    return out


if __name__ == "__main__":
    import sys

    world = int(sys.argv[1])
    results = run_distributed(probe, world, fresh=True)
    summary = {"payload": results[0]["payload"], "buckets": results[0]["buckets"]}
    for name in ("ddp", "sharded", "sharded_shm"):
        summary[name] = {
            "wire": results[0][name]["wire"],  # the loopback counter is shared: rank 0's reading covers all ranks
            "counted": sum(r[name]["counted"] for r in results),
        }
    print(json.dumps(summary))
