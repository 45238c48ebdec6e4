"""Fault-tolerant local SGD (issue 24, first piece): ranks die, stall and come back while the others train on.

Each rank is its own process joined only through a TCPStore that this test process hosts (as a launcher would), so
no rank's death takes the store down. Every rank adds its own "local progress" to a flat vector between rounds and
calls `FaultTolerantLocalSGD.sync`; its log (the quorum of each round, the verdict and its vector after it) is
checked against a one-process simulation of the same membership schedule, written from the definition: members
that were already in step average exactly, joiners take that mean, rounds that failed anywhere change nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddpkit.algorithms import fault_tolerant
from ddpkit.algorithms.fault_tolerant import FaultTolerantLocalSGD
from ddpkit.distributed.membership import Membership, TooFewReplicas

pytestmark = pytest.mark.slow

TIMEOUT = 1.5  # quorum timeout, seconds


def _progress(rank: int, round_: int) -> float:
    return float((rank + 1) * (round_ + 1))


def _worker(rank: int, port: int, settings: dict, out: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    membership = Membership(store, rank, settings["world"], settings.get("min_replicas", 1), TIMEOUT)
    ft = FaultTolerantLocalSGD(membership, rejoining=settings.get("rejoin", False))
    flat = torch.zeros(3, dtype=torch.float64)
    log = []
    try:
        while ft.round < settings["rounds"]:
            r = ft.round
            if settings.get("die_at") == r:
                out.put((rank, settings.get("rejoin", False), log, "died"))
                out.close()
                out.join_thread()  # the message is out before the process vanishes
                os._exit(1)
            flat += _progress(rank, r)
            time.sleep(settings.get("sleep", 0.1))
            real = fault_tolerant.quorum_mean
            if settings.get("fail_at") == r:  # this rank's all-reduce fails: the round must be dropped everywhere

                def failing(*args: object, **kwargs: object) -> None:
                    raise RuntimeError("injected failure")

                fault_tolerant.quorum_mean = failing
            try:
                q = ft.sync(flat)
            finally:
                fault_tolerant.quorum_mean = real
            log.append((q.round, q.members, q.joined, q.is_member, q.committed, flat.tolist()))
        out.put((rank, settings.get("rejoin", False), log, "done"))
    except TooFewReplicas as error:
        out.put((rank, settings.get("rejoin", False), log, f"TooFewReplicas: {error}"))


def _start(ctx, rank: int, port: int, settings: dict, out: mp.Queue):
    p = ctx.Process(target=_worker, args=(rank, port, settings, out), daemon=True)
    p.start()
    return p


def _simulate(logs: list[tuple]) -> dict[tuple[int, bool], list[list[float]]]:
    """Each process's vector after each of its rounds, from the rounds' quorums and verdicts alone."""
    decided: dict[int, tuple] = {}
    for _, _, log, _ in logs:
        for round_, members, joined, _, committed, _ in log:
            if round_ in decided and decided[round_][0] == members:
                committed = decided[round_][2] if committed is None else committed
            decided[round_] = (members, joined, committed)
    state = {(rank, rejoin): 0.0 for rank, rejoin, _, _ in logs}
    runs = {(rank, rejoin): {entry[0] for entry in log} for rank, rejoin, log, _ in logs}
    expected: dict[tuple[int, bool], list[float]] = {key: [] for key in state}
    for round_ in sorted(decided):
        members, joined, committed = decided[round_]
        alive = [key for key in state if round_ in runs[key]]
        for key in alive:
            state[key] += _progress(key[0], round_)
        in_round = [key for key in alive if key[0] in members]
        counted = [state[key] for key in in_round if key[0] not in joined]
        if committed and counted:
            mean = sum(counted) / len(counted)
            for key in in_round:
                state[key] = mean
        for key in alive:
            expected[key].append(state[key])
    return expected


def _check_against_simulation(logs: list[tuple]) -> None:
    expected = _simulate(logs)
    for rank, rejoin, log, _ in logs:
        got = [entry[5][0] for entry in log]
        assert got == pytest.approx(expected[(rank, rejoin)], rel=1e-12), (rank, rejoin, log)
        assert all(entry[5][0] == entry[5][1] == entry[5][2] for entry in log)


def _collect(out: mp.Queue, n: int, timeout: float) -> list[tuple]:
    return [out.get(timeout=timeout) for _ in range(n)]


def _store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def test_a_lost_rank_is_dropped_survivors_train_on_and_its_replacement_heals():
    """Also: round 1 fails on rank 1 alone (an injected error), and is dropped on every member."""
    ctx = mp.get_context("spawn")
    store = _store()
    out = ctx.Queue()
    settings = {"world": 3, "rounds": 32, "sleep": 0.3}  # long enough for a replacement to start (torch import)
    started = time.monotonic()
    procs = [_start(ctx, r, store.port, {**settings, "die_at": 3 if r == 2 else None, "fail_at": 1 if r == 1 else None},
                    out) for r in range(3)]  # fmt: skip
    deadline = time.monotonic() + 120
    while int(store.get("ddpkit/ft/latest") if store.check(["ddpkit/ft/latest"]) else -1) < 4:
        assert time.monotonic() < deadline, "the survivors did not get past round 4"
        time.sleep(0.05)
    procs.append(_start(ctx, 2, store.port, {**settings, "rejoin": True}, out))
    logs = _collect(out, 4, 180)
    for p in procs:
        p.join(30)
    ends = {(rank, rejoin): end for rank, rejoin, _, end in logs}
    assert ends == {(0, False): "done", (1, False): "done", (2, False): "died", (2, True): "done"}, ends
    survivor = next(log for rank, _, log, _ in logs if rank == 0)
    assert [e[0] for e in survivor] == list(range(32))  # never stopped, never restarted
    by_round = {e[0]: e for e in survivor}
    assert [by_round[r][4] for r in range(3)] == [True, False, True], survivor[:4]  # dropped everywhere
    assert by_round[3][1] == [0, 1]  # dropped at once in the round it missed
    rejoined = [e for e in survivor if e[2] == [2]]
    assert len(rejoined) == 1 and rejoined[0][0] > 4 and rejoined[0][1] == [0, 1, 2], survivor
    final = [log[-1][5] for _, _, log, end in logs if end == "done"]
    assert final[0] == final[1] == final[2]  # the replacement holds the survivors' parameters, bit for bit
    _check_against_simulation(logs)
    assert time.monotonic() - started < 160


@pytest.mark.long
def test_a_stalled_rank_is_dropped_and_returns():
    ctx = mp.get_context("spawn")
    store = _store()
    out = ctx.Queue()
    procs = [_start(ctx, r, store.port, {"world": 3, "rounds": 45, "sleep": 0.3}, out) for r in range(3)]
    deadline = time.monotonic() + 120
    while int(store.get("ddpkit/ft/latest") if store.check(["ddpkit/ft/latest"]) else -1) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(procs[2].pid, signal.SIGSTOP)
    time.sleep(6 * TIMEOUT)  # past a failed round's group, all-reduce and commit timeouts and the next quorum
    os.kill(procs[2].pid, signal.SIGCONT)
    logs = _collect(out, 3, 180)
    for p in procs:
        p.join(30)
    assert all(end == "done" for *_, end in logs), logs
    survivor = next(log for rank, _, log, _ in logs if rank == 0)
    assert any(e[1] == [0, 1] for e in survivor), survivor  # dropped while stopped
    assert any(e[2] == [2] for e in survivor), survivor  # and healed when back
    assert len({tuple(log[-1][5]) for _, _, log, _ in logs}) == 1  # equal again at the end
    _check_against_simulation(logs)


def test_fewer_survivors_than_the_minimum_end_the_job_with_a_clear_error():
    ctx = mp.get_context("spawn")
    store = _store()
    out = ctx.Queue()
    settings = {"world": 2, "rounds": 6, "min_replicas": 2}
    procs = [_start(ctx, r, store.port, {**settings, "die_at": 2 if r == 1 else None}, out) for r in range(2)]
    logs = _collect(out, 2, 120)
    for p in procs:
        p.join(30)
    ends = {rank: end for rank, _, _, end in logs}
    assert ends[1] == "died"
    assert ends[0].startswith("TooFewReplicas: round 2: 1 of 2 ranks reached the quorum"), ends
    assert "min_replicas=2" in ends[0]


def test_membership_arguments_are_checked():
    with pytest.raises(ValueError, match="min_replicas must be in"):
        Membership(None, 0, 2, min_replicas=3)
    with pytest.raises(ValueError, match="rank must be in"):
        Membership(None, 2, 2)
    with pytest.raises(ValueError, match="quorum_timeout must be > 0"):
        Membership(None, 0, 2, quorum_timeout=0)
