"""--resume with other SlowMo averaging settings: a changed compression, error feedback or
sync delay is said in the notes and handled (a sync in flight from a longer delay merges at the next step, a
residual saved without error feedback starts at zero); a change the saved state cannot drive is refused before
any process starts, naming the flag."""

from types import SimpleNamespace

import pytest
import torch

from ddpkit.algorithms.pseudo_gradient import OuterSync, OuterSyncSettings
from ddpkit.train.checkpoints import checkpoint_files as files

BASE = {
    "strategy": "slowmo",
    "world_size": 2,
    "optimizer": "sgd",
    "adascale": False,
    "amp": "off",
    "lr": 0.1,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "data": "digits",
}
EXACT = {"base": "localsgd", "compression": "none", "error_feedback": False, "fragments": 1, "sync_delay": 0}


def _notes(then: dict, now: dict) -> list[str]:
    manifest = {"step": 12, "epoch": 0, "world_size": 2, "strategy": "slowmo", "settings": {**BASE, "slowmo": then}}
    return files.resume_notes(manifest, {**BASE, "slowmo": now})


def test_changed_averaging_settings_are_noted_or_refused_by_flag():
    int8 = {**EXACT, "compression": "int8", "error_feedback": True, "sync_delay": 2}
    notes = _notes(int8, {**int8, "compression": "int4", "error_feedback": False, "sync_delay": 0})
    assert "slowmo compression int8 -> int4: the next syncs are sent as int4" in notes
    assert "slowmo error feedback on -> off: the residual is dropped" in notes
    assert any(n.startswith("slowmo sync delay 2 -> 0: a sync in flight at the checkpoint merges") for n in notes)
    assert _notes(int8, int8) == ["resuming from step 12 (epoch 0)"]
    assert "syncs in flight at the checkpoint are dropped" in _notes(int8, EXACT)[-1]
    with pytest.raises(ValueError, match="Resume with --slowmo-fragments 1"):
        _notes(int8, {**int8, "fragments": 2})
    with pytest.raises(ValueError, match="averaged nodes exactly; --slowmo-compression"):
        _notes(EXACT, int8)
    with pytest.raises(ValueError, match="Resume with --slowmo-base localsgd"):
        _notes(EXACT, {**EXACT, "base": "sgp"})
    # a checkpoint of an older version, without these settings, resumes as before
    assert _notes(None, int8) == ["resuming from step 12 (epoch 0)"]


def _sync(delay: int, error_feedback: bool = False, nodes: int = 1) -> OuterSync:
    settings = OuterSyncSettings(compression="int8", block=4, error_feedback=error_feedback, sync_delay=delay)
    groups = SimpleNamespace(num_nodes=nodes, master=None, nprocs_per_node=1)
    return OuterSync(torch.zeros(8), [8], settings, groups, None, (4, None))


def test_a_sync_in_flight_from_a_longer_delay_merges_at_the_next_step():
    saved = _sync(delay=2)
    flat = torch.arange(8, dtype=torch.float32)  # the node moved from the synchronised zeros to 0..7
    saved.step(flat, 4, lr=0.1)  # step 4 starts the sync (one node: its mean is its own pseudo-gradient)
    assert sorted(saved.in_flight) == [0] and saved.merging(5) == []
    resumed = _sync(delay=0)
    resumed.load(saved.state())
    moved = flat + 1.0  # one more local step after resuming
    assert resumed.busy(5)
    resumed.step(moved, 5, lr=0.1)
    # merged: synced = 0 - (0 - x_at_start) = x_at_start, and without a delay the parameters become it
    assert resumed.in_flight == {}
    assert torch.equal(resumed.synced, flat) and torch.equal(moved, flat)


def test_a_residual_saved_without_error_feedback_starts_at_zero():
    saved = _sync(delay=0, error_feedback=False, nodes=2)
    resumed = _sync(delay=0, error_feedback=True, nodes=2)
    assert saved.residual is None and resumed.residual is not None
    resumed.residual.fill_(3.0)
    resumed.load(saved.state())
    assert torch.equal(resumed.residual, torch.zeros(8))
    saved.load(resumed.state())  # and the other way: the saved residual is dropped
    assert saved.residual is None
