"""The fault-tolerant rounds under random schedules of faults (hypothesis), in one process.

Each example is a job of 3-5 ranks as threads running the documented own loop (`tests/test_manager.py`'s
harness) on one in-memory store, with a random schedule drawn by hypothesis: ranks that vanish in the middle of a
round (a killed process), stall for longer than the round's timeout (a paused one), fail a round, start late,
and possibly the loss of the store itself or its restart, empty, at the same place (`ddpkit store` started again:
only a `Manager` that reconnects can meet it, which is why this fault is drawn here and not on simulated time).
Whatever the schedule, the invariants of the protocol must hold:

- every rank that logged a round logged the same members and the same verdict for it (no split);
- every rank that finished holds the model of the reference (rank 0's initial model stepped by torch's SGD on
  the mean gradient of each committed round's members; a failed round changes nothing), bit-identical to the
  other finishers;
- a stalled rank comes back and finishes like the others;
- once the store is lost, no rank finishes: each stops with `StoreLost` (nobody decides alone to go on);
- once it restarted, no rank finishes either, and none decides a round in the empty store (each reconnects, finds
  another incarnation there and stops with `StoreLost`);
- the whole job ends within a bound set by the schedule (no wait past its timeout).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import test_manager as harness
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from ddpkit.fault_tolerance.manager import StoreLost
from ddpkit.fault_tolerance.membership import DEFAULT_PREFIX, latest_round, round_key

pytestmark = pytest.mark.slow

STEPS = 16


class LossyStore(dist.Store):
    """An in-memory store (torch's HashStore behind it) that can be lost or restarted: after `lose()` every call
    raises the error a broken connection raises (as the job's TCPStore does when its machine goes); after
    `restart()` every connection made before fails so, and a new one (`clone`) reaches a new, empty store at the
    same place (as `ddpkit store` started again on machine 0)."""

    def __init__(self, inner: dist.HashStore | None = None, shared: dict | None = None) -> None:
        super().__init__()
        self.inner = inner if inner is not None else dist.HashStore()
        # (every connection's view of the store: lost, or which start of it is the live one)
        self.shared = shared if shared is not None else {"lost": False, "inner": self.inner, "starts": 1}
        self.start = self.shared["starts"]  # the store's start this connection reached
        self.broken = False  # this connection alone broke (the store lives)

    @property
    def lost(self) -> bool:
        return self.shared["lost"]

    def lose(self) -> None:
        self.shared["lost"] = True

    def restart(self) -> dist.HashStore:
        """The store's process starts again, empty, at the same place; returns the new store."""
        self.shared["inner"], self.shared["starts"] = dist.HashStore(), self.shared["starts"] + 1
        return self.shared["inner"]

    def break_connection(self) -> None:
        """This connection's next call fails as one the store closed; a `clone` connects anew."""
        self.broken = True

    def _live(self) -> dist.HashStore:
        if self.lost or self.broken or self.start != self.shared["starts"]:
            raise dist.DistNetworkError("Connection reset by peer (the store's machine is gone)")
        return self.inner

    def set(self, key: str, value: Any) -> None:
        self._live().set(key, value)

    def get(self, key: str) -> bytes:
        return self._live().get(key)

    def add(self, key: str, value: int) -> int:
        return self._live().add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._live().compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._live().check(keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        if timeout is None:
            self._live().wait(keys)
        else:
            self._live().wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._live().delete_key(key)

    def append(self, key: str, value: Any) -> None:
        self._live().append(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._live().multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._live().multi_set(keys, values)

    def num_keys(self) -> int:
        return self._live().num_keys()

    def clone(self) -> LossyStore:
        if self.lost:
            raise dist.DistNetworkError("Connection refused (the store's machine is gone)")
        return LossyStore(self.shared["inner"], self.shared)  # a new connection to the store at its place


FAULTS = st.sampled_from(["vanish", "pause", "fail", "late", "none"])


@st.composite
def schedules(draw: Any) -> dict[str, Any]:
    """A job's size and a fault (or none) for each rank but rank 0, each at a round of its own, and maybe the
    store's loss or its restart (empty, at the same place) once the job reached a round."""
    world = draw(st.integers(3, 5))
    faults = {}
    for rank in range(1, world):
        kind = draw(FAULTS)
        if kind != "none":
            faults[rank] = (kind, draw(st.integers(3, STEPS - 6)))
    store = draw(st.one_of(st.none(), st.tuples(st.sampled_from(["lost", "restarted"]), st.integers(4, STEPS - 4))))
    return {"world": world, "faults": faults, "store": store}


def _run(schedule: dict[str, Any]) -> tuple[dict, dict, float, dist.HashStore | None]:
    """The schedule's job: the ranks' ends, their managers, its seconds, and the empty store of its restart
    (None: none)."""
    world, store = schedule["world"], LossyStore()
    faults_by_rank: dict[str, dict] = {}
    late = {}
    for rank, (kind, round_) in schedule["faults"].items():
        if kind == "vanish":
            faults_by_rank[f"rank{rank}"] = {"vanish_round": round_}
        elif kind == "pause":
            faults_by_rank[f"rank{rank}"] = {"pause_round": (round_, 3.0)}  # twice the round's timeout
        elif kind == "fail":
            faults_by_rank[f"rank{rank}"] = {"fail_round": round_}
        elif schedule["store"] is None or schedule["store"][0] != "restarted":
            late[rank] = round_  # (started after a restart, it would start a job of its own on the empty store)
    for rank, after in sorted(late.items())[:1]:  # the job must not end before a late rank (a loaded machine) joins
        faults_by_rank.setdefault("rank0", {})["await_join"] = (after, rank)
    results: dict = {}
    struck: dict[str, dist.HashStore] = {}
    if schedule["store"] is not None:
        kind, at = schedule["store"]
        job = store.inner

        def strike() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if latest_round(job) >= at:
                    if kind == "restarted":
                        struck["restarted"] = store.restart()
                    else:
                        store.lose()
                    return
                time.sleep(0.005)

        threading.Thread(target=strike, daemon=True).start()
    since = time.monotonic()
    got, managers = harness._run(world, late=late, client=lambda: store, results=results, **faults_by_rank)
    return got, managers, time.monotonic() - since, struck.get("restarted")


# more, drawn afresh: a longer hunt by hand. The protocol's schedules are hunted on simulated time
# (tests/test_protocol_fake_clock.py, 150 in CI); these real-time ones check the Manager and gloo around it.
EXAMPLES = int(os.environ.get("DDPKIT_PROPERTY_EXAMPLES", "4"))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="DDPKIT_PROPERTY_EXAMPLES" not in os.environ,  # CI: the same schedules on every run
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example is a job of seconds
    suppress_health_check=list(HealthCheck),
)
@given(schedules())
@example({"world": 4, "faults": {1: ("pause", 6), 3: ("fail", 5)}, "store": ("restarted", 7)})  # (in every run)
def test_any_schedule_of_faults_keeps_the_rounds_agreed_and_the_finishers_equal_to_the_reference(schedule):
    print(schedule)  # (shown with -s, and with a failure)
    old_steps = harness.STEPS
    harness.STEPS = STEPS
    try:
        got, managers, seconds, restarted = _run(schedule)
    finally:
        harness.STEPS = old_steps
    faults, world = schedule["faults"], schedule["world"]
    ends = {rank: got[rank][0] for rank in range(world)}
    # bounded: a few rounds' timeouts per fault and a pause each, on a loaded machine
    assert seconds < 30 + 10 * len(faults), (seconds, schedule)
    for rank, (end, value) in got.items():
        if end == "error":
            assert isinstance(value, StoreLost), (rank, value, schedule)  # the only way a rank may fail here
    logs = [managers[rank].log for rank in managers]
    reference = harness._reference(logs)  # (asserts that every round was logged alike by every rank)
    done = [rank for rank in range(world) if ends[rank] == "done"]
    if schedule["store"] is not None and any(e == "error" for e in ends.values()):
        at = schedule["store"][1]
        assert not done or all(managers[r].log[-1][0] <= at + 1 for r in done), schedule
        if restarted is not None:  # nobody took the empty store for the job's: no round was decided there
            assert latest_round(restarted) == -1, schedule
            decided = [r for r in range(STEPS + 3) if restarted.check([round_key(DEFAULT_PREFIX, r, "members")])]
            assert not decided, (decided, schedule)
        return  # (the store went before the end: every rank still training stopped with StoreLost)
    expected_done = {r for r in range(world) if faults.get(r, ("none",))[0] != "vanish"}
    assert set(done) == expected_done, (ends, schedule)
    for rank in done:
        for got_param, want in zip(got[rank][1], reference, strict=True):
            torch.testing.assert_close(got_param, want, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(got[rank][1], got[done[0]][1], strict=True)), rank


def test_a_rank_whose_store_connection_broke_while_the_store_lives_takes_the_live_state_again():
    """A paused rank found its connection closed by the store when it woke (the store lived): it stopped with
    StoreLost. It connects anew: in a commit it reads the round's verdict there and goes on as a member, in any
    other call it takes the live state again; every rank ends equal to the reference, with the same verdicts."""
    store = LossyStore()

    def break_at_round_8() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if latest_round(store.inner) >= 8:
                connections[2].break_connection()
                return
            time.sleep(0.005)

    made: list[LossyStore] = []
    connections = {}

    def numbered() -> LossyStore:  # (the harness's first connection reads the job's progress, then ranks 0, 1, 2)
        made.append(store.clone())
        if len(made) > 1:
            connections[len(made) - 2] = made[-1]
        return made[-1]

    threading.Thread(target=break_at_round_8, daemon=True).start()
    old_steps = harness.STEPS
    harness.STEPS = STEPS
    try:
        got, managers = harness._run(3, client=numbered)
    finally:
        harness.STEPS = old_steps
    assert {rank: got[rank][0] for rank in range(3)} == {0: "done", 1: "done", 2: "done"}, got
    assert managers[2].log[-1][0] == STEPS, managers[2].log  # it went on to the end (as a member, or rejoined)
    reference = harness._reference([managers[r].log for r in range(3)])
    for rank in range(3):
        for a, b in zip(got[rank][1], reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got[0][1], got[2][1], strict=True))
