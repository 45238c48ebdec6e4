"""OSS on CUDA tensors (SGD with momentum, Adam, AdamW; fused and not) with DDP, and checkpoints between devices."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cuda_helpers import batch, max_diff, mlp, nbytes, placed, state_devices
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import comm_stats
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed

pytestmark = pytest.mark.cuda

STEPS = 6
TOL = 1e-6  # OSS against DDP + the torch optimizer, the same kernels on the same device
CROSS_DEVICE_TOL = 1e-4  # a run resumed on the other device against the one that went on: different kernels
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _train(model, opt, rank, steps, device):
    for step in steps:
        x, y = batch(rank, step, device)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _parity(rank, world, device):
    out = {}
    with placed(device) as dev:
        for name, (cls, kwargs) in OPTIMIZERS.items():
            for fused in (False, True):
                ref = DDP(mlp(dev))
                ref_opt = cls(ref.parameters(), fused=fused, **kwargs)
                model = DDP(mlp(dev))
                opt = OSS(model.parameters(), optim=cls, fused=fused, **kwargs)
                _train(ref, ref_opt, rank, range(STEPS), dev)
                _train(model, opt, rank, range(STEPS - 1), dev)
                with comm_stats.measure() as last:
                    _train(model, opt, rank, [STEPS - 1], dev)
                out[(name, fused)] = {
                    "diff": max_diff(ref.parameters(), model.parameters()),
                    "fused": bool(opt.optim.defaults.get("fused")),
                    "devices": (state_devices(opt.optim), [dev.type]),
                    "param_bytes": nbytes(model.parameters()),
                    "broadcast": last.payload_bytes("broadcast"),
                    "staged": last.payload_bytes("cpu_staging"),
                    "state_bytes": (nbytes(v for s in opt.optim.state.values() for v in s.values() if v.dim()), 0),
                    "ref_state_bytes": nbytes(v for s in ref_opt.state.values() for v in s.values() if v.dim()),
                }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_oss_with_ddp_matches_torch_optimizers_fused_and_not(device, world):
    results = run_distributed(_parity, world, device, device=device)
    for case, first in results[0].items():
        per_rank = [r[case] for r in results]
        for rank, r in enumerate(per_rank):
            assert r["diff"] <= TOL, (case, rank, r["diff"])
            assert r["fused"] == case[1], case
            assert r["devices"][0] == r["devices"][1], (case, r["devices"])  # the state lives on the GPU
            # every parameter goes out once per step (one message per owner), and on gloo every byte of it
            # crosses between GPU and host exactly once on this rank: out of its owner, into each other rank
            assert r["broadcast"] == r["param_bytes"], (case, rank, r)
            assert r["staged"] == r["param_bytes"], (case, rank, r)
        # the optimizer state is sharded: the ranks' shards add up to the plain optimizer's state
        assert sum(r["state_bytes"][0] for r in per_rank) == first["ref_state_bytes"], case
        assert max(r["state_bytes"][0] for r in per_rank) < first["ref_state_bytes"], case


def _checkpoints(rank, world, device, folder):
    out = {}
    with placed(device) as dev:
        cpu = torch.device("cpu")
        for i, (src, dst) in enumerate(((dev, cpu), (cpu, dev))):
            model = DDP(mlp(src))
            opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
            _train(model, opt, rank, range(3), src)
            opt.consolidate_state_dict(recipient_rank=0)
            path = os.path.join(folder, f"{i}-{src.type}-to-{dst.type}.pt")
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, path)
            dist.barrier()
            _train(model, opt, rank, range(3, 6), src)  # the run that goes on where it was
            saved = torch.load(path, map_location="cpu", weights_only=False)
            resumed = mlp(dst, seed=1)  # other initial values: all must come from the checkpoint
            resumed.load_state_dict(saved["model"])
            resumed = DDP(resumed)
            resumed_opt = OSS(resumed.parameters(), optim=torch.optim.Adam, lr=0.01)
            resumed_opt.load_state_dict(saved["optim"])
            state_on = state_devices(resumed_opt.optim)
            _train(resumed, resumed_opt, rank, range(3, 6), dst)
            diff = max_diff(model.parameters(), resumed.parameters())
            out[f"{i}: {src.type} -> {dst.type}"] = (diff, state_on, dst.type)
    return out


def test_checkpoints_move_between_gpu_and_cpu(device, tmp_path):
    for rank, out in enumerate(run_distributed(_checkpoints, 2, device, str(tmp_path), device=device)):
        assert len(out) == 2
        for case, (diff, state_on, dst) in out.items():
            assert diff <= CROSS_DEVICE_TOL, (case, rank, diff)
            assert state_on == [dst], (case, rank, state_on)  # loaded state follows the parameters' device
