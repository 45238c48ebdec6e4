"""Freezing and unfreezing layers rebuilds ShardedDataParallel's buckets; the shared memory a rank maps must stay
bounded however often that happens (it used to grow with every generation; mailboxes are now
reused across buckets and generations, `SLOTS` per sender and root). Checked on the mailboxes a rank holds and on
/dev/shm's usage, with training still equal to DDP's."""

import os
import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed.mailboxes import SLOTS
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4))


def _shm_used() -> int:
    stat = os.statvfs("/dev/shm")
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def _toggle(rank: int, world: int) -> dict:
    warnings.simplefilter("ignore")  # "the set of trainable parameters changed": on purpose here
    ref, model = _model(), _model()
    ddp = DDP(ref, find_unused_parameters=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.05)
    sdp = ShardedDataParallel(model, opt)
    g = torch.Generator().manual_seed(rank)
    held, used = [], []
    for step in range(10):
        frozen = step % 2 == 1  # the middle layer frozen every other step: a new bucket generation each time
        for layer in (model[2], ref[2]):
            layer.requires_grad_(not frozen)
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)
        for net, o in ((ddp, ref_opt), (sdp, opt)):
            o.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x), y).backward()
            o.step()
        held.append(sdp._mailboxes.held())
        used.append(_shm_used())
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return {"held": held, "used": used, "diff": diff}


def test_mailboxes_of_replaced_buckets_are_freed():
    for r in run_distributed(_toggle, 2, timeout=120.0):
        assert r["diff"] <= 1e-6, r["diff"]
        # mailboxes are reused across buckets and generations: at most SLOTS of its own per root, and as many
        # of each sender's mapped (world size 2: one root, one sender)
        assert max(r["held"]) <= 2 * SLOTS, r["held"]
        # /dev/shm: once both slots have been used (the first four steps), no growth beyond 1 MB (the middle
        # layer alone is 1 MB) however many generations follow
        assert max(r["used"][4:]) - max(r["used"][:4]) <= 2**20, r["used"]
