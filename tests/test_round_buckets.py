"""A fault-tolerant round's gradient buckets (`RoundBuckets`), in one process, against a stand-in for the round's
group whose all-reduce adds a known "other member's" gradient: each bucket must be sent once per backward, in the
same order on every backward, and every gradient end as the mean of the two members' gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.fault_tolerance.round_buckets import RoundBuckets


class _Done:
    def wait(self) -> bool:
        return True


class OtherMemberOnes:
    """A group of two members whose other member's gradients are all ones: all-reduce adds one to each element."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def allreduce(self, tensors: list[torch.Tensor]) -> _Done:
        self.sizes.append(tensors[0].numel())
        tensors[0].add_(1.0)
        return _Done()


class FellBehind(Exception):
    pass


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _backward(model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(torch.ones(2, 8)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_every_bucket_is_averaged_once_per_backward_even_after_a_backward_abandoned_half_way():
    model, group = _model(), OtherMemberOnes()
    state = {"calls": 0}

    def group_of():  # the first call stands for a rank that learns it fell behind as its backward runs
        state["calls"] += 1
        if state["calls"] == 1:
            raise FellBehind
        return group

    buckets = RoundBuckets(model.parameters(), 16 * 4 * 8, group_of, lambda: 2, lambda: None)
    assert len(buckets.buckets) >= 3
    with pytest.raises(FellBehind):
        _backward(model)
    buckets.reset()  # (what `Manager.rejoin` does)
    local = _backward(model)
    assert buckets.finish()
    assert len(group.sizes) == len(buckets.buckets)  # each bucket once
    assert sum(group.sizes) == sum(p.numel() for p in model.parameters())
    for p, g in zip(model.parameters(), local, strict=True):
        torch.testing.assert_close(p.grad, (g + 1.0) / 2)
    # the next backward: the same messages again, in the same order
    sizes = list(group.sizes)
    local = _backward(model)
    assert buckets.finish()
    assert group.sizes == sizes + sizes
    for p, g in zip(model.parameters(), local, strict=True):
        torch.testing.assert_close(p.grad, (g + 1.0) / 2)
