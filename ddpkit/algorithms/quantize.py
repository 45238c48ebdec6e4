"""Per-block absmax quantisation of flat fp32 tensors, in plain torch ops (CPU and CUDA alike).

A flat tensor of ``n`` values is cut into blocks of ``block`` consecutive values (the last one may be shorter).
Each block ``b`` gets one fp32 scale ``s_b = absmax_b / qmax`` (``absmax_b`` its largest magnitude) and each
value ``x`` in it becomes the integer ``q = round(x / s_b)`` in ``[-qmax, qmax]`` (round half to even; an
all-zero block has ``s_b = 0`` and every ``q = 0``). Dequantising gives ``q * s_b``.

=========== ====== ================================================= ==========================================
compression ``qmax`` payload                                         bytes for ``n`` values (``B`` blocks)
=========== ====== ================================================= ==========================================
``none``    -      the fp32 values (a copy)                          ``4 n``
``bf16``    -      the values rounded to bfloat16 (nearest even)     ``2 n``
``int8``    127    one int8 per value                                ``n + 4 B``
``int4``    7      two values per uint8: ``q + 8`` in the low nibble ``ceil(n / 2) + 4 B``
                   (even index) and the high nibble (odd index)
=========== ====== ================================================= ==========================================

Error bound (tested in tests/test_quantize.py), per element ``x`` of a block of absmax ``a``, for finite inputs:

- ``int8``/``int4``: ``|x - dequantize(quantize(x))| <= a / (2 qmax) + 2**-21 * a``: half a quantisation step,
  plus the fp32 rounding of the scale, the division and the product;
- ``bf16``: ``|x - dequantize(quantize(x))| <= 2**-8 |x|`` (round to nearest, 8 significant bits);
- ``none``: exact.

The scales stay fp32 (4 bytes per block, 1/16 of an int8 payload at the default block of 64): fp16 scales would
save 2 bytes per block but flush the scale of a block of tiny pseudo-gradients (absmax below 6e-8 x qmax) to
zero. Quantisation is deterministic: the same input on the same device type gives the same bits, so every rank
that quantises the same values sends the same message. ``int4`` needs an even ``block`` so that a message cut
at a block boundary never splits a byte (`check_compression`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COMPRESSIONS = ("none", "bf16", "int8", "int4")
"""The compressions `quantize` knows, from exact to smallest."""

_QMAX = {"int8": 127, "int4": 7}
_SCALE_BYTES = 4  # one fp32 scale per block


def check_compression(compression: str, block: int) -> None:
    """Raises a ValueError naming ``slowmo_compression`` or ``slowmo_compression_block`` if either is invalid."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"slowmo_compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"slowmo_compression_block must be an int >= 1 (values per scale), got {block!r}")
    if compression == "int4" and block % 2:
        raise ValueError(
            f"slowmo_compression_block must be even with slowmo_compression='int4' (two values per byte, so a "
            f"block boundary never splits a byte), got {block}"
        )


@dataclass
class Quantized:
    """A quantised flat tensor: `payload` (see the module table), fp32 `scales` per block (None for none/bf16)."""

    payload: torch.Tensor
    scales: torch.Tensor | None
    numel: int
    compression: str
    block: int

    def nbytes(self) -> int:
        """The bytes of payload and scales, what a message carrying this tensor holds."""
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.payload.numel() * self.payload.element_size() + scales


