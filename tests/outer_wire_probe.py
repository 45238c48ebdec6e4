"""One host of tests/test_outer_wire_bytes.py: SlowMo's outer synchronisation of an 8-layer MLP, averaging every 4
steps, in fp32, int8 and int4, with 1 and 4 fragments; the bytes each step puts on this host's interface.

``python tests/outer_wire_probe.py RANK MASTER_ADDR PORT OUT.json`` (run inside a network namespace, with
GLOO_SOCKET_IFNAME naming its interface); writes, per variant, the interface's bytes sent in each measured step,
what CommStats counted and a digest of the parameters after the last step.
"""

import hashlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.distributed import comm_stats
from ddpkit.nn import SlowMoDistributedDataParallel

PERIOD = 4
WIDTH = 256
VARIANTS = (("none", 1), ("int8", 1), ("int4", 1), ("none", 4), ("int8", 4), ("int4", 4))


def tx() -> int:
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for i in range(8):
        layers += [nn.Linear(WIDTH, WIDTH)] + ([nn.ReLU()] if i < 7 else [])
    return nn.Sequential(*layers)


def variant(rank: int, compression: str, fragments: int) -> dict:
    model = SlowMoDistributedDataParallel(
        mlp(),
        nprocs_per_node=1,
        localsgd_frequency=PERIOD,
        slowmo_frequency=PERIOD,
        slowmo_compression=compression,
        slowmo_fragments=fragments,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    steps, counted = [], 0.0
    for step in range(3 * PERIOD):  # the first period warms up: connections, groups, buffers
        x, y = torch.randn(32, WIDTH, generator=g), torch.randn(32, WIDTH, generator=g)
        dist.barrier()
        before = tx()
        with comm_stats.measure() as sent:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            model.zero_grad(set_to_none=True)
            model.perform_slowmo(optimizer)
        dist.barrier()
        if step >= PERIOD:
            steps.append(tx() - before)
            counted += sent.sent_bytes()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    return {"steps": steps, "counted": counted, "digest": digest}


def main() -> None:
    rank, master, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    init = f"tcp://{master}:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    results = {f"{c}/{k}": variant(rank, c, k) for c, k in VARIANTS}
    results["model_bytes"] = sum(p.numel() * 4 for p in mlp().parameters())
    Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
