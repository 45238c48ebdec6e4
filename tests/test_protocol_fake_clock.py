"""The fault-tolerant protocol (`Membership`: quorums, joins, verdicts, the store's record) under random schedules
of faults, on simulated time (hypothesis; `tests/sim_time.py`).

Each example is a job of 3-6 ranks as threads on one simulated store, their clocks, waits and heartbeats all on
one simulated time, so timeouts of seconds cost nothing and the same schedule always runs the same way. Each rank
runs the protocol as `Manager` drives it: it adds its own progress to a value while it is in step, arrives at each
round, does the round's work over the round's group (the mean of the values of the members in step; a member that
joins takes it) and commits; a failed round changes nothing, and a joiner whose round failed joins again. The
schedule gives ranks faults at rounds of their own: vanish (a killed process, before or inside a round), pause
(stopped for 1-12 s, its heartbeat too: shorter and longer than the round's timeout; also right after its report
reaches the round's count, before it reads the verdict), fail (its work fails), late
(it starts while the job runs), stalled joiner (it starts late and is stopped for 1-12 s right after announcing
itself), partition (for 1-12 s its network reaches the store and no peer) or cut (its machine loses the store for
good); up to two further pauses, failures or partitions at later rounds of the same rank; and maybe the store's own
loss.

Invariants, whatever the schedule:

- every member that logged a round logged the same members and the same verdict (no split);
- after a committed round every member holds the same value, the definition's: the value of a one-process
  simulation of the decided rounds (members in step add their progress; a committed round replaces each member's
  value by the mean over the members that were in step, round 0 by the first member's; a failed round changes
  nothing);
- a rank cut off from the store never commits a round after the cut, and none trains on alone: it stops;
- a rank that paused comes back and finishes with the others; a rank that vanished does not hold the job up;
- no call waits past its bound: a quorum its timeout plus a connection's, a commit one timeout.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_time import SimGroup, SimReach, SimStore, VirtualTime

from ddpkit.fault_tolerance.liveness import INTERVAL, STALE_AFTER, Liveness, alive_key
from ddpkit.fault_tolerance.membership import (
    DEFAULT_PREFIX,
    FINAL,
    KEPT_ROUNDS,
    JobFinished,
    Membership,
    Quorum,
    TooFewReplicas,
    round_key,
)

ROUNDS = 14
STEP_SECONDS = 0.5  # a rank's local work between two rounds
TIMEOUT = 3.0  # quorum_timeout, simulated seconds
START_TIMEOUT = 10.0
MIN_REPLICAS = 1
STALLED_JOINER_STARTS = START_TIMEOUT + 3.0  # simulated seconds: a stalled joiner starts once the job is under way
JOIN_TIMEOUT = 60.0


class SimMembership(Membership):
    """`Membership` whose rounds' groups are `SimGroup`s (its `connect` seam) instead of gloo groups."""

    def __init__(self, hub: dict, time: VirtualTime, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, clock=time, **kwargs)
        self.hub, self.time = hub, time

    def connect(self, key: str, quorum: Quorum) -> SimGroup:
        assert quorum.index is not None
        return SimGroup(self.hub, key, quorum.index, len(quorum.members), self.time, self.timeout, quorum.members)


@dataclass
class Rank:
    """One rank's schedule and what it did: `log` holds (round, members, joined, verdict, value after) for each
    round it was a member of; `end` how it ended; `waits` the longest quorum and commit calls (simulated s)."""

    rank: int
    fault: tuple[str, int, str, float] | None  # (kind, round, where: WHERE, pause seconds)
    more: list[tuple[str, int, str, float]] = field(default_factory=list)  # later pauses, fails, partitions
    log: list[tuple[int, list[int], list[int], bool, float]] = field(default_factory=list)
    logged_at: list[float] = field(default_factory=list)  # when each entry of `log` was made
    end: str = "running"
    waits: dict[str, float] = field(default_factory=lambda: {"quorum": 0.0, "join": 0.0, "commit": 0.0})
    paused_until: float = 0.0
    stopped: bool = False
    cut_at: float | None = None  # when its machine lost the store
    woke_at: float | None = None  # a joiner stopped right after announcing itself: when it went on


WHERE = ["before", "inside", "commit"]  # a fault before a rank arrives at its round, before its work, before its commit


def progress(rank: int, round_: int) -> float:
    return float((rank + 1) * (round_ + 1))


