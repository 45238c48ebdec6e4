"""Replicas of several processes under one quorum (`ddpkit.fault_tolerance.replica_membership`: HSDP).

Deterministic and in one process: two replicas of two processes (lanes) each, every process a thread with its own
`Manager`, each replica's lanes tied by a gloo control group of their own, all meeting in one HashStore. Lane k of
every replica holds a state of its own (a shard: here a vector ``x_k``) and averages a gradient of its own with
lane k of the other members. The reference is written apart from the code under test: ``x_k`` stepped by plain
SGD on the mean over each committed round's members of the gradient formula below, the rounds' members and
verdicts read from the lanes' logs; every lane of a replica must log the same rounds.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpkit.fault_tolerance.manager import Manager
from ddpkit.fault_tolerance.replica_membership import Replica

LR, STEPS, LANES = 0.1, 60, 2
START = 3.0  # seconds round 0 waits for every process (the threads start at once)


def grad(step: int, replica: int, lane: int) -> torch.Tensor:
    """What replica `replica`'s lane `lane` computes at `step` (a different vector for every one of them)."""
    return torch.tensor([step + 1.0, 10.0 * replica - lane, (-1.0) ** step * (lane + 1)])


def initial(replica: int, lane: int) -> torch.Tensor:
    return torch.full((3,), 100.0 * replica + lane)


class Vanished(Exception):
    pass


def _lane(
    store: Any, replica: int, lane: int, launch: int, out: dict, fail_round: int = -1, vanish_round: int = -1
) -> None:
    """Replica `replica`'s lane `lane` (its `launch`-th start): the loop of a user's own code under the manager."""
    control_store = dist.PrefixStore(f"test/replica{replica}/launch{launch}", store)
    control = dist.ProcessGroupGloo(control_store, lane, LANES, timedelta(seconds=30))
    manager = Manager(
        store, replica, 2, quorum_timeout=1.0, start_timeout=START, report=None, replica=Replica(lane, LANES, control)
    )
    x, step, log = initial(replica, lane), [0], []
    manager.register_state("x", lambda: x.clone(), x.copy_)
    manager.register_state("step", lambda: step[0], lambda s: step.__setitem__(0, s))
    out[(replica, lane, launch)] = {"manager": manager, "x": x, "log": log}
    try:
        while step[0] < STEPS:
            quorum = manager.start_round()
            assert quorum is not None
            if quorum.round == vanish_round:
                raise Vanished
            g = grad(step[0], replica, lane)
            manager.average_tensors([g])
            if quorum.round == fail_round:
                manager.fail()
            committed = manager.should_commit()
            if committed:
                x.sub_(LR * g)
            log.append((quorum.round, list(quorum.members), committed))
            step[0] += 1
            time.sleep(0.05 if replica == 0 else 0.0)  # the survivor leaves the restarted replica time to join
        out[(replica, lane, launch)]["end"] = "done"
    except Vanished:
        out[(replica, lane, launch)]["end"] = "vanished"
        manager.close()
    except Exception as exc:
        out[(replica, lane, launch)]["end"] = exc


def _start(store: Any, replica: int, launch: int, out: dict, faults: dict | None = None) -> list[threading.Thread]:
    """Replica `replica`'s lanes as threads; `faults`: lane -> `_lane`'s fault arguments."""
    faults = faults or {}
    threads = [
        threading.Thread(
            target=_lane, args=(store, replica, lane, launch, out), kwargs=faults.get(lane, {}), daemon=True
        )
        for lane in range(LANES)
    ]
    for thread in threads:
        thread.start()
    return threads


def _reference(lane: int, logs: list[list[tuple[int, list[int], bool]]]) -> torch.Tensor:
    rounds: dict[int, tuple[list[int], bool]] = {}
    for log in logs:
        for round_, members, committed in log:
            assert rounds.setdefault(round_, (members, committed)) == (members, committed), (round_, logs)
    x = initial(0, lane)  # round 0 gives every member the first member's state
    for round_ in sorted(rounds):
        members, committed = rounds[round_]
        if committed:  # round r is step r - 1 (round 0 is the start)
            x = x - LR * torch.stack([grad(round_ - 1, r, lane) for r in members]).mean(0)
    return x


def test_a_replicas_lanes_commit_together_and_a_restarted_replica_heals_every_lane_at_the_same_round():
    """Replica 1's lane 1 fails its average in round 5: the round is dropped on every lane of every replica.
    Replica 1 vanishes in round 12 (both lanes), starts again once the job reached round 18, and both its lanes
    join at one round, each receiving its own lane's state (lane 0's would be a different vector)."""
    store = dist.HashStore()
    out: dict = {}
    faults = {0: {"vanish_round": 12}, 1: {"fail_round": 5, "vanish_round": 12}}
    threads = _start(store, 0, 1, out) + _start(store, 1, 1, out, faults)
    deadline = time.monotonic() + 60
    while not store.check(["ddpkit/ft/latest"]) or int(store.get("ddpkit/ft/latest")) < 18:
        assert time.monotonic() < deadline, "the job did not reach round 18"
        time.sleep(0.01)
    threads += _start(store, 1, 2, out)
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a lane hung"
    for key in [(0, 0, 1), (0, 1, 1), (1, 0, 2), (1, 1, 2)]:
        assert out[key]["end"] == "done", (key, out[key]["end"])
    assert out[(1, 0, 1)]["end"] == "vanished"
    for lane in range(LANES):
        survivor, back = out[(0, lane, 1)], out[(1, lane, 2)]
        assert (5, [0, 1], False) in survivor["log"], survivor["log"][:8]
        reference = _reference(lane, [survivor["log"], back["log"], out[(1, lane, 1)]["log"]])
        torch.testing.assert_close(survivor["x"], reference)
        assert torch.equal(survivor["x"], back["x"])  # bit for bit
        assert back["manager"].rejoined == 1
    assert out[(1, 0, 2)]["log"][0][0] == out[(1, 1, 2)]["log"][0][0]  # both lanes joined at one round
    for value in out.values():
        value["manager"].close()


def test_a_lane_must_be_in_range():
    control = object()
    with pytest.raises(ValueError, match="lane must be in"):
        Replica(2, 2, control)
