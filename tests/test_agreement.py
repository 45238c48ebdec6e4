"""Ranks that disagree (settings, parameter shapes, dtypes, order, hyper-parameters) fail at construction with an
error naming the first difference and the ranks, on every rank, after one 16-byte all-gather; never a hang, a
crash in a collective, or a shared-memory error. Param-group entries the optimizer does not take only warn."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from ddpkit.distributed import comm_stats
from ddpkit.distributed.agreement import (
    RanksDisagree,
    canonical,
    check_parameters_agree,
    check_same_across_ranks,
    describe_differences,
    parameter_settings,
)
from ddpkit.distributed.segment_files import SHM_DIR
from ddpkit.nn import ShardedDataParallel, SlowMoDistributedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed


def _error(fn, *args, **kwargs) -> str:
    """The RanksDisagree message `fn` raised, or '' when it returned (any other exception propagates)."""
    try:
        fn(*args, **kwargs)
    except RanksDisagree as exc:
        return str(exc)
    return ""


def _mlp(width: int, reverse: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(4, width), nn.Linear(width, 4)]
    return nn.Sequential(*(reversed(layers) if reverse else layers))


class _Named(nn.Module):
    """Two same-shaped layers registered in an order that depends on `swap`: shapes agree, names do not."""

    def __init__(self, swap: bool) -> None:
        super().__init__()
        for name in ("second", "first") if swap else ("first", "second"):
            setattr(self, name, nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _my_segments() -> set[str]:
    pid = str(os.getpid())
    return (
        {n for n in os.listdir(SHM_DIR) if n.startswith("ddpkit-") and f"-{pid}-" in n}
        if os.path.isdir(SHM_DIR)
        else set()
    )


SDP_OPTIONS = [  # (option, rank 0's value, rank 1's)
    ("reduce_buffer_size", 2**23, 2**10),
    ("find_unused_parameters", False, True),
    ("reduce_fp16", False, True),
    ("keep_bucketed_grads", True, False),
    ("cross_host_compression", "none", "int8"),
    ("broadcast_buffers", True, False),
    ("receives_ahead", None, 2),
]


def _two_ranks(rank: int, world_size: int) -> dict[str, str]:
    """Every disagreement at world size 2, one per construction; each message as rank `rank` saw it."""
    other = rank == 1
    seen: dict[str, str] = {}
    with comm_stats.measure() as agreeing:
        OSS(_mlp(8).parameters(), optim=torch.optim.SGD, lr=0.1)
    seen["agree_calls"] = repr((agreeing.calls(), agreeing.calls("all_gather"), agreeing.payload_bytes("all_gather")))
    with comm_stats.measure() as failing:
        seen["oss_lr"] = _error(OSS, _mlp(8).parameters(), optim=torch.optim.SGD, lr=0.2 if other else 0.1)
    seen["failing_kinds"] = repr(sorted({kind for kind, _ in failing.snapshot()}))
    seen["oss_width"] = _error(OSS, _mlp(16 if other else 8).parameters(), optim=torch.optim.Adam, lr=1e-3)
    seen["oss_order"] = _error(OSS, _mlp(8, reverse=other).parameters(), optim=torch.optim.Adam, lr=1e-3)
    seen["oss_dtype"] = _error(OSS, _mlp(8).to(torch.float64 if other else torch.float32).parameters(), lr=0.1)
    # sharding settings: ranks that cut parameters differently would assign different owners
    seen["oss_min_split"] = _error(OSS, _mlp(8).parameters(), optim=torch.optim.Adam, min_split_numel=1 + 7 * other)
    seen["oss_optim"] = _error(OSS, _mlp(8).parameters(), optim=torch.optim.Adam if other else torch.optim.AdamW)
    # the shapes agree, so OSS passes; ShardedDataParallel knows the names and sees another order
    module = _Named(swap=other)
    optimizer = OSS(module.parameters(), optim=torch.optim.SGD, lr=0.1)
    before = _my_segments()
    with comm_stats.measure() as sdp:
        seen["sdp_names"] = _error(ShardedDataParallel, module, optimizer)
    # the digests, then the settings as objects (sizes, bytes): no parameter broadcast, no shared-memory agreement
    seen["sdp_calls"] = repr((sdp.calls(), sdp.calls("all_gather"), sdp.calls("shared_memory")))
    seen["sdp_no_segment_left"] = repr(_my_segments() <= before)
    module = _mlp(16 if other else 8)  # OSS with its own (disagreeing) parameters is skipped: the wrapper checks
    seen["sdp_width"] = _error(ShardedDataParallel, module, OSS(_mlp(8).parameters(), lr=0.1))
    # ShardedDataParallel's own options shape the messages: ranks that differ are refused, naming them
    before = _my_segments()
    for option, mine, theirs in SDP_OPTIONS:
        model = _mlp(8)
        seen[f"sdp_{option}"] = _error(
            ShardedDataParallel, model, OSS(model.parameters(), lr=0.1), **{option: theirs if other else mine}
        )
    seen["sdp_options_no_segment_left"] = repr(_my_segments() <= before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one node: "nothing to average between nodes"
        for key, kwargs in (
            ("slowmo_frequency", {"slowmo_frequency": 6 if other else 4}),
            ("localsgd_frequency", {"localsgd_frequency": 2 if other else 3}),
            ("slowmo_lr", {"slowmo_lr": 0.5 if other else 1.0}),
        ):
            seen[f"slowmo_{key}"] = _error(SlowMoDistributedDataParallel, _mlp(8), 1, **kwargs)
        seen["slowmo_width"] = _error(SlowMoDistributedDataParallel, _mlp(12 if other else 8), 1)
    seen["settings"] = _error(check_same_across_ranks, {"--lr": 0.01, "--hidden": 64 + rank}, what="train")
    # a param-group key the optimizer does not take may differ (fairscale's tests pass `rank`): a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        per_rank = [{"params": list(_mlp(8).parameters()), "rank": rank, "lr": 0.1}]
        seen["oss_rank_key"] = _error(OSS, per_rank, optim=torch.optim.SGD)
    seen["oss_rank_key_warning"] = " | ".join(str(w.message) for w in caught)
    # fairscale's tests pass a per-rank argument to an optimizer class that takes it through **kwargs
    # (OSS(..., optim=SGDWithPausingCompute, lr=..., rank=rank)): it lands in every group; a warning, not a refusal
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen["oss_rank_kwarg"] = _error(OSS, _mlp(8).parameters(), optim=_SGDWithRank, lr=0.1, rank=rank)
    seen["oss_rank_kwarg_warning"] = " | ".join(str(w.message) for w in caught)
    seen["oss_rank_kwarg_lr"] = _error(
        OSS, _mlp(8).parameters(), optim=_SGDWithRank, lr=0.2 if other else 0.1, rank=rank
    )
    # ... but a hyper-parameter torch's SGD takes, set per group, must agree
    momentum = [{"params": list(_mlp(8).parameters()), "momentum": 0.9 if other else 0.0}]
    seen["oss_group_momentum"] = _error(OSS, momentum, optim=torch.optim.SGD, lr=0.1)
    with comm_stats.measure() as unchecked:  # the opt-out: no check, no collective
        OSS(_mlp(8).parameters(), optim=torch.optim.SGD, lr=0.2 if other else 0.1, check_agreement=False)
    seen["unchecked_calls"] = repr(unchecked.calls())
    return seen


class _SGDWithRank(torch.optim.SGD):
    """fairscale's test optimizer's shape: a per-rank argument taken from **kwargs, the rest passed on to SGD."""

    def __init__(self, *args, **kwargs):
        self.rank = kwargs.pop("rank")
        super().__init__(*args, **kwargs)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, str]]:
    return run_distributed(_two_ranks, 2)


def test_agreeing_ranks_exchange_one_sixteen_byte_all_gather(two_ranks):
    for seen in two_ranks:
        # OSS's construction: nothing but the check (1 call; two 8-byte digests per rank)
        assert seen["agree_calls"] == repr((1, 1, 16))
        assert seen["unchecked_calls"] == "0"  # check_agreement=False
        # a disagreement costs the digest all-gather and the settings' exchange (objects: more all-gathers)
        assert seen["failing_kinds"] == repr(["all_gather"])


def test_every_rank_names_the_first_difference_and_its_ranks(two_ranks):
    for rank, seen in enumerate(two_ranks):
        assert f"seen from rank {rank}" in seen["oss_lr"]
        assert "OSS: ranks disagree" in seen["oss_lr"]
        assert "param group 0 lr: 0.1 on rank 0; 0.2 on rank 1" in seen["oss_lr"]
        assert (
            "parameter 0: shape (8, 4), float32, trained on rank 0; shape (16, 4), float32, trained on rank 1"
            in (seen["oss_width"])
        )
        assert "parameter 0: shape (8, 4), float32, trained on rank 0; shape (4, 8), float32" in seen["oss_order"]
        assert "parameter 0: shape (8, 4), float32, trained on rank 0; shape (8, 4), float64" in seen["oss_dtype"]
        assert "min_split_numel: 1 on rank 0; 8 on rank 1" in seen["oss_min_split"]
        assert "optim: AdamW on rank 0; Adam on rank 1" in seen["oss_optim"]
        assert seen["sdp_names"].startswith("ShardedDataParallel: ranks disagree")
        assert "parameter 0: first.weight: shape (4, 4)" in seen["sdp_names"]
        assert "second.weight: shape (4, 4), float32, trained on rank 1" in seen["sdp_names"]
        assert "0.weight: shape (8, 4), float32, trained on rank 0; 0.weight: shape (16, 4)" in seen["sdp_width"]
        assert "slowmo_frequency: 4 on rank 0; 6 on rank 1" in seen["slowmo_slowmo_frequency"]
        assert "localsgd_frequency: 3 on rank 0; 2 on rank 1" in seen["slowmo_localsgd_frequency"]
        assert "slowmo_lr: 1.0 on rank 0; 0.5 on rank 1" in seen["slowmo_slowmo_lr"]
        assert seen["slowmo_slowmo_lr"].startswith("SlowMoDistributedDataParallel: ranks disagree")
        assert "parameter 0: 0.weight: shape (8, 4)" in seen["slowmo_width"]
        assert seen["settings"].endswith("--hidden: 64 on rank 0; 65 on rank 1")
        assert "--lr" not in seen["settings"]


def test_per_rank_entries_of_a_param_group_warn_and_known_hyperparameters_refuse(two_ranks):
    for rank, seen in enumerate(two_ranks):
        assert seen["oss_rank_key"] == ""  # accepted, as fairscale does
        assert "param group 0 rank: 0 on rank 0; 1 on rank 1" in seen["oss_rank_key_warning"]
        assert f"seen from rank {rank}" in seen["oss_rank_key_warning"]
        assert "check_agreement=False" in seen["oss_rank_key_warning"]
        assert "param group 0 momentum: 0.0 on rank 0; 0.9 on rank 1" in seen["oss_group_momentum"]
        assert seen["oss_rank_kwarg"] == "", seen["oss_rank_kwarg"]  # fairscale accepts it; so does ddpkit
        assert "param group 0 rank: 0 on rank 0; 1 on rank 1" in seen["oss_rank_kwarg_warning"]
        assert "param group 0 lr: 0.1 on rank 0; 0.2 on rank 1" in seen["oss_rank_kwarg_lr"]  # SGD's own: refused


def test_disagreement_is_not_reported_as_a_shared_memory_error(two_ranks):
    """ShardedDataParallel agrees on shared memory right after the check: the check must speak first."""
    for seen in two_ranks:
        for key in ("sdp_names", "sdp_width"):
            assert seen[key] and "shared-memory" not in seen[key] and "segment" not in seen[key]
        assert seen["sdp_no_segment_left"] == "True"
        assert seen["sdp_calls"] == repr((3, 3, 0))


def test_sharded_data_parallel_options_that_differ_are_refused_on_every_rank_naming_the_option(two_ranks):
    for rank, seen in enumerate(two_ranks):
        for option, mine, theirs in SDP_OPTIONS:
            message = seen[f"sdp_{option}"]
            assert message.startswith(f"ShardedDataParallel: ranks disagree (seen from rank {rank}): {option}: "), (
                option,
                message,
            )
            assert f"{mine} on rank 0; {theirs} on rank 1" in message, message
        assert seen["sdp_options_no_segment_left"] == "True"


def _four_ranks(rank: int, world_size: int) -> tuple[str, str]:
    one_differs = _error(check_parameters_agree, _mlp(8 if rank != 2 else 6), what="mine")
    many = {f"setting {i}": (i if rank != 3 else -i) for i in range(1, 6)}
    return one_differs, _error(check_same_across_ranks, many)


def test_four_ranks_one_differs():
    results = run_distributed(_four_ranks, 4)
    for rank, (one_differs, many) in enumerate(results):
        assert one_differs.startswith(f"mine: ranks disagree (seen from rank {rank}): parameter 0: 0.weight")
        assert "trained on ranks 0, 1, 3; 0.weight: shape (6, 4), float32, trained on rank 2" in one_differs
        assert many.count(" | ") == 2  # the first three differences are named, in order
        assert "setting 1: 1 on ranks 0, 1, 2; -1 on rank 3 | setting 2:" in many
        assert "setting 4" not in many


def test_fingerprints_are_stable_text_without_addresses():
    assert canonical({"b": (0.9, 0.999), "a": None}) == "{'a': None, 'b': (0.9, 0.999)}"
    assert canonical(torch.tensor([0.5])) == "tensor(1,) float32 [0.5]"
    # a function or class by its qualified name: the same code path on every rank, never an address
    assert (
        canonical(lambda: 0)
        == canonical(lambda: 1)
        == f"{__name__}.{test_fingerprints_are_stable_text_without_addresses.__qualname__}.<locals>.<lambda>"
    )
    assert canonical(torch.optim.SGD) == "torch.optim.sgd.SGD" and canonical(object()) == "object"
    assert canonical(torch.float16) == "torch.float16"
    groups = [{"params": list(_mlp(8).parameters()), "lr": 0.1, "betas": (0.9, 0.99)}]
    entries = dict(parameter_settings(groups))
    assert entries["number of parameters"] == "4" and entries["param group 0 size"] == "4"
    assert entries["param group 0 betas"] == "(0.9, 0.99)" and entries["param group 0 lr"] == "0.1"
    frozen = _mlp(8)
    frozen[1].bias.requires_grad_(False)
    assert dict(parameter_settings(frozen))["parameter 3"] == "1.bias: shape (4,), float32, frozen"
    assert describe_differences([{"a": "1", "b": "2"}, {"a": "1"}]) == ["b: 2 on rank 0; (none) on rank 1"]
    assert describe_differences([{"a": "1"}, {"a": "1"}]) == []


def test_one_process_needs_no_collective():
    with comm_stats.measure() as sent:
        check_same_across_ranks({"x": 1})
    assert sent.calls() == 0
