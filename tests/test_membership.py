"""Fault-tolerant local SGD and SGP under the `Manager`: ranks die, stall and come back while the others train on.

Each rank is its own process joined only through a TCPStore that this test process hosts (as a launcher would), so
no rank's death takes the store down. Every rank adds its own "local progress" to a flat vector between rounds and
calls `FaultTolerantLocalSGD.sync` (or `FaultTolerantGossip.sync`), the classes `ddpkit train --fault-tolerant`
runs; its log (the quorum of each round, the verdict and its vector after it) is
checked against a one-process simulation of the same membership schedule, written from the definition: members
that were already in step average exactly, joiners take that mean, rounds that failed anywhere change nothing.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddpkit.algorithms.fault_tolerant import FaultTolerantGossip, FaultTolerantLocalSGD
from ddpkit.fault_tolerance.manager import Manager
from ddpkit.fault_tolerance.membership import Membership, TooFewReplicas

pytestmark = pytest.mark.slow

TIMEOUT = 1.5  # quorum timeout, seconds


def _progress(rank: int, round_: int) -> float:
    return float((rank + 1) * (round_ + 1))


def _manager(rank: int, port: int, settings: dict) -> Manager:
    """A rank's manager; the job's first rank(s) form round 0 (the start), a replacement joins the job under way."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    manager = Manager(
        store,
        rank,
        settings["world"],
        min_replicas=settings.get("min_replicas", 1),
        quorum_timeout=TIMEOUT,
        start_timeout=30,
        report=None,
    )
    return manager


REPLACEMENT_UP = "test/replacement-up"


def _hold(manager: Manager, settings: dict, round_: int) -> None:
    """At round `settings["hold_at"]` a survivor waits until the replacement runs (it says so in the store), so
    that on a loaded machine the replacement still finds rounds to join (its start, a fresh interpreter, can take
    longer than the rounds left)."""
    if settings.get("hold_at") == round_:
        manager.store.wait([REPLACEMENT_UP], timedelta(seconds=120))


def _begin(manager: Manager, settings: dict) -> None:
    if settings.get("rejoin", False):
        manager.store.set(REPLACEMENT_UP, "1")
    else:
        manager.start()
        assert manager.should_commit()


def _inject(manager: Manager, method: str) -> None:
    """This rank fails in the round after its collective (every member holds the round's result then): the
    round must be dropped everywhere, each member back to where it was."""
    real = getattr(manager, method)

    def failing(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)
        manager.fail()
        setattr(manager, method, real)

    setattr(manager, method, failing)


def _die(out: mp.Queue, entry: tuple) -> None:
    out.put(entry)
    out.close()
    out.join_thread()  # the message is out before the process vanishes
    os._exit(1)


def _worker(rank: int, port: int, settings: dict, out: mp.Queue) -> None:
    manager = _manager(rank, port, settings)
    ft = FaultTolerantLocalSGD(manager)
    flat = torch.zeros(3, dtype=torch.float64)
    log = []
    rejoin = settings.get("rejoin", False)
    try:
        _begin(manager, settings)
        while manager.next_round < settings["rounds"]:
            r = manager.next_round
            _hold(manager, settings, r)
            if settings.get("die_at") == r:
                _die(out, (rank, rejoin, log, "died"))
            flat += _progress(rank, r)
            time.sleep(settings.get("sleep", 0.1))
            if settings.get("fail_at") == r:
                _inject(manager, "collective")
            q = ft.sync(flat)
            log.append((q.round, q.members, q.joined, q.is_member, q.committed, flat.tolist()))
        out.put((rank, rejoin, log, "done"))
    except TooFewReplicas as error:
        out.put((rank, rejoin, log, f"TooFewReplicas: {error}"))


def _start(ctx, rank: int, port: int, settings: dict, out: mp.Queue, worker=_worker):
    p = ctx.Process(target=worker, args=(rank, port, settings, out), daemon=True)
    p.start()
    return p


