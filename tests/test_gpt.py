"""The byte-level GPT: shapes, parameter count, causality, autocast, initialisation and bad configs."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ddpkit.train.gpt import GPT, GPTConfig, gpt, parameter_count

TINY = GPTConfig(layers=2, width=32, heads=4, context=16)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and far slower with several on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_output_shape_and_dtype():
    model = gpt(TINY)
    x = torch.randint(0, 256, (3, 16))
    assert model(x).shape == (3, 16, 256)
    assert model(x[:, :5]).shape == (3, 5, 256)  # shorter than the context is fine
    assert model(x).dtype == torch.float32


def test_parameter_count_default_and_presets():
    default = gpt()
    assert sum(p.numel() for p in default.parameters()) == parameter_count(GPTConfig()) == 10_795_008
    assert default.token.weight is not None and default.config == GPTConfig(6, 384, 6, 128)
    # the 100M preset is only counted (building it takes 400 MB)
    assert parameter_count(GPTConfig.preset("100m")) == 100_214_784
    for config in (TINY, GPTConfig(layers=3, width=48, heads=3, context=7)):
        assert sum(p.numel() for p in gpt(config).parameters()) == parameter_count(config)


def test_output_layer_is_tied_to_the_token_embedding():
    model = gpt(TINY)
    names = [n for n, _ in model.named_parameters()]
    assert not any("head" in n or "lm" in n for n in names)
    x = torch.randint(0, 256, (2, 8))
    model(x).sum().backward()
    # the embedding receives gradient from both its input and output roles; zeroing the input role changes it
    grad_both = model.token.weight.grad.clone()
    assert grad_both.abs().sum() > 0
    unused_rows = torch.ones(256, dtype=torch.bool)
    unused_rows[x.unique()] = False
    assert grad_both[unused_rows].abs().sum() > 0  # rows never used as input still learn as outputs


def test_causality_future_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = gpt(TINY).eval()
    x = torch.randint(0, 256, (2, 16))
    base = model(x)
    for t in (0, 7, 14):
        changed = x.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 17) % 256
        out = model(changed)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
        assert (out[:, t + 1 :] - base[:, t + 1 :]).abs().max() > 1e-3  # the future does see the change


def test_learns_a_repeating_sequence():
    torch.manual_seed(0)
    model = gpt(TINY)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.arange(17).repeat(4, 1) * 3 % 256
    first = None
    for _ in range(60):
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 5.0 and loss.item() < 0.5  # starts near ln 256 = 5.55


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_runs_under_autocast(dtype):
    torch.manual_seed(0)
    model = gpt(TINY)
    x = torch.randint(0, 256, (2, 16))
    reference = model(x)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    assert out.shape == (2, 16, 256) and torch.isfinite(out).all()
    assert (out.float() - reference).abs().max() < 0.1
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_initialisation():
    torch.manual_seed(0)
    model = gpt(GPTConfig(layers=4, width=128, heads=4, context=16))
    assert abs(model.token.weight.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].attention.proj.weight.std().item() - 0.02 / 8**0.5) < 0.001
    assert model.blocks[0].attention.qkv.bias.abs().sum() == 0
    # a fresh model predicts close to uniform: loss near ln 256
    x, y = torch.randint(0, 256, (2, 4, 16))
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_bad_configs_and_inputs():
    with pytest.raises(ValueError, match="width 30 must be divisible by heads 4"):
        GPTConfig(width=30, heads=4)
    with pytest.raises(ValueError, match="layers must be an integer >= 1"):
        GPTConfig(layers=0)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)
    with pytest.raises(ValueError, match="unknown 'huge'"):
        GPTConfig.preset("huge")
    model = GPT(TINY)
    with pytest.raises(ValueError, match="exceeds the context 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        model(torch.zeros(17, dtype=torch.long))
