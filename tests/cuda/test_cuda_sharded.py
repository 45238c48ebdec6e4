"""OSS + ShardedDataParallel on CUDA tensors: each way of clearing gradients, no_sync, reduce_fp16, unused
parameters, and what is staged between GPU and host on gloo."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from cuda_helpers import batch, max_diff, mlp, nbytes, placed
from test_sharded_ddp import _clear as clear  # the CPU tests' helpers, reused
from test_sharded_ddp import _Routed
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import comm_stats
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed

pytestmark = pytest.mark.cuda

STEPS = 6
TOL = 1e-6


def _clearing(rank, world, device):
    """SDP + OSS(Adam) against DDP + Adam for each way of clearing gradients and two bucket sizes (the bucketed
    one with and without `keep_bucketed_grads`, which keeps a non-owner's own gradient of a bucketed parameter)."""
    out = {}
    with placed(device) as dev:
        for how in ("model", "optimizer", "set_to_none=False"):
            for bucket, keep in ((0, True), (2**23, False), (2**23, True)):
                ref = DDP(mlp(dev))
                ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
                model = mlp(dev)
                opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
                sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket, keep_bucketed_grads=keep)
                worst_grad, foreign = 0.0, 0
                for step in range(STEPS):
                    x, y = batch(rank, step, dev)
                    for m, o in ((ref, ref_opt), (sdp, opt)):
                        clear(m, o, how)
                        with comm_stats.measure() as counted:
                            F.mse_loss(m(x), y).backward()
                            if m is sdp:  # owners hold DDP's averaged gradient, the other ranks none
                                for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                                    if opt.owner_of(p) == rank:
                                        worst_grad = max(worst_grad, (p.grad - q.grad).abs().max().item())
                                    else:
                                        foreign += p.grad is not None
                            o.step()
                own = nbytes(p for p in model.parameters() if opt.owner_of(p) == rank)
                out[(how, bucket, keep)] = {
                    "diff": max_diff(ref.parameters(), model.parameters()),
                    "grad_diff": worst_grad,
                    "foreign_grads": foreign,
                    "reduce": counted.payload_bytes("reduce"),
                    "broadcast": counted.payload_bytes("broadcast"),
                    "staged": counted.payload_bytes("cpu_staging"),
                    "param_bytes": nbytes(model.parameters()),
                    "own_bytes": own,
                }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_data_parallel_matches_ddp_for_each_way_of_clearing(device, world):
    for rank, results in enumerate(run_distributed(_clearing, world, device, device=device)):
        assert len(results) == 9
        for case, r in results.items():
            assert r["diff"] <= TOL and r["grad_diff"] <= TOL, (case, rank, r)
            bucketed_and_kept = case[1] > 0 and case[2]  # the small parameters share buckets; the rank keeps its own
            assert (r["foreign_grads"] > 0) == bucketed_and_kept, (case, rank, r["foreign_grads"])
            # each gradient is reduced to its owner once, each parameter broadcast from it once, as on CPU
            assert r["reduce"] == r["broadcast"] == r["param_bytes"], (case, rank, r)
            # on gloo: every gradient copied out once, the owned ones back once; every parameter crosses once
            assert r["staged"] == 2 * r["param_bytes"] + r["own_bytes"], (case, rank, r)


def _features(rank, world, device):
    out = {}
    with placed(device) as dev:
        # no_sync: two accumulated backwards with nothing sent, then a synced one
        ref, model = DDP(mlp(dev)), mlp(dev)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        opt = OSS(model.parameters(), lr=0.1, momentum=0.9)
        sdp = ShardedDataParallel(model, opt, reduce_buffer_size=100)
        sent_inside = 0
        for step in range(3):
            for m, o in ((ref, ref_opt), (sdp, opt)):
                o.zero_grad()
                for k in range(3):
                    x, y = batch(rank, 3 * step + k, dev)
                    if k < 2:
                        with m.no_sync(), comm_stats.measure() as inside:
                            F.mse_loss(m(x), y).backward()
                        sent_inside += inside.calls() if m is sdp else 0
                    else:
                        F.mse_loss(m(x), y).backward()
                o.step()
        out["no_sync"] = (max_diff(ref.parameters(), model.parameters()), sent_inside)
        # reduce_fp16: gradients go out in half precision
        ref, model = DDP(mlp(dev)), mlp(dev)
        ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), OSS(model.parameters(), lr=0.1)
        sdp = ShardedDataParallel(model, opt, reduce_fp16=True, reduce_buffer_size=100)
        for step in range(4):
            x, y = batch(rank, step, dev)
            for m, o in ((ref, ref_opt), (sdp, opt)):
                o.zero_grad()
                with comm_stats.measure() as counted:
                    F.mse_loss(m(x), y).backward()
                o.step()
        out["reduce_fp16"] = (max_diff(ref.parameters(), model.parameters()), counted.payload_bytes("reduce"))
        out["fp16_bytes"] = sum(p.numel() * 2 for p in model.parameters())
        # unused parameters
        ref = DDP(_Routed().to(dev), find_unused_parameters=True)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
        model = _Routed().to(dev)
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1)
        sdp = ShardedDataParallel(model, opt, find_unused_parameters=True, reduce_buffer_size=8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DDP may warn about the unused parameters
            for step in range(4):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank)).to(dev)
                for m, o in ((ref, ref_opt), (sdp, opt)):
                    o.zero_grad()
                    m(x, rank).sum().backward()
                    o.step()
        untouched = model.c.weight.grad is None and model.c.bias.grad is None
        out["unused"] = (max_diff(ref.module.parameters(), model.parameters()), untouched)
    return out


def test_no_sync_reduce_fp16_and_unused_parameters(device):
    for rank, out in enumerate(run_distributed(_features, 2, device, device=device)):
        diff, sent_inside = out["no_sync"]
        assert diff <= TOL and sent_inside == 0, (rank, out["no_sync"])
        diff, handed = out["reduce_fp16"]
        assert diff < 1e-3 and handed == out["fp16_bytes"], (rank, out["reduce_fp16"], out["fp16_bytes"])
        diff, untouched = out["unused"]
        assert diff <= TOL and untouched, (rank, out["unused"])
