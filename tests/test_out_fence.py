"""`ddpkit.train.checkpoints.out_fence`: one writer of a fault-tolerant job's --out at a time, fenced by the
round. A writer replaced while it stalled must not write over its successor when it wakes: its late write is
refused and leaves every file as the successor wrote it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ddpkit.train.checkpoints import live_checkpoint
from ddpkit.train.checkpoints.out_fence import StaleWriter, fenced, written_round


def test_a_write_from_an_earlier_round_is_refused_and_writes_nothing(tmp_path):
    out = str(tmp_path)
    for round_, text in ((10, "ten"), (12, "twelve"), (12, "twelve again")):
        with fenced(out, round_, "metrics.json") as stage:
            _staged(stage, "metrics.json", text)
    with pytest.raises(StaleWriter, match="holds what round 12's writer wrote, and this rank writes for round 11"):
        with fenced(out, 11, "metrics.json") as stage:
            _staged(stage, "metrics.json", "the deposed writer's")
    assert (tmp_path / "metrics.json").read_text() == "twelve again" and written_round(out) == 12


def _staged(stage: str, name: str, text: str) -> None:
    with open(f"{stage}/{name}", "w") as f:
        f.write(text)


def test_a_writer_stopped_mid_write_costs_its_successor_nothing(tmp_path):
    """Writer A (round 5) stops in the middle of its write; its successor B (round 6) writes at once, past it. When A
    wakes its write is refused, and everything is as B wrote it."""
    out, stopped, woken, outcome = str(tmp_path), threading.Event(), threading.Event(), []

    def stalled_writer() -> None:
        try:
            with fenced(out, 5, "metrics.json") as stage:
                _staged(stage, "metrics.json", "A's")
                stopped.set()
                woken.wait(10)
        except StaleWriter as exc:
            outcome.append(exc)

    thread = threading.Thread(target=stalled_writer)
    thread.start()
    assert stopped.wait(10)
    began = time.monotonic()
    with fenced(out, 6, "metrics.json") as stage:
        _staged(stage, "metrics.json", "B's")
    assert time.monotonic() - began < 2.0, "the successor waited for the stopped writer"
    woken.set()
    thread.join(10)
    assert len(outcome) == 1 and "writes for round 5" in str(outcome[0])
    assert (tmp_path / "metrics.json").read_text() == "B's" and written_round(out) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ddpkit-round", "metrics.json"]  # no staging left


def test_the_recorded_round_never_moves_backwards(tmp_path):
    """A writer whose round was overtaken while it wrote (a successor published in between) is refused at its publish
    and the record keeps the successor's round."""
    out = str(tmp_path)
    with pytest.raises(StaleWriter):
        with fenced(out, 15, "x") as stage:
            _staged(stage, "x", "late")
            with fenced(out, 20, "x") as newer:
                _staged(newer, "x", "newer")
    assert written_round(out) == 20 and (tmp_path / "x").read_text() == "newer"
    with fenced(out, 20, "x") as stage:  # the same round again writes (a member's outputs after its checkpoint)
        _staged(stage, "x", "again")
    assert written_round(out) == 20 and (tmp_path / "x").read_text() == "again"


def test_a_deposed_checkpoint_writer_leaves_the_successors_checkpoints_alone(tmp_path):
    """Rank A saved at round 20 then stalled; rank B, the writer since, saved round 30. A wakes and saves what it
    held for round 25: refused (at its next save or wait), and the newest checkpoint is still B's."""
    settings = {"world_size": 2, "strategy": "ddp"}
    successor = live_checkpoint.LiveCheckpoints(str(tmp_path), 10, 5, settings)
    deposed = live_checkpoint.LiveCheckpoints(str(tmp_path), 10, 5, settings)
    deposed.save({"w": torch.zeros(2)}, 20, 0, 0, 20)
    deposed.wait()
    successor.save({"w": torch.ones(2)}, 30, 0, 0, 30)
    successor.wait()
    deposed.save({"w": torch.full((2,), 7.0)}, 25, 0, 0, 25)
    with pytest.raises(StaleWriter, match="the checkpoint of step 25 was not written"):
        deposed.wait()
    steps = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert steps == ["step-00000020", "step-00000030"], steps
    assert torch.equal(torch.load(tmp_path / "checkpoint" / "step-00000030" / "live.pt")["w"], torch.ones(2))
