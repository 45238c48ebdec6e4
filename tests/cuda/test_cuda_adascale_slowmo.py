"""AdaScale (with DDP and with OSS) and SlowMo (local SGD, slow momentum, nprocs_per_node) on CUDA tensors.

Each runs on the GPU and, in the same ranks and the same process group, on the CPU, where the CPU test suite has
already checked it against the paper's formulas: the GPU run must give the same numbers. Independent checks are
added where they are cheap (OSS inside AdaScale against the plain optimizer; which replicas agree when)."""

import pytest
import torch
import torch.nn.functional as F
from cuda_helpers import batch, flat, mlp, placed
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.nn import SlowMoDistributedDataParallel
from ddpkit.optim import OSS, AdaScale
from ddpkit.testing import run_distributed

pytestmark = pytest.mark.cuda

STEPS = 6
CROSS_DEVICE_TOL = 1e-5  # GPU against CPU kernels on a tiny MLP


def _adascale(rank, world, device):
    out = {}
    with placed(device) as dev:
        for label, where, sharded in (("cpu", torch.device("cpu"), False), ("gpu", dev, False), ("gpu+oss", dev, True)):
            model = DDP(mlp(where))
            if sharded:
                base = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.05, momentum=0.9)
            else:
                base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            opt = AdaScale(base)
            gains = []
            for step in range(STEPS):
                x, y = batch(rank, step, where)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                gains.append(opt.gain())
                opt.step()
            out[label] = (gains, flat(model.parameters()))
    return out


def test_adascale_with_ddp_and_with_oss(device):
    for rank, out in enumerate(run_distributed(_adascale, 2, device, device=device)):
        cpu_gains, cpu_params = out["cpu"]
        gpu_gains, gpu_params = out["gpu"]
        oss_gains, oss_params = out["gpu+oss"]
        assert all(1.0 <= g <= 2.0 for g in gpu_gains) and len(set(gpu_gains)) > 1, gpu_gains  # a real gain
        assert gpu_gains == pytest.approx(cpu_gains, rel=1e-4), (rank, gpu_gains, cpu_gains)
        assert (gpu_params - cpu_params).abs().max().item() <= CROSS_DEVICE_TOL
        assert oss_gains == pytest.approx(gpu_gains, rel=1e-6), (rank, oss_gains, gpu_gains)
        assert (oss_params - gpu_params).abs().max().item() <= 1e-6


SLOWMO = {
    "local SGD": {"nprocs_per_node": 1, "slowmo_momentum": 0.0, "slowmo_lr": 1.0, "localsgd_frequency": 2},
    "slow momentum": {"nprocs_per_node": 1, "slowmo_momentum": 0.5, "slowmo_frequency": 3, "localsgd_frequency": 2},
    "nprocs_per_node=2": {"nprocs_per_node": 2, "slowmo_momentum": 0.5, "slowmo_frequency": 2, "localsgd_frequency": 3},
}


def _slowmo(rank, world, device, name):
    runs = []  # [on CPU, on the device]
    with placed(device) as dev:
        for where in (torch.device("cpu"), dev):
            model = SlowMoDistributedDataParallel(mlp(where), **SLOWMO[name])
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            history = []
            for step in range(STEPS):
                x, y = batch(rank, step, where)
                F.mse_loss(model(x), y).backward()
                opt.step()
                model.zero_grad(set_to_none=True)
                model.perform_slowmo(opt)
                history.append(flat(model.parameters()))
            runs.append(torch.stack(history))
    return tuple(runs)


def _averaged_after(cfg, t):
    slow = cfg.get("slowmo_momentum", 0.5) != 0.0 or cfg.get("slowmo_lr", 1.0) != 1.0
    return t % cfg["localsgd_frequency"] == 0 or (slow and t % cfg.get("slowmo_frequency", 48) == 0)


@pytest.mark.parametrize("name", list(SLOWMO))
def test_slowmo_on_gpu_matches_cpu_and_replicas_agree_when_they_should(device, name):
    world = 4
    cfg = SLOWMO[name]
    results = run_distributed(_slowmo, world, device, name, device=device)
    gpu = torch.stack([g for _, g in results])  # [ranks, steps, P]
    for rank, (cpu_run, gpu_run) in enumerate(results):
        assert (gpu_run - cpu_run).abs().max().item() <= CROSS_DEVICE_TOL, (name, rank)
    n = cfg["nprocs_per_node"]
    for t in range(1, STEPS + 1):
        after = gpu[:, t - 1]
        for r in range(world):  # a node's processes hold one replica, always
            assert (after[r] - after[r - r % n]).abs().max().item() <= 1e-7, (name, t, r)
        spread = (after - after[0]).abs().max().item()
        if _averaged_after(cfg, t):
            assert spread <= 1e-6, (name, t, spread)
        else:
            assert spread > 1e-4, (name, t, spread)  # the nodes trained on different data and were not averaged