def _beat(time: VirtualTime, store: SimStore, me: Rank) -> None:
    """The rank's heartbeat (as `liveness.Heartbeat`): a counter in the store every INTERVAL, paused with it."""
    beats = 0
    while not me.stopped:
        if time.now < me.paused_until:
            time.sleep(me.paused_until - time.now)
            continue
        beats += 1
        try:
            store.set(alive_key(DEFAULT_PREFIX, me.rank), str(beats))
        except dist.DistNetworkError:
            return
        time.sleep(INTERVAL)


def _fault_at(me: Rank, round_: int, where: str) -> tuple[str, int, str, float] | None:
    for fault in ([me.fault] if me.fault is not None else []) + me.more:
        if fault[1] == round_ and fault[2] == where:
            return fault
    return None


def _fault_here(me: Rank, round_: int, where: str) -> str | None:
    fault = _fault_at(me, round_, where)
    return None if fault is None else fault[0]


def _timed(time: VirtualTime, me: Rank, what: str, call: Any, *args: Any) -> Any:
    since = time.now
    try:
        return call(*args)
    finally:
        me.waits[what] = max(me.waits[what], time.now - since)


def _run_rank(time: VirtualTime, hub: dict, store: SimStore, me: Rank, world: int) -> None:
    try:
        _rounds(time, hub, store, me, world)
        me.end = "done"
    except Vanished:
        me.end = "vanished"
    except dist.DistNetworkError:
        me.end = "lost"  # the store is gone for it: it stops (the Manager raises StoreLost here)
    except JobFinished:
        me.end = "finished"  # it came back after the job's end: nothing to join
    except TooFewReplicas:
        me.end = "too few"
    finally:
        me.stopped = True


def _rounds(time: VirtualTime, hub: dict, store: SimStore, me: Rank, world: int) -> None:
    membership = SimMembership(
        hub, time, store, me.rank, world, MIN_REPLICAS, TIMEOUT, start_timeout=START_TIMEOUT, join_timeout=JOIN_TIMEOUT
    )
    membership.liveness = Liveness(DEFAULT_PREFIX, min(TIMEOUT, STALE_AFTER), clock=time)
    membership.reach = SimReach(hub, me.rank)  # (what the data plane reports after a failed round)
    time.start(_beat, time, store.clone(), me)
    round_, value, in_step = 0, 0.0, True
    forgetting = None  # the deletion of old rounds' keys in progress
    if me.fault is not None and me.fault[0] in ("late", "stalled joiner"):
        time.sleep(me.fault[3] if me.fault[0] == "late" else STALLED_JOINER_STARTS)
        membership.raise_if_finished()
        if membership.latest_round() >= 0:  # the job is under way: it joins (`Manager.start_round`)
            round_, in_step = membership.announce_join(), False
        if me.fault[0] == "stalled joiner":  # stopped (SIGSTOP) right after announcing itself, its heartbeat too
            me.paused_until = me.woke_at = time.now + me.fault[3]
            time.sleep(me.fault[3])
    while round_ <= ROUNDS:
        if _fault_here(me, round_, "before") == "vanish":
            raise Vanished
        _maybe_pause_or_cut(time, me, store, round_, "before", hub)
        if in_step:  # its local step
            time.sleep(STEP_SECONDS)
            value += progress(me.rank, round_)
        quorum = _timed(time, me, "quorum" if in_step else "join", membership.quorum, round_)
        round_ = quorum.next_round
        if not quorum.is_member:  # left out (late, stalled): it takes the live state again (`Manager.rejoin`)
            if in_step:
                round_, in_step = membership.announce_join(), False
            continue
        kind = _fault_here(me, quorum.round, "inside")
        if kind == "vanish":
            raise Vanished
        _maybe_pause_or_cut(time, me, store, quorum.round, "inside", hub)
        value, in_step = _work_and_commit(time, membership, quorum, me, value, in_step)
        if quorum.index == 0 and quorum.round > KEPT_ROUNDS and (forgetting is None or not forgetting.is_alive()):
            # on a thread of its own, as the Manager's cleaner: it interleaves with the rounds (one at a time)
            forgetting = time.start(_forget_quietly, membership, quorum.round - KEPT_ROUNDS)
    if me.log and me.log[-1][0] == ROUNDS:
        store.compare_set(DEFAULT_PREFIX + FINAL, "", "done")  # the job's last round: nobody joins it any more


class Vanished(Exception):
    """The rank's process is gone (killed)."""