def num_blocks(numel: int, block: int) -> int:
    """The number of blocks (and of scales) of a tensor of `numel` values."""
    return -(-numel // block)


def payload_bytes(numel: int, compression: str, block: int) -> int:
    """The exact bytes (payload + scales) of `quantize` on `numel` values."""
    check_compression(compression, block)
    if compression == "none":
        return 4 * numel
    if compression == "bf16":
        return 2 * numel
    values = numel if compression == "int8" else -(-numel // 2)
    return values + _SCALE_BYTES * num_blocks(numel, block)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` as rows of `block` values, the last row padded with zeros (which change no absmax)."""
    pad = num_blocks(x.numel(), block) * block - x.numel()
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block)


def _quantize_blocks(x: torch.Tensor, qmax: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integers in [-qmax, qmax] (int8, padded to whole blocks) and the fp32 scale of each block."""
    rows = _blocks(x, block)
    scales = rows.abs().amax(dim=1) / qmax
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero block: 0 / 1 = 0
    q = torch.round(rows / divisor[:, None]).clamp_(-qmax, qmax)
    return q.to(torch.int8).view(-1), scales


def _pack_int4(q: torch.Tensor, numel: int) -> torch.Tensor:
    """Two values per byte: ``q + 8`` in [1, 15], even index low nibble, odd index high nibble."""
    u = (q[:numel].to(torch.int16) + 8).to(torch.uint8)
    if numel % 2:
        u = torch.cat([u, u.new_full((1,), 8)])  # the pad nibble decodes to 0 and is dropped
    return u[0::2] | (u[1::2] << 4)


def _unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    nibbles = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:numel]
    return nibbles.to(torch.int16) - 8


def quantize(x: torch.Tensor, compression: str, block: int) -> Quantized:
    """Quantises the 1-D fp32 tensor `x` (see the module doc); the result lives on `x`'s device."""
    check_compression(compression, block)
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"quantize: x must be a 1-D float32 tensor, got {x.dim()}-D {x.dtype}")
    n = x.numel()
    if compression == "none":
        return Quantized(x.clone(), None, n, compression, block)
    if compression == "bf16":
        return Quantized(x.to(torch.bfloat16), None, n, compression, block)
    q, scales = _quantize_blocks(x, _QMAX[compression], block)
    payload = q[:n].clone() if compression == "int8" else _pack_int4(q, n)
    return Quantized(payload, scales, n, compression, block)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 values `q` stands for (a new tensor)."""
    if q.compression in ("none", "bf16"):
        return q.payload.to(torch.float32, copy=True)
    assert q.scales is not None
    ints = q.payload if q.compression == "int8" else _unpack_int4(q.payload, q.numel)
    values = _blocks(ints.to(torch.float32), q.block) * q.scales[:, None]
    return values.view(-1)[: q.numel].clone()


def to_bytes(q: Quantized) -> torch.Tensor:
    """`q` as one uint8 message of `q.nbytes()` bytes: the scales' bytes first (so they stay 4-byte aligned for
    `from_bytes`' views), then the payload's."""
    payload = q.payload.contiguous().view(torch.uint8)
    if q.scales is None:
        return payload.clone()
    return torch.cat([q.scales.contiguous().view(torch.uint8), payload])


def from_bytes(message: torch.Tensor, numel: int, compression: str, block: int) -> Quantized:
    """The inverse of `to_bytes` for a tensor of `numel` values (views into `message`; a copy if misaligned)."""
    size = payload_bytes(numel, compression, block)
    if message.dtype != torch.uint8 or message.dim() != 1 or message.numel() != size:
        raise ValueError(f"from_bytes: expected {size} uint8 bytes, got {tuple(message.shape)} {message.dtype}")
    if message.storage_offset() % 4:  # a message cut out of a larger buffer: realign for the fp32/bf16 views
        message = message.clone()
    if compression in ("none", "bf16"):
        dtype = torch.float32 if compression == "none" else torch.bfloat16
        return Quantized(message.view(dtype), None, numel, compression, block)
    scale_bytes = _SCALE_BYTES * num_blocks(numel, block)
    scales = message[:scale_bytes].view(torch.float32)
    payload = message[scale_bytes:]
    return Quantized(payload.view(torch.int8) if compression == "int8" else payload, scales, numel, compression, block)


class BlockCodec:
    """`compression` with `block` as a wire codec (`ddpkit.distributed.hierarchical_reduce.WireCodec`): a flat
    fp32 tensor in, one uint8 message out (payload + scales, `to_bytes`), and back."""

    def __init__(self, compression: str, block: int = 64) -> None:
        check_compression(compression, block)
        self.compression, self.block = compression, block

    def nbytes(self, numel: int) -> int:
        """The message's size in bytes for `numel` values."""
        return payload_bytes(numel, self.compression, self.block)

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The message for `values` and the values it stands for (what the receiver will decode)."""
        quantized = quantize(values, self.compression, self.block)
        return to_bytes(quantized), dequantize(quantized)

    def decode(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values of a message of `numel` values."""
        return dequantize(from_bytes(message, numel, self.compression, self.block))
