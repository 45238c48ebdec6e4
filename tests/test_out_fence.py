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
        with fenced(out, round_, "metrics.json"):
            (tmp_path / "metrics.json").write_text(text)
    with pytest.raises(StaleWriter, match="holds what round 12's writer wrote, and this rank writes for round 11"):
        with fenced(out, 11, "metrics.json"):
            (tmp_path / "metrics.json").write_text("the deposed writer's")
    assert (tmp_path / "metrics.json").read_text() == "twelve again" and written_round(out) == 12


def test_writers_wait_for_each_other(tmp_path):
    """The successor's write begins only once the writer holding the fence is done (no interleaved files)."""
    order = []

    def slow_writer() -> None:
        with fenced(str(tmp_path), 5, "x"):
            order.append("first begins")
            time.sleep(0.3)
            order.append("first ends")

    thread = threading.Thread(target=slow_writer)
    thread.start()
    time.sleep(0.1)
    with fenced(str(tmp_path), 6, "x"):
        order.append("second")
    thread.join()
    assert order == ["first begins", "first ends", "second"]


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