def _forget_quietly(membership: SimMembership, round_: int) -> None:
    """`forget_through` as the Manager's cleaner runs it: a store that is gone is reported, not raised."""
    try:
        membership.forget_through(round_)
    except dist.DistNetworkError:
        pass


def _maybe_pause_or_cut(time: VirtualTime, me: Rank, store: SimStore, round_: int, where: str, hub: dict) -> None:
    fault = _fault_at(me, round_, where)
    kind = None if fault is None else fault[0]
    if kind == "pause":
        assert fault is not None
        me.paused_until = time.now + fault[3]
        time.sleep(fault[3])
    elif kind == "cut":
        me.cut_at = time.now
        store.cut()
    elif kind == "partition":  # its network reaches the store and no peer for a while; the rank goes on
        assert fault is not None
        with time.lock:
            hub.setdefault("cut", set()).add(me.rank)
        time.start(_heal_after, time, hub, me.rank, fault[3])


def _heal_after(time: VirtualTime, hub: dict, rank: int, seconds: float) -> None:
    time.sleep(seconds)
    with time.lock:
        hub["cut"].discard(rank)
        time.changed()


def _pause_after_report(time: VirtualTime, me: Rank, store: SimStore, round_: int) -> None:
    """A "pause after report" fault at this round: the rank stops right after its report reaches the round's count
    (between its report and its read of the verdict), its heartbeat too."""
    for fault in ([me.fault] if me.fault is not None else []) + me.more:
        if fault[0] == "pause after report" and fault[1] == round_:

            def pause(seconds: float = fault[3]) -> None:
                me.paused_until = time.now + seconds
                time.sleep(seconds)

            store.machine.setdefault("after_add", {})[round_key(DEFAULT_PREFIX, round_, "reported")] = pause


def _work_and_commit(
    time: VirtualTime, membership: SimMembership, quorum: Quorum, me: Rank, value: float, in_step: bool
) -> tuple[float, bool]:
    """The round's work and its commit, as `Manager` does them: round 0 gives every member the first member's value
    (`Manager.start`), a later round the mean of the values of the members in step."""
    joined = me.rank in quorum.joined
    result, ok = value, quorum.group is not None
    if ok:
        try:
            first = quorum.round == 0
            result = quorum.group.broadcast(value) if first else quorum.group.mean(None if joined else value)
        except RuntimeError:
            ok = False  # a member is gone: the round fails (`Manager._guarded`)
    if any(_fault_here(me, quorum.round, where) == "fail" for where in WHERE):
        ok = False
    if _fault_here(me, quorum.round, "commit") == "vanish":
        raise Vanished
    _maybe_pause_or_cut(time, me, membership.store, quorum.round, "commit", membership.hub)
    _pause_after_report(time, me, membership.store, quorum.round)
    committed = _timed(time, me, "commit", quorum.commit, ok)
    if getattr(quorum, "verdict_unknown", False):  # stopped past the round's end: it takes the live state again
        committed = None
        membership.announce_join()
        in_step = False
    elif committed:
        value, in_step = result, True
    elif joined:
        membership.announce_join()  # its state is not the others': it joins again (`Manager.should_commit`)
        in_step = False
    me.log.append((quorum.round, quorum.members, quorum.joined, committed, value))
    me.logged_at.append(time.now)
    return value, in_step


FAULTS = st.sampled_from(
    ["vanish", "pause", "pause after report", "fail", "late", "stalled joiner", "cut", "partition", "none", "none"]
)
LATER = st.sampled_from(["pause", "pause after report", "fail", "partition"])  # a rank's further faults, later on


@st.composite
def schedules(draw: Any) -> dict[str, Any]:
    """A job's size, a fault (or none) for each rank but rank 0, each at a round of its own, and maybe the
    store's loss at some round."""
    world = draw(st.integers(3, 6))
    faults, more = {}, {}
    for rank in range(1, world):
        kind = draw(FAULTS)
        if kind != "none":
            round_ = draw(st.integers(1, ROUNDS - 2))
            faults[rank] = (kind, round_, draw(st.sampled_from(WHERE)), _seconds(draw, kind))
            later = [draw(LATER) for _ in range(draw(st.integers(0, 2)))]  # several faults on one rank
            rounds = draw(st.lists(st.integers(1, ROUNDS - 2), min_size=len(later), max_size=len(later), unique=True))
            pairs = zip(later, rounds, strict=True)
            more[rank] = [(k, r, draw(st.sampled_from(WHERE)), _seconds(draw, k)) for k, r in pairs]
    lost_at = draw(st.one_of(st.none(), st.integers(2, ROUNDS - 2)))
    return {"world": world, "faults": faults, "more": more, "lost_at": lost_at}


