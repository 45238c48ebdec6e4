"""Per-block absmax quantisation (ddpkit.algorithms.quantize) and the single-process simulation of the
compressed mean: round-trip bounds, the exact byte counts, int4 packing, messages and argument checks."""

import itertools

import pytest
import torch

from ddpkit.algorithms.compressed_mean import chunk_bounds, simulate_compressed_mean, simulate_messages
from ddpkit.algorithms.quantize import (
    COMPRESSIONS,
    Quantized,
    check_compression,
    dequantize,
    from_bytes,
    payload_bytes,
    quantize,
    to_bytes,
)

QMAX = {"int8": 127, "int4": 7}
SIZES = (0, 1, 7, 63, 64, 65, 129, 1000)


def _sample(numel: int, seed: int = 0) -> torch.Tensor:
    """Values over many magnitudes, an all-zero block and a block with one outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.logspace(-6, 3, numel if numel else 1)[:numel]
    if numel >= 192:
        x[64:128] = 0.0
        x[130] = 1e4
    return x


def _bound(x: torch.Tensor, compression: str, block: int) -> torch.Tensor:
    """The documented per-element bound on |x - dequantize(quantize(x))|."""
    if compression == "none":
        return torch.zeros_like(x)
    if compression == "bf16":
        return x.abs() * 2.0**-8
    pad = -x.numel() % block
    absmax = torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, block).amax(1)
    per_block = absmax / (2 * QMAX[compression]) + absmax * 2.0**-21
    return per_block.repeat_interleave(block)[: x.numel()]


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_round_trip_within_the_documented_bound_and_exact_bytes(compression):
    for block in (2, 8, 64):
        for numel in SIZES:
            x = _sample(numel, seed=numel)
            q = quantize(x, compression, block)
            back = dequantize(q)
            assert back.dtype == torch.float32 and back.shape == x.shape
            assert ((x - back).abs() <= _bound(x, compression, block)).all(), (compression, block, numel)
            assert q.nbytes() == payload_bytes(numel, compression, block)
            message = to_bytes(q)
            assert message.dtype == torch.uint8 and message.numel() == q.nbytes()
            assert torch.equal(dequantize(from_bytes(message, numel, compression, block)), back)
            # a message cut out of a larger buffer at an odd offset (as received) decodes the same
            shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), message])[3:]
            assert torch.equal(dequantize(from_bytes(shifted, numel, compression, block)), back)
            assert torch.equal(quantize(x.clone(), compression, block).payload, q.payload)  # deterministic


def test_the_bound_is_tight_and_zero_blocks_are_exact():
    """The worst case reaches about half a step (the bound is not loose), all-zero blocks come back as zeros."""
    x = torch.rand(64 * 500, generator=torch.Generator().manual_seed(0)) * 2 - 1
    for compression, qmax in QMAX.items():
        err = (x - dequantize(quantize(x, compression, 64))).abs().view(-1, 64).amax(1)
        step = x.view(-1, 64).abs().amax(1) / qmax
        assert 0.45 < (err / step).max().item() <= 0.5 * (1 + 1e-5)
        zeros = torch.zeros(130)
        q = quantize(zeros, compression, 64)
        assert torch.equal(q.scales, torch.zeros(3)) and torch.equal(dequantize(q), zeros)


def test_byte_counts_by_formula():
    assert payload_bytes(1000, "none", 64) == 4000
    assert payload_bytes(1000, "bf16", 64) == 2000
    assert payload_bytes(1000, "int8", 64) == 1000 + 4 * 16
    assert payload_bytes(1001, "int4", 64) == 501 + 4 * 16
    assert payload_bytes(0, "int4", 64) == 0
    # the acceptance ratios at the default block: int8 1.0625 / 4, int4 0.5625 / 4 of fp32
    assert payload_bytes(64 * 1000, "int8", 64) / payload_bytes(64 * 1000, "none", 64) == 0.265625
    assert payload_bytes(64 * 1000, "int4", 64) / payload_bytes(64 * 1000, "none", 64) == 0.140625


def test_int4_packs_two_values_per_byte():
    block = 4
    x = torch.tensor([7.0, -7.0, 0.0, 1.0, 3.0])  # absmax 7 then 3: scales 1 and 3/7
    q = quantize(x, "int4", block)
    assert q.payload.dtype == torch.uint8 and q.payload.numel() == 3
    assert torch.equal(q.scales, torch.tensor([1.0, 3.0 / 7]))
    # q + 8: [15, 1, 8, 9 | 15], even index in the low nibble, the odd last value padded with 8 (zero)
    assert q.payload.tolist() == [15 | (1 << 4), 8 | (9 << 4), 15 | (8 << 4)]
    assert torch.allclose(dequantize(q), x)
    int8 = quantize(x, "int8", block)
    assert int8.payload.dtype == torch.int8 and int8.payload.tolist() == [127, -127, 0, 18, 127]


def test_none_and_bf16_payloads_carry_no_scales():
    x = _sample(100)
    none, bf16 = quantize(x, "none", 64), quantize(x, "bf16", 64)
    assert none.scales is None and none.payload.dtype == torch.float32 and torch.equal(none.payload, x)
    assert none.payload.data_ptr() != x.data_ptr()  # a copy: the caller may change x
    assert bf16.scales is None and bf16.payload.dtype == torch.bfloat16
    assert isinstance(none, Quantized) and none.numel == 100 and none.block == 64


def test_bad_arguments_name_the_setting():
    with pytest.raises(ValueError, match="slowmo_compression must be one of none, bf16, int8, int4"):
        check_compression("fp8", 64)
    for block in (0, -1, 2.0, True, "64"):
        with pytest.raises(ValueError, match="slowmo_compression_block must be an int >= 1"):
            check_compression("int8", block)
    with pytest.raises(ValueError, match="slowmo_compression_block must be even"):
        quantize(torch.zeros(4), "int4", 3)
    with pytest.raises(ValueError, match="1-D float32"):
        quantize(torch.zeros(2, 2), "int8", 64)
    with pytest.raises(ValueError, match="1-D float32"):
        quantize(torch.zeros(4, dtype=torch.float64), "int8", 64)
    check_compression("int4", 2)
    check_compression("int8", 1)


def test_chunks_fall_on_blocks_and_cover_the_tensor():
    for numel, parts, block in ((1000, 4, 64), (5, 4, 64), (0, 2, 8), (4096, 4, 64), (130, 2, 64)):
        bounds = chunk_bounds(numel, parts, block)
        assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a == prev_b for (_, prev_b), (a, _) in itertools.pairwise(bounds))
        assert all(a % block == 0 or a == numel for a, _ in bounds)
        blocks = [-(-(b - a) // block) for a, b in bounds]
        assert max(blocks) - min(blocks) <= 1
    assert chunk_bounds(1000, 4, 64) == [(0, 256), (256, 512), (512, 768), (768, 1000)]


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_simulated_mean_is_close_to_the_true_mean(compression):
    """The simulation against the plain mean, within the bounds of one quantisation per rank plus the owner's."""
    for n in (2, 3, 4):
        for numel, block in ((1000, 64), (129, 8)):
            inputs = [_sample(numel, seed=10 * n + r) for r in range(n)]
            result = simulate_compressed_mean(inputs, compression, block)
            mean = torch.stack(inputs).mean(0)
            per_rank = torch.stack([_bound(x, compression, block) for x in inputs]).mean(0)
            tol = per_rank * (1 + 1e-5) + _bound(mean + per_rank, compression, block) + 1e-6 * mean.abs()
            assert ((result - mean).abs() <= tol).all(), (compression, n, numel)
            sent, owners = simulate_messages(inputs, compression, block)
            assert len(sent) == n and all(len(s) == n for s in sent) and len(owners) == n
            assert torch.equal(result, torch.cat([dequantize(q) for q in owners]))
    same = [_sample(256)] * 4  # equal inputs average to themselves, quantised once more at most
    assert torch.equal(simulate_compressed_mean(same, "none", 64), same[0])
