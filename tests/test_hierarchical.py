"""Hierarchical ZeRO across hosts: within each host first (shared memory), then one copy per host across.

Four ranks on this machine play two hosts of two ranks: each rank reports a host identity of its own choosing
(``shared_memory.host_identity``, which ddpkit reads to decide what is one host), so shared memory is used within
each pair and sockets between them, exactly as on two machines. The reference is torch DDP + Adam; the bytes
across hosts are what the lane groups (rank l of every host) send, counted by `comm_stats`, against the exact
count: every gradient byte leaves each host that does not own it once, every parameter byte leaves its owner's
host once. `test_hierarchical_netns.py` checks the same on two network namespaces by the interfaces' counters.
"""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import comm_stats, counting_allreduce_hook, shared_memory
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed

TOL = 1e-5
STEPS = 3


def _fake_hosts(rank: int, per_host: list[int]) -> None:
    host = next(h for h, end in enumerate(per_host) if rank < sum(per_host[: h + 1]))
    shared_memory.host_identity = lambda: f"test-host-{host}"  # type: ignore[assignment]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    x, y = torch.randn(6, 16, generator=g), torch.randint(0, 5, (6,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def _lane_bytes(stats: dict) -> float:
    """Bytes sent on the two lane groups (ranks 0 and 2; ranks 1 and 3): what crosses between the hosts."""
    return sum(c.sent_bytes for (kind, group), c in stats.items() if group in ("ranks[0,2]", "ranks[1,3]"))


def _train(rank: int, world: int, hierarchical: bool | None) -> dict:
    original = shared_memory.host_identity
    _fake_hosts(rank, [2, 2])
    try:
        ref, model = _model(), _model()
        ddp = DDP(ref)
        ddp.register_comm_hook(None, counting_allreduce_hook)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, hierarchical=hierarchical)
        sdp = ShardedDataParallel(model, opt, reduce_buffer_size=500)
        out: dict = {"lane": 0.0, "world": 0.0, "shm": 0}
        for step in range(STEPS):
            ref_opt.zero_grad()
            opt.zero_grad()
            if step == 1:  # accumulated locally, then the synced backward
                with ddp.no_sync():
                    _loss(ddp, rank, 99).backward()
                with sdp.no_sync():
                    _loss(sdp, rank, 99).backward()
            _loss(ddp, rank, step).backward()
            with comm_stats.measure() as d:
                _loss(sdp, rank, step).backward()
                opt.step()
            ref_opt.step()
            if step == 0:
                continue  # the first step also agrees on shared memory and the hosts (object all-gathers)
            stats = d.snapshot()
            out["lane"] += _lane_bytes(stats)
            out["world"] += sum(c.sent_bytes for (kind, group), c in stats.items() if group == "world")
            out["shm"] += d.payload_bytes("shared_memory")
        pairs = zip(model.parameters(), ref.parameters(), strict=True)
        out["param_diff"] = max((p - q).abs().max().item() for p, q in pairs)
        out["trainable"] = sum(p.numel() * 4 for p in model.parameters())
        out["hierarchical"] = sdp._two_stage is not None and opt._broadcaster._hosts is not None
        return out
    finally:
        shared_memory.host_identity = original


def test_two_hosts_of_two_ranks_match_ddp_and_send_each_byte_once_per_host():
    results = run_distributed(_train, 4, None, timeout=300.0)
    flat = run_distributed(_train, 4, False, timeout=300.0)
    trainable = results[0]["trainable"]
    for rank, (r, f) in enumerate(zip(results, flat, strict=True)):
        assert r["hierarchical"] and not f["hierarchical"], rank
        assert r["param_diff"] <= TOL, (rank, r["param_diff"])
        assert f["param_diff"] <= TOL, (rank, f["param_diff"])
        assert r["world"] == 0.0, (rank, r)  # nothing goes over the whole group's sockets
        assert r["shm"] > 0, rank  # within a host: shared memory
    # Across hosts, per step: each gradient byte once from the host that does not own it (H - 1 = 1 copy), each
    # parameter byte once from its owner's host to the other: 2 (H - 1) = 2 copies of the model in all.
    across = sum(r["lane"] for r in results) / (STEPS - 1)
    assert across == pytest.approx(2 * trainable), (across, trainable)
    # Flat, every rank sends DDP's 2 (N - 1) / N copies, 6 in all, half of them between the two hosts.
    assert sum(f["world"] for f in flat) / (STEPS - 1) == pytest.approx(6 * trainable)