def _seconds(draw: Any, kind: str) -> float:
    timed = ("pause", "pause after report", "late", "stalled joiner", "partition")
    return draw(st.floats(1.0, 12.0)) if kind in timed else 0.0


def run_job(schedule: dict[str, Any]) -> tuple[list[Rank], float, float | None]:
    """Runs the schedule; returns the ranks, the job's simulated duration and when the store was lost (if)."""
    time, hub = VirtualTime(), {}
    store = SimStore(time)
    ranks = [
        Rank(r, schedule["faults"].get(r), list(schedule.get("more", {}).get(r, []))) for r in range(schedule["world"])
    ]
    lost: dict[str, float] = {}
    with time.held():
        threads = [time.start(_run_rank, time, hub, store.on_another_machine(), me, schedule["world"]) for me in ranks]
        if schedule["lost_at"] is not None:
            threads.append(time.start(_lose_store_at, time, store, schedule["lost_at"], ranks, lost))
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a rank still runs after 60 real seconds"
    assert time.errors == [], time.errors
    return ranks, time.now, lost.get("at")


def _lose_store_at(time: VirtualTime, store: SimStore, round_: int, ranks: list[Rank], lost: dict) -> None:
    """The store's machine goes once round `round_` is decided (or when every rank ended)."""
    key = DEFAULT_PREFIX + "latest"

    def reached() -> bool:
        return all(me.stopped for me in ranks) or (key in store.data and int(store.data[key]) >= round_)

    time.wait_until(reached, float("inf"))
    if not all(me.stopped for me in ranks):
        store.shared["lost"] = True
        lost["at"] = time.now


def simulate(ranks: list[Rank]) -> dict[tuple[int, int], float]:
    """Each member's value after each round it logged, from the decided rounds alone (module doc)."""
    decided = {entry[0]: entry[1:4] for me in ranks for entry in me.log if entry[3] is not None}
    value: dict[int, float] = {me.rank: 0.0 for me in ranks}
    expected = {}
    for round_ in sorted(decided):
        members, joined, committed = decided[round_]
        counted = [m for m in members if m not in joined]
        for m in counted:
            value[m] += progress(m, round_)
        if committed:
            mean = sum(value[m] for m in counted) / len(counted) if round_ > 0 else value[members[0]]
            for m in members:
                value[m] = mean
        for m in members:
            expected[(m, round_)] = value[m]
    return expected


def check_invariants(schedule: dict[str, Any], ranks: list[Rank], seconds: float, lost_at: float | None) -> None:
    verdicts: dict[int, tuple] = {}
    for me in ranks:
        for round_, members, joined, committed, _ in me.log:
            if committed is None:
                continue  # (its verdict unknown to it: forgotten while it was stopped; it took the live state)
            assert verdicts.setdefault(round_, (members, joined, committed)) == (members, joined, committed), (
                f"round {round_} logged differently by rank {me.rank}: {verdicts[round_]} against "
                f"{(members, joined, committed)}"
            )
    expected = simulate(ranks)
    for me in ranks:
        for round_, _, _, committed, value in me.log:
            if committed is None:
                continue
            if committed or me.rank not in verdicts[round_][1]:
                assert value == pytest.approx(expected[(me.rank, round_)], rel=1e-12), (me.rank, round_, me.log)
    for round_, (_, _, committed) in verdicts.items():
        if committed:
            values = {v for me in ranks for r, _, _, c, v in me.log if r == round_ and c is not None}
            assert len(values) == 1, (round_, values)
    for me in ranks:
        cut_off = max((f[3] for f in ([me.fault] if me.fault else []) + me.more if f[0] == "partition"), default=0)
        # (a rank cut off from its peers waits to reach them before it asks to join: as long as the cut)
        assert me.waits["quorum"] <= START_TIMEOUT + TIMEOUT + 1.0 + cut_off, (me.rank, me.waits)
        assert me.waits["join"] <= 4 * TIMEOUT + 12.0 + 2.0 + cut_off, (me.rank, me.waits)
        stopped = max(
            (f[3] for f in ([me.fault] if me.fault else []) + me.more if f[0] == "pause after report"), default=0
        )
        assert me.waits["commit"] <= TIMEOUT + 1.0 + stopped, (me.rank, me.waits)  # (its stop is inside the commit)
        if me.cut_at is not None:
            assert me.end == "lost", (me.rank, me.end)
    for me in ranks:
        kind = me.fault[0] if me.fault is not None else "none"
        if lost_at is not None:
            assert me.end in ("lost", "done", "vanished", "finished"), (me.rank, me.end)
            continue
        if kind in ("vanish", "cut"):
            continue
        assert me.end in ("done", "finished"), (me.rank, me.end, schedule)
        if kind == "none" or me.rank == 0:
            assert me.end == "done", (me.rank, me.end, schedule)
    _no_commit_after_a_loss(ranks, lost_at)
    _no_run_of_failed_rounds(verdicts)
    assert seconds <= 400.0, seconds


