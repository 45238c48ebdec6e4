"""Ranks that call different collectives are diagnosed by name: after the failure, each rank's
last collective (its number, kind, size, group and caller) and the state that differs between ranks (a parameter
frozen on one rank only, defect 6) are named, from `ddpkit.distributed.ledger.diagnose`."""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.distributed import comm, ledger
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed


def _extra_broadcast_on_rank_1(rank: int, world: int) -> tuple[str, list[str]]:
    comm.all_reduce(torch.ones(4))  # both ranks: collective #n
    try:
        if rank == 1:
            comm.broadcast(torch.zeros(16), 0)  # rank 1 only: an extra call
        comm.all_reduce(torch.ones(2))
        return "no error", []
    except RuntimeError as error:
        return str(error), ledger.diagnose(timeout=10.0)


def test_an_extra_collective_on_one_rank_is_named_with_its_caller():
    results = run_distributed(_extra_broadcast_on_rank_1, 2, timeout=120.0, pg_timeout=4.0, fresh=True)
    assert all(error != "no error" for error, _ in results), results
    for _, lines in results:
        text = "\n".join(lines)
        assert "rank 1: collective #" in text and "broadcast of 64 B on world" in text, text
        assert "from _extra_broadcast_on_rank_1 (" in text and "tests/test_ledger.py:" in text, text
        assert "rank 0: collective #" in text and "all_reduce of 8 B on world" in text, text
        assert "the ranks were not in the same collective" in text, text


def _freeze_on_rank_1(rank: int, world: int) -> tuple[str, list[str]]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = OSS(module.parameters(), optim=torch.optim.SGD, lr=0.1)
    model = ShardedDataParallel(module, opt, warn_on_trainable_params_changed=False)
    x = torch.randn(4, 6)
    model(x).sum().backward()
    opt.step()
    if rank == 1:
        module[0].weight.requires_grad_(False)  # on one rank only
    try:
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        return "no error", []
    except RuntimeError as error:
        return str(error), ledger.diagnose(timeout=10.0)


def test_a_parameter_frozen_on_one_rank_only_is_named():
    results = run_distributed(_freeze_on_rank_1, 2, timeout=120.0, pg_timeout=4.0, fresh=True)
    assert any(error != "no error" for error, _ in results), results
    for error, lines in results:
        if error == "no error":
            continue
        text = "\n".join(lines)
        assert (
            "ShardedDataParallel trainable parameters differ: rank 0: 4 of 4; rank 1: 3 of 4 (frozen: 0.weight)" in text
        ), text


def test_the_comparison_names_missing_ranks_and_only_differing_contexts():
    same = {"calls": 3, "kind": "all_reduce", "group": "world", "nbytes": 8, "caller": "f (x.py:1)", "contexts": {}}
    lines = ledger.compare(
        [{**same, "contexts": {"a": "1", "b": "x"}}, None, {**same, "contexts": {"a": "2", "b": "x"}}]
    )
    assert lines[1] == "rank 1: no report (it ended, or is stuck outside ddpkit's collectives)"
    assert lines[3] == "a differ: rank 0: 1; rank 2: 2" and not any(line.startswith("b differ") for line in lines)
    assert not any("not in the same collective" in line for line in lines)


class _StoreGoneAfterWrite:
    """A job's store that takes this rank's entry and then is gone (its host was killed meanwhile)."""

    def set(self, key, value):
        pass

    def wait(self, keys, timeout):
        raise RuntimeError("Connection closed by peer")


def test_a_rank_reports_its_own_collective_when_the_store_went_away(monkeypatch):
    """A rank named itself "no report" when the store's host died between its write and its read."""
    monkeypatch.setattr(ledger.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(ledger.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(ledger.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(ledger.dist.distributed_c10d, "_get_default_store", _StoreGoneAfterWrite)
    monkeypatch.setattr(ledger, "_entry", ledger.Entry())
    ledger.note("all_reduce", "world", 8)
    lines = ledger.diagnose(timeout=0.1)
    assert lines[0] == "rank 0: no report (it ended, or is stuck outside ddpkit's collectives)", lines
    assert lines[1].startswith("rank 1: collective #1, all_reduce of 8 B on world, from "), lines