def _uneven(rank: int, world: int) -> str:
    original = shared_memory.host_identity
    _fake_hosts(rank, [2, 1])
    try:
        opt = OSS(_model().parameters(), optim=torch.optim.Adam, lr=1e-2, hierarchical=True)
        ShardedDataParallel(_model(), opt)
        return "accepted"
    except ValueError as exc:
        return str(exc)
    finally:
        shared_memory.host_identity = original


def test_an_uneven_layout_is_refused_on_every_rank_naming_the_hosts():
    for message in run_distributed(_uneven, 3, timeout=120.0):
        assert "same number of ranks on every host" in message, message
        assert "host 0: ranks 0, 1; host 1: ranks 2" in message, message


def _int8_roundtrip(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Per-block absmax int8 (scale = absmax / 127, round half to even), written here from the definition."""
    pad = (-x.numel()) % block
    blocks = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)), 0)
    return (q * scale).view(-1)[: x.numel()]


def _compressed(rank: int, world: int) -> dict:
    original = shared_memory.host_identity
    _fake_hosts(rank, [2, 2])
    try:
        model = _model()
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
        sdp = ShardedDataParallel(model, opt, reduce_buffer_size=500, cross_host_compression="int8")
        plain = [_model() for _ in range(world)]  # every rank's gradient, computed here for the reference
        residual: dict[int, torch.Tensor] = {}
        out = {"max_err": 0.0, "max_step": 0.0, "lane_bytes": 0.0, "expected_lane_bytes": 0.0}
        for step in range(2):  # the second step carries the first one's rounding error
            opt.zero_grad()
            with comm_stats.measure() as d:
                _loss(sdp, rank, step).backward()
            out["lane_bytes"] += _lane_bytes(d.snapshot())
            for m in plain:
                m.zero_grad()
            grads = []
            for r, m in enumerate(plain):
                _loss(m, r, step).backward()
                grads.append({name: p.grad.clone() for name, p in m.named_parameters()})
            names = {p: name for name, p in model.named_parameters()}
            for index, bucket in enumerate(sdp._buckets):
                flat = [torch.cat([g[names[p]].reshape(-1) for p in bucket.params]) for g in grads]
                host_sums = [flat[0] + flat[1], flat[2] + flat[3]]
                owner_host = bucket.owner // 2
                other = host_sums[1 - owner_host]
                corrected = other + residual.get(index, torch.zeros_like(other))
                sent = _int8_roundtrip(corrected)
                residual[index] = corrected - sent
                if rank == 0:  # one int8 message per bucket crosses: its values and one fp32 scale per 64
                    out["expected_lane_bytes"] += other.numel() + 4 * -(-other.numel() // 64)
                if bucket.owner != rank:
                    continue
                expected = (host_sums[owner_host] + sent) / world
                got = torch.cat([p.grad.reshape(-1) for p in bucket.params])
                out["max_err"] = max(out["max_err"], (got - expected).abs().max().item())
                out["max_step"] = max(out["max_step"], corrected.abs().max().item() / 127 / world)
        return out
    finally:
        shared_memory.host_identity = original


def test_int8_between_hosts_with_error_feedback_matches_the_definition_and_its_bytes():
    results = run_distributed(_compressed, 4, timeout=300.0)
    for rank, r in enumerate(results):
        # the test's own quantiser on its own host sums: equal up to fp32 sum order (at most one rounding flip)
        assert r["max_err"] <= 1e-6 + r["max_step"], (rank, r)
    counted = sum(r["lane_bytes"] for r in results)
    expected = sum(r["expected_lane_bytes"] for r in results)
    assert counted == pytest.approx(expected), (counted, expected)
