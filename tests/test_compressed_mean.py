"""The compressed mean (ddpkit.algorithms.compressed_mean) on 2 and 4 gloo ranks.

Each world size is one spawned run covering every compression, sizes that do and do not split evenly into
blocks and chunks, the bytes CommStats records, the async form overlapping the caller's own collectives, a
mean over a subgroup, and the argument checks; the assertions are made here, against the single-process
simulation (bit for bit) and the exact byte counts.
"""

import pytest
import torch
import torch.distributed as dist

from ddpkit.algorithms.compressed_mean import (
    chunk_bounds,
    compressed_mean,
    simulate_compressed_mean,
    simulate_messages,
    start_compressed_mean,
)
from ddpkit.algorithms.quantize import COMPRESSIONS, payload_bytes, to_bytes
from ddpkit.distributed import comm
from ddpkit.distributed.stats import comm_stats

CASES = ((1000, 64), (4096, 64), (129, 8), (5, 64), (0, 8))  # (numel, block): uneven, even, odd, tiny, empty
ASYNC_NUMEL = 200_000


def _input(rank: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=g) * (1 + rank)


def _counts(delta) -> dict:
    return {kind: (c.calls, c.payload_bytes, c.sent_bytes) for (kind, _), c in delta.snapshot().items()}


def _means(rank: int, world: int) -> dict:
    out = {}
    for compression in COMPRESSIONS:
        for seed, (numel, block) in enumerate(CASES):
            with comm_stats.measure() as delta:
                pending = start_compressed_mean(_input(rank, numel, seed), None, compression, block)
                result = pending.wait()
            messages = [to_bytes(q) for q in pending.sent] + [to_bytes(pending.owner)]
            out[compression, numel, block] = (result, messages, _counts(delta))
    return out


def _overlap(rank: int, world: int) -> dict:
    """Two means in flight while this thread runs all-reduces on the default group; inputs changed after start."""
    first, second = _input(rank, ASYNC_NUMEL, 100), _input(rank, ASYNC_NUMEL, 101)
    pending = [start_compressed_mean(first, None, "int8", 64)]
    first.add_(100.0)  # quantised at start: the mean must not see this
    sums = []
    for step in range(6):
        t = torch.full((1000,), float(rank + step))
        comm.all_reduce(t)
        sums.append(t[0].item())
        if step == 2:
            pending.append(start_compressed_mean(second, None, "int4", 64))
    return {"means": [p.wait() for p in pending], "sums": sums}


def _subgroups(rank: int, world: int) -> dict:
    """Means over subgroups started by their members alone (as over node masters), in an order that gives the
    ranks different numbers of groups: 0 and 2 first, then 0, 1 and 2, then 0 and 2 while 1 and 3 average."""
    pair, trio, other = dist.new_group([0, 2]), dist.new_group([0, 1, 2]), dist.new_group([1, 3])
    out = {}
    if rank in (0, 2):
        out["pair"] = compressed_mean(_input(rank, 777, 7), pair, "int4", 16)
    if rank in (0, 1, 2):
        out["trio"] = compressed_mean(_input(rank, 300, 8), trio, "int8", 64)
    out["again"] = compressed_mean(_input(rank, 500, 9), pair if rank in (0, 2) else other, "bf16", 64)
    return out


def _errors(rank: int, world: int) -> list[str]:
    bad = [
        (torch.zeros(8), "fp8", 64),
        (torch.zeros(8), "int8", 0),
        (torch.zeros(8), "int4", 3),
        (torch.zeros(2, 4), "int8", 64),
        (torch.zeros(8, dtype=torch.float16), "int8", 64),
    ]
    messages = []
    for flat, compression, block in bad:
        try:
            compressed_mean(flat, None, compression, block)
        except ValueError as error:
            messages.append(str(error))
    comm.barrier()  # every rank is still in step after the refusals
    return messages


def _run_all(rank: int, world: int) -> dict:
    out = {"means": _means(rank, world), "overlap": _overlap(rank, world), "errors": _errors(rank, world)}
    if world == 4:
        out["subgroups"] = _subgroups(rank, world)
    return out