def _no_run_of_failed_rounds(verdicts: dict[int, tuple]) -> None:
    """No more than 3 rounds in a row fail with the same members: a decision learns what failed (a rank cut off
    from its peers is left out after the first)."""
    run = 0
    for round_ in sorted(verdicts):
        members, _, committed = verdicts[round_]
        before = verdicts.get(round_ - 1)
        run = 0 if committed else run + 1 if before is not None and before[0] == members else 1
        assert run <= 3, (round_, members, verdicts)


def _no_commit_after_a_loss(ranks: list[Rank], lost_at: float | None) -> None:
    """A rank cut off from the store (its machine's cut, or the store's loss) logs no round after the cut: it never
    goes on alone; it stops."""
    for me in ranks:
        cut = min(t for t in (me.cut_at, lost_at) if t is not None) if me.cut_at or lost_at else None
        if cut is not None:
            assert all(at <= cut for at in me.logged_at), (me.rank, cut, me.logged_at)


EXAMPLES = int(os.environ.get("DDPKIT_PROPERTY_EXAMPLES", "150"))  # about 0.1 s each


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="DDPKIT_PROPERTY_EXAMPLES" not in os.environ,  # CI: the same schedules on every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(schedules())
def test_any_schedule_of_faults_on_simulated_time_keeps_every_invariant(schedule):
    ranks, seconds, lost_at = run_job(schedule)
    check_invariants(schedule, ranks, seconds, lost_at)


def test_a_paused_rank_past_the_timeout_is_left_out_and_comes_back():
    """One schedule spelled out: rank 2 of 3 stops inside round 4 for 8 s (more than twice the timeout)."""
    schedule = {"world": 3, "faults": {2: ("pause", 4, "inside", 8.0)}, "lost_at": None}
    ranks, seconds, lost_at = run_job(schedule)
    check_invariants(schedule, ranks, seconds, lost_at)
    rounds = {r: (members, committed) for r, members, _, committed, _ in ranks[0].log}
    assert rounds[4] == ([0, 1, 2], False)  # its round failed everywhere
    assert any(members == [0, 1] for members, _ in rounds.values())  # the others went on without it
    assert ranks[2].log[-1][0] == ROUNDS and ranks[2].log[-1][1] == [0, 1, 2]  # and it came back


def test_a_rank_cut_off_from_the_store_stops_and_the_others_train_on():
    schedule = {"world": 3, "faults": {1: ("cut", 5, "inside", 0.0)}, "lost_at": None}
    ranks, seconds, lost_at = run_job(schedule)
    check_invariants(schedule, ranks, seconds, lost_at)
    assert ranks[1].end == "lost" and ranks[0].end == ranks[2].end == "done"
    assert ranks[0].log[-1][1] == [0, 2]


def test_a_member_stalled_before_its_commit_is_not_committed_alone():
    """Rank 2 stops after the round's work, before its commit, for longer than the timeout: the others give up
    waiting and write the round failed; when rank 2 reports success later, the verdict written stands for it too
    (a member that waits in vain must write its verdict, not only take it)."""
    schedule = {"world": 3, "faults": {2: ("pause", 4, "commit", 8.0)}, "lost_at": None}
    ranks, seconds, lost_at = run_job(schedule)
    check_invariants(schedule, ranks, seconds, lost_at)
    assert [entry[3] for entry in ranks[2].log if entry[0] == 4] == [False]


