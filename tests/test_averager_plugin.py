"""A new way for nodes to average is one new file: an averager defined and registered here (nothing in ddpkit
knows it) runs inside SlowMoDistributedDataParallel, checked against a single-process simulation of its rule, and
its state travels through SlowMo's checkpoints. Plus the `averager` argument's errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.algorithms import AveragingContext, AveragingOptions, register_averager
from ddpkit.nn import SlowMoDistributedDataParallel
from ddpkit.testing import run_distributed

EVERY = 2  # the plug-in's period
SHRINK = 0.5  # it moves each node halfway to the mean: x <- x + SHRINK (mean - x)


@register_averager("halfway_every_2")
class HalfwayEvery2:
    """Every `EVERY` steps, each node moves halfway towards the nodes' mean; counts its syncs (its state)."""

    shards_slow_buffers = False

    def __init__(self, ctx: AveragingContext) -> None:
        self.ctx = ctx
        self.syncs = 0

    @classmethod
    def prepare(cls, options: AveragingOptions) -> tuple[dict[str, Any], Any]:
        return {"halfway_shrink": SHRINK}, None

    def due(self, step: int) -> bool:
        return step % EVERY == 0

    def step(self, flat: torch.Tensor, step: int, lr: float) -> None:
        mean = flat.clone()
        dist.all_reduce(mean, group=self.ctx.groups.world)
        mean.div_(self.ctx.options.world_size)
        flat.add_(mean - flat, alpha=SHRINK)
        self.syncs += 1

    def average_now(self, flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=self.ctx.groups.world)
        flat.div_(self.ctx.options.world_size)

    def state(self) -> dict[str, Any]:
        return {"halfway_syncs": self.syncs}

    def load(self, state: dict[str, Any]) -> None:
        self.syncs = int(state["halfway_syncs"])


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)


def _simulate(world: int, steps: int) -> list[list[torch.Tensor]]:
    """Each node trains its own replica with plain SGD; every EVERY steps each moves halfway to the mean."""
    replicas = [_module() for _ in range(world)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in replicas]
    for step in range(1, steps + 1):
        for rank, (m, opt) in enumerate(zip(replicas, optimizers, strict=True)):
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        if step % EVERY == 0:
            with torch.no_grad():
                for tensors in zip(*(m.parameters() for m in replicas), strict=True):
                    mean = torch.stack([t.detach() for t in tensors]).mean(0)
                    for t in tensors:
                        t.add_(mean - t, alpha=SHRINK)
    return [[p.detach().clone() for p in m.parameters()] for m in replicas]


def _train(rank: int, world: int, steps: int) -> dict[str, Any]:
    module = _module()
    model = SlowMoDistributedDataParallel(
        module, nprocs_per_node=1, slowmo_momentum=0.0, slowmo_lr=1.0, averager="halfway_every_2"
    )
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        model.perform_slowmo(opt)
    params = [p.detach().clone() for p in module.parameters()]
    saved = model.state_dict()
    twin = SlowMoDistributedDataParallel(_module(), nprocs_per_node=1, slowmo_momentum=0.0, averager=HalfwayEvery2)
    twin.load_state_dict(saved)
    model.average_parameters()
    return {
        "params": params,
        "syncs": model.averager.syncs,
        "restored_syncs": twin.averager.syncs,
        "restored_updates": twin.num_updates,
        "averaged": [p.detach().clone() for p in module.parameters()],
    }


def test_a_registered_averager_trains_as_its_rule_says():
    world, steps = 2, 5
    results = run_distributed(_train, world, steps, timeout=120.0, pg_timeout=30.0)
    expected = _simulate(world, steps)
    for rank, result in enumerate(results):
        for got, want in zip(result["params"], expected[rank], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert result["syncs"] == steps // EVERY == result["restored_syncs"]
        assert result["restored_updates"] == steps
    # the replicas differ before the final exact average and agree after it
    assert not torch.equal(results[0]["params"][0], results[1]["params"][0])
    for a, b in zip(results[0]["averaged"], results[1]["averaged"], strict=True):
        assert torch.equal(a, b)


def _errors(rank: int, world: int) -> dict[str, str]:
    out = {}
    cases = {
        "unknown": {"averager": "no_such_mode"},
        "not_registered": {"averager": dict},
        "contradicted": {"averager": "exact", "slowmo_compression": "int8"},
    }
    for name, kwargs in cases.items():
        try:
            SlowMoDistributedDataParallel(_module(), nprocs_per_node=1, **kwargs)
        except (ValueError, TypeError) as error:
            out[name] = str(error)
    return out


def test_the_averager_argument_is_checked_before_any_collective():
    errors = run_distributed(_errors, 2, timeout=60.0, pg_timeout=10.0)[0]
    assert "averager must be one of exact, gossip, halfway_every_2, pseudo_gradient" in errors["unknown"]
    assert "register_averager" in errors["not_registered"]
    assert "contradicts" in errors["contradicted"] and "'pseudo_gradient'" in errors["contradicted"]


def test_a_name_cannot_be_taken_twice():
    with pytest.raises(ValueError, match="taken by HalfwayEvery2"):
        register_averager("halfway_every_2")(type("Other", (), {}))