def _roundtrip(x: torch.Tensor, compression: str, block: int) -> torch.Tensor:
    """Quantise and dequantise `x`, written here from the definitions (per-block absmax: scale = absmax / qmax,
    round half to even; bf16: round to nearest), independently of ddpkit.algorithms.quantize."""
    if compression == "none":
        return x.clone()
    if compression == "bf16":
        return x.to(torch.bfloat16).to(torch.float32)
    qmax = {"int8": 127, "int4": 7}[compression]
    n = x.numel()
    rows = torch.cat([x, x.new_zeros(-(-n // block) * block - n)]).view(-1, block)
    scale = rows.abs().amax(dim=1, keepdim=True) / qmax
    q = torch.round(rows / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-qmax, qmax)
    return (q * scale).view(-1)[:n]


def _reference_mean(inputs: list[torch.Tensor], compression: str, block: int) -> torch.Tensor:
    """The algorithm of the module doc, step by step: chunks of whole blocks dealt out evenly (the first ones a
    block longer), each rank's chunk quantised, the owner's fp32 sum in rank order divided by N and quantised."""
    world, n = len(inputs), inputs[0].numel()
    per, extra = divmod(-(-n // block), world)
    out, start = [], 0
    for j in range(world):
        stop = min(n, start + (per + (j < extra)) * block)
        total = _roundtrip(inputs[0][start:stop], compression, block)
        for x in inputs[1:]:
            total = total + _roundtrip(x[start:stop], compression, block)
        out.append(_roundtrip(total / world, compression, block))
        start = stop
    return torch.cat(out) if out else torch.zeros(0)


def _check_means(results: list[dict], world: int) -> None:
    for compression in COMPRESSIONS:
        for seed, (numel, block) in enumerate(CASES):
            key = (compression, numel, block)
            inputs = [_input(r, numel, seed) for r in range(world)]
            expected = simulate_compressed_mean(inputs, compression, block)
            # independent of the code under test: the definition, written in this file (a biased owner mean, e.g.
            # 0.9x, fails here though the simulation, which shares the code's helpers, would follow it)
            reference = _reference_mean(inputs, compression, block)
            assert torch.equal(results[0]["means"][key][0], reference), (key, "the definition")
            sent, owners = simulate_messages(inputs, compression, block)
            total = payload_bytes(numel, compression, block)
            chunk = [payload_bytes(b - a, compression, block) for a, b in chunk_bounds(numel, world, block)]
            assert sum(chunk) == total
            for rank, ranked in enumerate(results):
                result, messages, counts = ranked["means"][key]
                assert torch.equal(result, expected), (key, rank)  # bit for bit, so the same on every rank
                want = [to_bytes(q) for q in sent[rank]] + [to_bytes(owners[rank])]
                assert all(torch.equal(a, b) for a, b in zip(messages, want, strict=True)), (key, rank)
                # exact bytes: payload is the quantised tensor (payload + scales), then this rank's chunk
                assert counts["all_to_all"] == (1, total, float(total - chunk[rank])), (key, rank, counts)
                assert counts["all_gather"] == (1, chunk[rank], float((world - 1) * chunk[rank])), (key, rank)
                sent_bytes = counts["all_to_all"][2] + counts["all_gather"][2]
                assert sent_bytes == total + (world - 2) * chunk[rank]
                slack = (world - 2) * payload_bytes(block, compression, block)  # one block longer than average
                assert sent_bytes <= 2 * (world - 1) / world * total + slack, (key, rank)
                if len(set(chunk)) == 1:
                    assert sent_bytes == 2 * (world - 1) / world * total  # a ring all-reduce's share of Q
            by_rank = [r["means"][key][2] for r in results]
            sent_by_all = sum(c["all_to_all"][2] + c["all_gather"][2] for c in by_rank)
            assert sent_by_all == 2 * (world - 1) * total


def _check_overlap(results: list[dict], world: int) -> None:
    for i, (seed, compression) in enumerate(((100, "int8"), (101, "int4"))):
        inputs = [_input(r, ASYNC_NUMEL, seed) for r in range(world)]
        expected = simulate_compressed_mean(inputs, compression, 64)
        assert all(torch.equal(r["overlap"]["means"][i], expected) for r in results), compression
        plain = torch.stack(inputs).mean(0)
        assert (expected - plain).abs().max() < 0.2 * plain.abs().max()  # near the mean, far from the +100
    sums = [sum(r + step for r in range(world)) for step in range(6)]
    assert all(r["overlap"]["sums"] == sums for r in results)


def _check_errors(results: list[dict]) -> None:
    for ranked in results:
        messages = ranked["errors"]
        assert len(messages) == 5
        assert "slowmo_compression must be one of" in messages[0]
        assert "slowmo_compression_block must be an int >= 1" in messages[1]
        assert "slowmo_compression_block must be even" in messages[2]
        assert all("flat must be a 1-D float32 tensor" in m for m in messages[3:])


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_mean_matches_the_simulation_with_exact_bytes(world):
    from ddpkit.testing import run_distributed

    results = run_distributed(_run_all, world)
    _check_means(results, world)
    _check_overlap(results, world)
    _check_errors(results)
    if world == 4:
        subgroups = [r["subgroups"] for r in results]
        expected = simulate_compressed_mean([_input(r, 777, 7) for r in (0, 2)], "int4", 16)
        assert all(torch.equal(subgroups[r]["pair"], expected) for r in (0, 2))
        expected = simulate_compressed_mean([_input(r, 300, 8) for r in (0, 1, 2)], "int8", 64)
        assert all(torch.equal(subgroups[r]["trio"], expected) for r in (0, 1, 2))
        for members in ([0, 2], [1, 3]):
            expected = simulate_compressed_mean([_input(r, 500, 9) for r in members], "bf16", 64)
            assert all(torch.equal(subgroups[r]["again"], expected) for r in members)