def _keys_of_forgotten_rounds(store: SimStore) -> list[str]:
    """The keys of rounds long forgotten (more than twice `KEPT_ROUNDS` before the latest round with keys): none
    should be left."""
    through = max(int(m.group(1)) for k in store.data if (m := re.match(re.escape(DEFAULT_PREFIX) + r"r(\d+)/", k)))
    through -= 2 * KEPT_ROUNDS + 1  # (the first member forgets through its round - KEPT_ROUNDS as it commits)
    pattern = re.compile(re.escape(DEFAULT_PREFIX) + r"r(\d+)/")
    return sorted(k for k in store.data if (m := pattern.match(k)) and int(m.group(1)) <= through)


def test_a_joiner_stopped_after_announcing_itself_catches_up_at_once_and_holds_nobody_up(monkeypatch):
    """Rank 2 starts late, announces that it joins, and is stopped for 60 s (its heartbeat too) while the others
    train on past every round it was expected at, whose keys are deleted. When it goes on it reads the tombstone at
    once and joins from the latest round within 4 quorum timeouts; no member's round waits for it after it woke
    (it walked the deleted rounds one per second before, re-announcing itself at each, so the members waited a
    quorum timeout per round), and no key of a forgotten round is left in the store."""
    monkeypatch.setitem(globals(), "ROUNDS", 200)
    schedule = {"world": 3, "faults": {2: ("stalled joiner", 0, "before", 60.0)}, "lost_at": None}
    time, hub = VirtualTime(), {}
    store = SimStore(time)
    ranks = [Rank(r, schedule["faults"].get(r)) for r in range(3)]
    with time.held():
        threads = [time.start(_run_rank, time, hub, store.on_another_machine(), me, 3) for me in ranks]
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a rank still runs after 120 real seconds"
    assert time.errors == [], time.errors
    check_invariants(schedule, ranks, time.now, None)
    joiner, member = ranks[2], ranks[0]
    assert joiner.end == "done" and joiner.woke_at is not None and joiner.log[-1][0] == ROUNDS
    first = joiner.logged_at[0]
    assert first - joiner.woke_at <= 4 * TIMEOUT + STEP_SECONDS, (joiner.woke_at, first)
    gaps = [(b - a, at) for a, b, at in zip(member.logged_at, member.logged_at[1:], member.logged_at[1:], strict=False)]
    held = [(round(gap, 2), round(at, 2)) for gap, at in gaps if gap > STEP_SECONDS + 1.0 and at > joiner.woke_at]
    assert held == [], held
    assert _keys_of_forgotten_rounds(store) == []


def test_a_round_short_of_min_replicas_waits_for_a_paused_member_to_come_back(monkeypatch):
    """Two ranks with min_replicas=2; rank 1 stops for 8 s inside round 5 (more than twice the round's timeout). The
    round after it is short of the minimum: it waits for rank 1 to come back instead of ending the job for good (it
    ended with TooFewReplicas on both ranks), and both finish every round."""
    monkeypatch.setitem(globals(), "MIN_REPLICAS", 2)
    schedule = {"world": 2, "faults": {1: ("pause", 5, "inside", 8.0)}, "lost_at": None}
    ranks, seconds, lost_at = run_job(schedule)
    assert [me.end for me in ranks] == ["done", "done"], [(me.end, me.log[-1:]) for me in ranks]
    check_invariants(schedule, ranks, seconds, lost_at)
    assert ranks[0].log[-1][0] == ROUNDS and ranks[0].log[-1][1] == [0, 1]


@pytest.mark.parametrize("reporter", ["last", "not last"])
def test_a_member_stopped_between_its_report_and_the_verdict_never_takes_another_verdict(reporter, monkeypatch):
    """Rank 2 (or rank 1, reporting before rank 2) stops for 12 s right after its report reached round 5's count,
    its heartbeat too: the others give up waiting (or commit) and go on for more than KEPT_ROUNDS rounds, so round 5
    is forgotten. When it goes on it must neither write a verdict into the forgotten round nor take one the round
    did not have: its verdict is unknown to it and it takes the live state again (it wrote "0", or proposed "1",
    into the deleted round and took that: a verdict the others did not have)."""
    monkeypatch.setitem(globals(), "ROUNDS", 60)  # (the job goes on after it wakes)
    stopped = 2 if reporter == "last" else 1
    schedule = {"world": 3, "faults": {stopped: ("pause after report", 5, "commit", 12.0)}, "lost_at": None}
    ranks, seconds, lost_at = run_job(schedule)
    check_invariants(schedule, ranks, seconds, lost_at)
    assert ranks[stopped].end == "done" and ranks[stopped].log[-1][0] == ROUNDS