def _lose_rank_2_and_replace_it(settings: dict, after_round: int, worker=_worker) -> list[tuple]:
    """World 3: rank 2 dies at round 3 and round 2 fails on rank 1 alone (an injected error); once the survivors
    are past `after_round`, a replacement for rank 2 starts. Returns the four processes' logs, checked for the
    plain facts: who ended how, the survivor at every round, round 2 dropped everywhere, rank 2 gone at round 3."""
    ctx = mp.get_context("spawn")
    store = _store()
    out = ctx.Queue()
    hold = {"hold_at": settings["rounds"] - 8}  # the survivors wait there for the replacement to run
    faults = {0: hold, 2: {"die_at": 3}, 1: {"fail_at": 2, **hold}}
    procs = [_start(ctx, r, store.port, {**settings, **faults.get(r, {})}, out, worker) for r in range(3)]
    deadline = time.monotonic() + 120
    while int(store.get("ddpkit/ft/latest") if store.check(["ddpkit/ft/latest"]) else -1) < after_round:
        assert time.monotonic() < deadline, f"the survivors did not get past round {after_round}"
        time.sleep(0.05)
    procs.append(_start(ctx, 2, store.port, {**settings, "rejoin": True}, out, worker))
    logs = _collect(out, 4, 180)
    for p in procs:
        p.join(30)
    ends = {(rank, rejoin): end for rank, rejoin, _, end in logs}
    assert ends == {(0, False): "done", (1, False): "done", (2, False): "died", (2, True): "done"}, ends
    survivor = next(log for rank, _, log, _ in logs if rank == 0)
    assert [e[0] for e in survivor] == list(range(1, settings["rounds"]))  # never stopped, never restarted
    assert [e[4] for e in survivor[:3]] == [True, False, True], survivor[:4]  # dropped everywhere
    assert survivor[2][1] == [0, 1]  # dropped at once in the round it missed
    return logs


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
    started = time.monotonic()
    # 0.3 s per round: long enough for a replacement to start (torch import)
    logs = _lose_rank_2_and_replace_it({"world": 3, "rounds": 32, "sleep": 0.3}, after_round=4)
    survivor = next(log for rank, _, log, _ in logs if rank == 0)
    rejoined = [e for e in survivor if e[2] == [2]]
    assert len(rejoined) == 1 and rejoined[0][0] > 4 and rejoined[0][1] == [0, 1, 2], survivor
    final = [log[-1][5] for _, _, log, end in logs if end == "done"]
    assert final[0] == final[1] == final[2]  # the replacement holds the survivors' parameters, bit for bit
    _check_against_simulation(logs)
    assert time.monotonic() - started < 160


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
    assert re.match(r"TooFewReplicas: round [23]: 1 of 2 ranks reached the quorum", ends[0]), ends
    assert "min_replicas=2" in ends[0]


# -- SGP: push-sum gossip over each round's members ----------------------------------------------------------------

EXACT_EVERY = 5  # rounds r with r % 5 == 4 are exact averages (sum x / sum w), the others gossip


def _gossip_worker(rank: int, port: int, settings: dict, out: mp.Queue) -> None:
    manager = _manager(rank, port, settings)
    rejoin = settings.get("rejoin", False)
    flat = torch.zeros(2, dtype=torch.float32)
    ft = FaultTolerantGossip(flat, "npeer-exponential", 1, manager)
    log = []
    _begin(manager, settings)
    while manager.next_round < settings["rounds"]:
        r = manager.next_round
        _hold(manager, settings, r)
        if settings.get("die_at") == r:
            _die(out, (rank, rejoin, log, "died"))
        flat += torch.tensor([_progress(rank, r), 1.0])
        time.sleep(settings.get("sleep", 0.1))
        if settings.get("fail_at") == r:
            _inject(manager, "collective")
        q = ft.sync(flat, exact=lambda round_: round_ % EXACT_EVERY == EXACT_EVERY - 1)
        log.append((q.round, q.members, q.joined, q.is_member, q.committed, flat.tolist()))
    out.put((rank, rejoin, log, "done"))


