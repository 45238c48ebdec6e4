"""Mixed precision on CUDA: ShardedGradScaler with fp16 autocast and a real overflow on one rank only, and bf16."""

import pytest
import torch
import torch.nn.functional as F
from cuda_helpers import batch, flat, max_diff, mlp, placed
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS, ShardedGradScaler
from ddpkit.testing import run_distributed

pytestmark = pytest.mark.cuda

STEPS, BAD_STEP = 6, 2
INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 3


def _fp16(rank, world, device):
    """OSS(SGD) + SDP + ShardedGradScaler against DDP + SGD + torch's GradScaler; at BAD_STEP the last rank's
    input is beyond fp16's range, so its forward overflows (inf) and so do its gradients."""
    with placed(device) as dev:
        ref = DDP(mlp(dev))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        ref_scaler = torch.amp.GradScaler(dev.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        model = mlp(dev)
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.05)
        sdp = ShardedDataParallel(model, opt)
        scaler = ShardedGradScaler(device=dev.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        scales, ref_scales, changed = [], [], []
        for step in range(STEPS):
            x, y = batch(rank, step, dev)
            if step == BAD_STEP and rank == world - 1:
                x = x * 1e6  # fp16's largest finite value is 65504
            for m, o, s, log in ((ref, ref_opt, ref_scaler, ref_scales), (sdp, opt, scaler, scales)):
                o.zero_grad()
                with torch.autocast(dev.type, dtype=torch.float16):
                    out = m(x)
                loss = F.mse_loss(out.float(), y)
                before = flat(model.parameters())
                s.scale(loss).backward()
                s.step(o)
                s.update()
                log.append(s.get_scale())
                if m is sdp:
                    changed.append(not torch.equal(before, flat(model.parameters())))
        return {
            "scales": scales,
            "ref_scales": ref_scales,
            "changed": changed,
            "diff": max_diff(ref.parameters(), model.parameters()),
            "finite": bool(torch.isfinite(flat(model.parameters())).all()),
        }


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(device):
    results = run_distributed(_fp16, 2, device, device=device)
    expected_changed = [step != BAD_STEP for step in range(STEPS)]
    for rank, r in enumerate(results):
        assert r["changed"] == expected_changed, (rank, r["changed"])  # every rank skipped the same step
        assert r["scales"] == r["ref_scales"] == results[0]["scales"], (rank, r)  # and backed off together
        assert r["scales"][BAD_STEP] == INIT_SCALE / 2, r["scales"]
        assert r["finite"] and r["diff"] <= 1e-5, (rank, r["diff"])


def _bf16(rank, world, device):
    with placed(device) as dev:
        ref = DDP(mlp(dev))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
        model = mlp(dev)
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.01)
        sdp = ShardedDataParallel(model, opt)
        for step in range(STEPS):
            x, y = batch(rank, step, dev)
            for m, o in ((ref, ref_opt), (sdp, opt)):
                o.zero_grad()
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    loss = F.mse_loss(m(x).float(), y)
                loss.backward()
                o.step()
        return max_diff(ref.parameters(), model.parameters())


def test_bf16_autocast_matches_ddp(device):
    for rank, diff in enumerate(run_distributed(_bf16, 2, device, device=device)):
        assert diff <= 1e-5, (rank, diff)
