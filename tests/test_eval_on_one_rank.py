"""An evaluation on rank 0 only (``with torch.no_grad(): model(x)``) of a model with BatchNorm buffers:
ShardedDataParallel and SlowMo neither hang nor train differently afterwards. A forward that
synced buffers here would start a broadcast the other rank never joins. (torch 2.13's DDP is no reference for
this: it syncs buffers in the first forward after a training one whatever the grad mode, and in this test it
ended in a gloo connection reset.)"""

import torch
from torch import nn

from ddpkit.nn import ShardedDataParallel, SlowMoDistributedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _train(rank: int, wrap: str, evaluate: bool) -> list[torch.Tensor]:
    module = _model()
    if wrap == "sharded":
        opt = OSS(module.parameters(), optim=torch.optim.SGD, lr=0.1)
        model = ShardedDataParallel(module, opt)
    else:
        model = SlowMoDistributedDataParallel(module, nprocs_per_node=1, slowmo_frequency=2)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        if evaluate and rank == 0 and step == 1:
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 6))  # its own random numbers: the training batches stay the same
            model.train()
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 2, (4,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if wrap == "slowmo":
            model.perform_slowmo(opt)
    return [t.detach().clone() for t in module.state_dict().values()]


def _both(rank: int, world: int, wrap: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return _train(rank, wrap, True), _train(rank, wrap, False)


def test_evaluating_on_one_rank_neither_hangs_nor_changes_training():
    for wrap in ("sharded", "slowmo"):
        results = run_distributed(_both, 2, wrap, timeout=120.0, pg_timeout=15.0)
        for with_eval, without in results:
            for a, b in zip(with_eval, without, strict=True):
                assert torch.equal(a, b), wrap
