"""The membership protocol's rounds and the manager's in one process: ranks as threads on one HashStore, no process
spawned.

Each test drives `Membership` through one schedule that once went wrong and checks the outcome the module doc
defines (who is a member, who joined, that nothing waits past its timeout).
"""

from __future__ import annotations

import functools
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_manager import _in_threads

from ddpkit.fault_tolerance.manager import Manager
from ddpkit.fault_tolerance.membership import Membership, Quorum, TooFewReplicas


def _form(memberships: list[Membership], round_: int) -> dict[int, object]:
    """Every one of `memberships` forms `round_` in its own thread and commits it as a success."""

    def form(membership: Membership) -> Quorum:
        quorum = membership.quorum(round_)
        quorum.commit(True)
        return quorum

    return _in_threads({m.rank: functools.partial(form, m) for m in memberships})


def test_a_joiner_reaching_a_round_decided_by_the_previous_commit_is_told_at_once_it_is_not_a_member():
    """Round 0 commits with nobody asking to join round 1, so its commit decides round 1 with the same members
    (no arrival keys written). A rank that announced itself a moment too late reads round 1 as decided without
    it: it must learn that at once and be expected next round, not wait on arrival keys never written (it waited
    for the store's whole timeout, then failed)."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    members = [Membership(store, r, 3, quorum_timeout=2.0, start_timeout=2.0) for r in (0, 1)]
    quorums = _form(members, 0)
    assert all(q.committed and q.next_decided for q in quorums.values()), quorums  # round 1: decided already
    late = Membership(store, 2, 3, quorum_timeout=2.0, join_timeout=5.0)
    late.joining = True  # announced, but after round 0's commit looked for joiners
    since = time.monotonic()
    quorum = late.quorum(1)
    assert time.monotonic() - since < 1.0
    assert not quorum.is_member and quorum.members == [0, 1]
    assert late._joiners(2) == {2}  # the next round expects it


def test_a_member_that_reports_after_its_round_was_decided_without_it_writes_nothing_of_later_rounds():
    """Rank 0 stalls before its commit report; rank 1 waits the round's timeout, writes the verdict "failed", and
    the job decides round 6 without rank 0. When rank 0 resumes, its report completes the count: it must read the
    verdict, not decide round 6 anew with the old members (it overwrote the later decision before)."""
    store = dist.HashStore()
    ranks = [Membership(store, r, 2, quorum_timeout=0.3) for r in (0, 1)]
    quorums = [Quorum(5, [0, 1], [], [], [0, 1], _membership=m) for m in ranks]
    assert quorums[1].commit(True) is False  # rank 0 never reported within the timeout: the round failed
    store.compare_set("ddpkit/ft/r6/members", "", "[1]")  # the job went on without rank 0
    store.set("ddpkit/ft/latest", "6")
    assert quorums[0].commit(True) is False  # the late report reads the verdict
    assert store.get("ddpkit/ft/r6/members") == b"[1]" and store.get("ddpkit/ft/latest") == b"6"


def test_the_latest_round_only_moves_forward():
    store = dist.HashStore()
    early, late = Membership(store, 0, 2), Membership(store, 1, 2)
    early.advance_latest(3)
    late.advance_latest(10)
    early.advance_latest(4)  # a rank paused since round 4 writes late: the record stays at 10
    assert early.latest_round() == 10
    early.advance_latest(11)
    assert late.latest_round() == 11


def _one_rank_manager() -> Manager:
    manager = Manager(dist.HashStore(), 0, 1, quorum_timeout=2.0, start_timeout=2.0, report=None)
    manager.start_round()
    return manager


def test_only_a_peers_failure_fails_a_round_and_every_other_error_is_raised():
    """A round whose collective fails because a peer died is dropped (and retried by the next round); an error of
    this rank's own (a bug, `TooFewReplicas`) used to be taken for one too, so the job looped on "round failed"
    forever instead of stopping with the cause."""
    manager = _one_rank_manager()

    def peer_died(*_: object) -> None:
        raise RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")

    def bug(*_: object) -> None:
        raise RuntimeError("The size of tensor a (3) must match the size of tensor b (4)")

    def too_few(*_: object) -> None:
        raise TooFewReplicas("round 1: no member holds live state")

    def store_timeout(*_: object) -> None:
        raise dist.DistStoreError("wait timeout")

    manager.collective(store_timeout)
    assert not manager.ok and manager.should_commit() is False
    manager.start_round()
    manager.collective(peer_died)
    assert not manager.ok and manager.should_commit() is False
    for own_error, kind in ((bug, RuntimeError), (too_few, TooFewReplicas)):
        manager.start_round()
        with pytest.raises(kind):
            manager.collective(own_error)
        assert manager.ok
        manager.should_commit()
    manager.close()


def _loop(manager: Manager, rounds: int, leave_at: int | None, before_commit: bool, log: list) -> None:
    """`rounds` rounds of an average of ones; with `leave_at`, this rank leaves in that round."""
    manager.start_round()
    assert manager.should_commit()
    for _ in range(rounds):
        quorum = manager.start_round()
        value = torch.ones(1)
        manager.average(value)
        if quorum.round == leave_at and before_commit:
            manager.leave()
        committed = manager.should_commit()
        log.append(
            (
                quorum.round,
                list(quorum.members),
                committed,
                manager.events[-1].waited_seconds
                if manager.events and manager.events[-1].round == quorum.round
                else 0.0,
            )
        )
        if quorum.round == leave_at:
            if not before_commit:
                manager.leave()
            manager.close()
            return
    manager.close()


def _leave(before_commit: bool) -> list:
    store = dist.HashStore()
    managers = [Manager(store, r, 3, quorum_timeout=3.0, start_timeout=5.0, report=None) for r in range(3)]
    logs: list[list] = [[], [], []]
    threads = [
        threading.Thread(target=_loop, args=(managers[r], 12, 6 if r == 2 else None, before_commit, logs[r]))
        for r in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return logs[0]


def test_a_rank_that_leaves_before_its_last_commit_costs_the_others_nothing():
    """Rank 2 ends after round 6 and says so before that round's commit: every round commits and round 7 goes on
    with ranks 0 and 1 without waiting (a rank that just stopped used to cost a failed round and a timeout)."""
    since = time.monotonic()
    log = _leave(before_commit=True)
    assert all(committed for _, _, committed, _ in log), log
    assert [m for r, m, _, _ in log if r == 7] == [[0, 1]], log
    assert time.monotonic() - since < 3.0 + 2  # no round waited its 3 s timeout


def test_a_rank_that_leaves_after_its_last_commit_fails_the_next_round_at_once():
    """Said after the commit (round 7 was decided ahead with rank 2): rank 2's connections close, round 7 fails at
    once on the others, and round 8 goes on without it, without waiting the round's timeout."""
    since = time.monotonic()
    log = _leave(before_commit=False)
    failed = [r for r, _, committed, _ in log if not committed]
    assert failed == [7], log
    assert [m for r, m, _, _ in log if r == 8] == [[0, 1]], log
    assert time.monotonic() - since < 3.0 + 2
