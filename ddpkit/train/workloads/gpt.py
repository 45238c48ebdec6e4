"""A small decoder-only transformer (GPT) over bytes: the language-model workload of `ddpkit train --model gpt`.

Sizes (vocabulary 256, tied input/output embedding, biases everywhere, learned positions):

- ``GPTConfig()``: 6 layers, width 384, 6 heads, context 128: 10,795,008 parameters (the CPU default).
- ``GPTConfig.preset("100m")``: 14 layers, width 768, 12 heads, context 1024: 100,214,784 parameters, for
  GPUs (``--gpt-layers 14 --gpt-width 768 --gpt-heads 12 --gpt-context 1024``).

Each block holds ``12 * width**2 + 13 * width`` parameters (attention ``4 w^2 + 4 w``, MLP ``8 w^2 + 5 w``,
two LayerNorms ``4 w``); the embeddings add ``(256 + context) * width`` and the final LayerNorm ``2 * width``;
`parameter_count` computes it without building the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 256


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a `GPT`: `layers` blocks of width `width` with `heads` heads over `context` tokens."""

    layers: int = 6
    width: int = 384
    heads: int = 6
    context: int = 128
    vocab: int = VOCAB
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("layers", "width", "heads", "context", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be an integer >= 1; got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"GPTConfig: width {self.width} must be divisible by heads {self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1); got {self.dropout!r}")

    @staticmethod
    def preset(name: str) -> GPTConfig:
        """``"10m"`` (the default, 10.8M parameters) or ``"100m"`` (100.2M, for a GPU)."""
        presets = {"10m": GPTConfig(), "100m": GPTConfig(layers=14, width=768, heads=12, context=1024)}
        if name not in presets:
            raise ValueError(f"GPTConfig.preset: unknown {name!r}; choose from {', '.join(presets)}")
        return presets[name]


def parameter_count(config: GPTConfig) -> int:
    """The number of parameters `gpt(config)` has (the output layer shares the token embedding)."""
    w = config.width
    block = 12 * w * w + 13 * w
    return config.layers * block + (config.vocab + config.context) * w + 2 * w


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # [B, T, W] -> [B, heads, T, W / heads]
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(norm(x)), then x + MLP(norm(x)) with a 4x GELU MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width), nn.GELU(), nn.Linear(4 * config.width, config.width)
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """Decoder-only transformer: token and position embeddings, `layers` pre-norm blocks, a final LayerNorm and
    logits through the transposed token embedding (weight tying).

    ``forward(x)`` takes token ids ``[B, T]`` (T <= context) and returns logits ``[B, T, vocab]``; the logits at
    position t depend on ``x[:, :t + 1]`` only. Works on any device and under ``torch.autocast``. Weights start
    from N(0, 0.02), biases at zero, and each residual projection is scaled by 1/sqrt(2 * layers) so the
    residual stream's variance does not grow with depth.

    Memory: 4 bytes per parameter (see `parameter_count`); activations grow with B * T * width * layers plus
    B * heads * T * T inside attention when the fused kernels are not available.

    Example::

        model = gpt(GPTConfig(layers=2, width=64, heads=2, context=32))
        logits = model(torch.randint(0, 256, (4, 32)))     # [4, 32, 256]
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token = nn.Embedding(config.vocab, config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attention.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp[2].weight, mean=0.0, std=residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"GPT: input must be token ids of shape [batch, time]; got shape {tuple(x.shape)}")
        time = x.shape[1]
        if time > self.config.context:
            raise ValueError(f"GPT: sequence length {time} exceeds the context {self.config.context}")
        positions = torch.arange(time, device=x.device)
        h = self.drop(self.token(x) + self.position(positions))
        for block in self.blocks:
            h = block(h)
        return F.linear(self.norm(h), self.token.weight)


def gpt(config: GPTConfig | None = None) -> GPT:
    """A `GPT` of shape `config` (default: `GPTConfig()`, 10.8M parameters)."""
    return GPT(config if config is not None else GPTConfig())