def _simulate_push_sum(logs: list[tuple]) -> dict[tuple[int, bool], list[list[float]]]:
    """Each process's model after each of its rounds, from the rounds' quorums and verdicts alone (SGP's push-sum,
    Assran et al. 2019: [x, w] per node, model x / w; each gossip round a node keeps half and sends half to the
    member 2**(t mod L) places on, L = floor(log2(n - 1)) + 1, t counting the gossip rounds; an exact round sets
    x to sum x / sum w and w to 1; a joiner and the lowest member that was there share that member's [x, w]
    equally; a failed round changes nothing but t; a process only adds its progress while it is in step)."""
    decided: dict[int, tuple] = {}
    for _, _, log, _ in logs:
        for round_, members, joined, is_member, committed, _ in log:
            if is_member:
                decided[round_] = (members, joined, committed)
    keys = [(rank, rejoin) for rank, rejoin, _, _ in logs]
    rounds = {(rank, rejoin): [entry[0] for entry in log] for rank, rejoin, log, _ in logs}
    state = {key: [0.0, 0.0, 1.0] for key in keys}  # x (2 numerators), w
    in_step = {key: not key[1] for key in keys}
    expected: dict[tuple[int, bool], list[list[float]]] = {key: [] for key in keys}
    gossip_rounds = 0
    for round_ in sorted(decided):
        members, joined, committed = decided[round_]
        attending = [key for key in keys if round_ in rounds[key]]
        member_of = {key[0]: key for key in attending if key[0] in members}
        for key in attending:
            if in_step[key] and key[0] in members:
                x0, x1, w = state[key]
                state[key] = [x0 + _progress(key[0], round_), x1 + 1.0, w]  # x += model' - x / w
        before = {key: list(value) for key, value in state.items()}
        source = next((r for r in members if r not in joined), None)
        if joined and source is not None:
            share = [v / (len(joined) + 1) for v in state[member_of[source]]]
            for r in [source, *joined]:
                state[member_of[r]] = list(share)
        exact = round_ % EXACT_EVERY == EXACT_EVERY - 1
        n = len(members)
        if exact:
            total = [sum(state[member_of[r]][i] for r in members) for i in range(3)]
            for r in members:
                state[member_of[r]] = [total[0] / total[2], total[1] / total[2], 1.0]
        elif n > 1:
            hops = 2 ** (gossip_rounds % (math.floor(math.log2(n - 1)) + 1))
            old = {r: state[member_of[r]] for r in members}
            for i, r in enumerate(members):
                sender = members[(i - hops) % n]
                state[member_of[r]] = [0.5 * a + 0.5 * b for a, b in zip(old[r], old[sender], strict=True)]
        if not exact:
            gossip_rounds += 1
        if not committed:
            state = before
        for key in attending:
            if key[0] in members and (committed or not key[1] or in_step[key]):
                in_step[key] = True
            elif key[0] not in members:
                in_step[key] = False
            x0, x1, w = state[key]
            expected[key].append([x0 / w, x1 / w])
    return expected


def test_sgp_loses_a_peer_it_leaves_the_graph_and_a_replacement_takes_a_share_of_the_healer():
    """world 3: rank 2 dies at round 3, a replacement joins later; round 1 fails on rank 1 alone (dropped on all)."""
    logs = _lose_rank_2_and_replace_it({"world": 3, "rounds": 25, "sleep": 0.3}, 5, _gossip_worker)
    survivor = next(log for rank, _, log, _ in logs if rank == 0)
    assert sum(e[2] == [2] for e in survivor) == 1, survivor
    expected = _simulate_push_sum(logs)
    for rank, rejoin, log, _ in logs:
        got = [value for entry in log for value in entry[5]]
        want = [value for model in expected[(rank, rejoin)] for value in model]
        assert got == pytest.approx(want, rel=1e-5), (rank, rejoin, log, expected[(rank, rejoin)])
    # the last round (24) is exact: everyone in it holds the same model
    assert len({tuple(log[-1][5]) for _, _, log, end in logs if end == "done"}) == 1


def test_membership_arguments_are_checked():
    with pytest.raises(ValueError, match="min_replicas must be in"):
        Membership(None, 0, 2, min_replicas=3)
    with pytest.raises(ValueError, match="rank must be in"):
        Membership(None, 2, 2)
    with pytest.raises(ValueError, match="quorum_timeout must be > 0"):
        Membership(None, 0, 2, quorum_timeout=0)
