"""`ShardedDataParallel.reduce()` reduces what was accumulated under `no_sync()`, and nothing else: called after a
normal backward (which reduced by itself) it must leave the owners' averaged gradients alone; it used to reduce
them again and divide by N once more. The reference: torch DDP's averaged gradients."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _grads(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]
    ref = DDP(_model())
    model = _model()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    out = {}
    for case in ("after_backward", "after_no_sync"):
        ref.zero_grad()
        sdp.zero_grad(set_to_none=True)
        if case == "after_no_sync":  # accumulate one batch locally, reduce it by hand
            with ref.no_sync():
                nn.functional.cross_entropy(ref(batches[0][0]), batches[0][1]).backward()
            nn.functional.cross_entropy(ref(batches[1][0]), batches[1][1]).backward()
            with sdp.no_sync():
                for x, y in batches:
                    nn.functional.cross_entropy(sdp(x), y).backward()
            sdp.reduce()
        else:
            nn.functional.cross_entropy(ref(batches[0][0]), batches[0][1]).backward()
            nn.functional.cross_entropy(sdp(batches[0][0]), batches[0][1]).backward()
        sdp.reduce()  # a second call: nothing left to reduce
        out[case] = max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
            if opt.owner_of(p) == rank
        )
    return out


def test_reduce_after_a_synced_backward_leaves_the_averages_alone():
    for r in run_distributed(_grads, 2):
        assert r["after_backward"] <= 1e-7, r
        assert r["after_no_sync"] <= 1e-7, r
