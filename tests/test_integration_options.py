"""The options every framework integration shares (`ddpkit.integrations.sharding`): OSS's and ShardedDataParallel's
own arguments passed through a strategy, refused with the key's name when they are not theirs."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from ddpkit.integrations.sharding import OSS_OPTIONS, SDP_OPTIONS, as_oss, check_oss_kwargs, take_sdp_kwargs
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed


def test_the_option_sets_are_the_constructors_own_arguments():
    assert {"min_split_numel", "split_params", "broadcast_fp16", "hierarchical"} <= OSS_OPTIONS
    assert not OSS_OPTIONS & {"params", "optim", "defaults", "lr"}
    assert {"reduce_buffer_size", "keep_bucketed_grads", "find_unused_parameters"} <= SDP_OPTIONS
    assert SDP_OPTIONS < set(inspect.signature(ShardedDataParallel.__init__).parameters)


def test_unknown_oss_kwargs_are_refused_with_the_key_and_sdp_kwargs_are_taken_out():
    assert check_oss_kwargs(None, "X") == {} and check_oss_kwargs({"min_split_numel": 1}, "X") == {"min_split_numel": 1}
    with pytest.raises(TypeError, match=r"DDPKitShardedStrategy: oss_kwargs takes OSS's own arguments .* got 'lr'"):
        check_oss_kwargs({"lr": 0.1}, "DDPKitShardedStrategy")
    strategy_kwargs = {"reduce_buffer_size": 16, "keep_bucketed_grads": False, "process_group_backend": "gloo"}
    assert take_sdp_kwargs(strategy_kwargs) == {"keep_bucketed_grads": False, "reduce_buffer_size": 16}
    assert strategy_kwargs == {"process_group_backend": "gloo"}  # left for Lightning's own DDP strategy


def _as_oss(rank: int, world_size: int) -> dict:
    model = nn.Linear(4, 2)
    plain = as_oss(torch.optim.Adam(model.parameters(), lr=0.01), min_split_numel=3)
    out = {"class": type(plain).__name__, "min_split_numel": plain.min_split_numel, "lr": plain.param_groups[0]["lr"]}
    already = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    out["same_object"] = as_oss(already) is already
    try:
        as_oss(already, min_split_numel=1)
        out["error"] = "accepted"
    except TypeError as exc:
        out["error"] = str(exc)
    return out


def test_as_oss_builds_with_the_options_and_refuses_them_for_an_oss():
    (out,) = run_distributed(_as_oss, 1)
    assert out == {**out, "class": "OSS", "min_split_numel": 3, "lr": 0.01, "same_object": True}
    assert "oss_kwargs (min_split_numel) cannot apply to an optimizer that is already an OSS" in out["error"]
