"""`ddpkit.fault_tolerance.manager.Manager`: a fault-tolerant job's rounds under a loop of any shape.

Deterministic and in one process: each rank is a thread holding its own Manager, all meeting in one HashStore,
each round's gloo group made between the threads. The own-loop example of docs/fault-tolerance.md runs here as
written (read from the page), with a failed round, a lost rank and a rank that starts late. The reference is
written apart from the code under test: one model stepped by torch's own SGD (with momentum) on the mean of the
members' gradients of every round that committed, the rounds' members and verdicts read from the ranks' logs.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_readme import snippet
from torch import nn

from ddpkit.distributed.agreement import CannotCompare, RanksDisagree, optimizer_settings
from ddpkit.distributed.stats import comm_stats
from ddpkit.fault_tolerance.etcd_store import EtcdStore
from ddpkit.fault_tolerance.manager import Manager, StoreLost
from ddpkit.fault_tolerance.membership import TooFewReplicas, latest_round

LR, MOMENTUM, STEPS = 0.1, 0.9, 40
START = 3.0  # seconds round 0 waits for every rank: the threads start at once, the late one does not count
README_LOOP = "if manager.should_commit():  # False on every member"


class MyModel(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)  # every rank starts elsewhere: the first round gives them rank 0's model
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


class Logged(Manager):
    """The README's Manager, with a log of every round this rank committed or dropped, and faults on request:
    `fail_round` fails this rank's average in that round; `vanish_round`: the rank stops in that round's middle
    (after its backward, before averaging: its thread ends, as a process killed there would); `await_join`: (round,
    rank): from that round on, each round waits a little until `rank` was a member of a committed round (at most 30 s
    in all), so that a rank started again finds the job still running."""

    def __init__(
        self,
        *args: Any,
        fail_round: int = -1,
        vanish_round: int = -1,
        await_join: tuple[int, int] | None = None,
        fail_when_joins: int = -1,
        pause_round: tuple[int, float] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.pause_round = pause_round  # (round, seconds): this rank stalls that long before the round's average
        self.fail_round, self.vanish_round, self.await_join = fail_round, vanish_round, await_join
        self.fail_when_joins = fail_when_joins  # fail the first round that rank joins in
        self._patience = time.monotonic() + 30
        self.log: list[tuple[int, list[int], bool]] = []

    def average(self, tensor: torch.Tensor, counts: bool = True) -> None:
        quorum = self.current()
        if quorum.round == self.vanish_round:
            raise Vanished
        if self.pause_round is not None and quorum.round == self.pause_round[0]:
            time.sleep(self.pause_round[1])  # (as a process stopped and continued)
            self.pause_round = None
        super().average(tensor, counts)
        if quorum.round == self.fail_round or self.fail_when_joins in quorum.joined:
            self.fail()
            self.fail_when_joins = -1

    def should_commit(self) -> bool:
        committed = super().should_commit()
        assert self.quorum is not None
        if self.await_join is not None and self.quorum.round >= self.await_join[0]:
            self._hold_for(self.await_join[1])
        if self.quorum.round > 0:
            self.log.append((self.quorum.round, list(self.quorum.members), committed))
        return committed

    def _hold_for(self, rank: int) -> None:
        """Holds this round up to 0.8 s (less than the quorum timeout: this rank is not dropped) until `rank` was a
        member of a committed round: a joiner whose join round failed, or that was slower than the others out of
        it, joins again a few rounds later, which a job of few steps would otherwise end before."""
        until = min(time.monotonic() + 0.8, self._patience)
        while time.monotonic() < until and not any(rank in members and ok for _, members, ok in self.log):
            time.sleep(0.05)


class Vanished(Exception):
    pass


SEEDING = threading.Lock()


def _rank(store: Any, rank: int, world: int, results: dict, **faults: Any) -> None:
    """Runs the README's loop as rank `rank`, its names supplied as a reader would."""
    code = snippet(README_LOOP)
    source = str(code.path)  # the documentation page it was read from, for tracebacks
    with SEEDING:  # the global generator, one thread at a time
        model = MyModel(seed=rank)
    steps = STEPS
    namespace: dict[str, Any] = {
        "store": store,
        "rank": rank,
        "world_size": world,
        "MyModel": lambda: model,
        "batch": batch,
        "loss_fn": loss_fn,
        "total_steps": steps,
    }

    def make(*args: Any, **kwargs: Any) -> Logged:
        kwargs.update(quorum_timeout=1.5, start_timeout=START, report=None)
        results.setdefault("managers", {})[rank] = manager = Logged(*args, **faults, **kwargs)
        return manager

    code = code.replace("from ddpkit.fault_tolerance import Manager\n", "")
    namespace["Manager"] = make
    try:
        exec(compile(code, source, "exec"), namespace)
        results[rank] = ("done", [p.detach().clone() for p in model.parameters()])
    except Vanished:
        results["managers"][rank].close()  # its heartbeat stops with it
        results[rank] = ("vanished", None)
    except Exception as exc:  # reported to the test's thread
        results[rank] = ("error", exc)


def _reference(logs: list[list[tuple[int, list[int], bool]]]) -> list[torch.Tensor]:
    """Rank 0's initial model stepped by torch's SGD on the mean gradient of each committed round's members."""
    rounds: dict[int, tuple[list[int], bool]] = {}
    for log in logs:
        for round_, members, committed in log:
            assert rounds.setdefault(round_, (members, committed)) == (members, committed), (round_, logs)
    model = MyModel(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for round_ in sorted(rounds):
        members, committed = rounds[round_]
        if not committed:
            continue
        grads = []
        for rank in members:
            model.zero_grad()
            x, y = batch(round_ - 1, rank)  # round r is the loop's step r - 1 (round 0 is the start)
            loss_fn(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def _client(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _reached(store: Any, round_: int) -> bool:
    """Whether the job decided round `round_` (or its store is gone: a rank started then stops at once)."""
    try:
        return latest_round(store) >= round_
    except dist.DistNetworkError:
        return True


def _run(
    world: int,
    late: dict[int, int] | None = None,
    client: Callable[[], Any] | None = None,
    results: dict | None = None,
    close: bool = True,
    **faults_by_rank: dict,
) -> tuple[dict, dict]:
    """Ranks 0..world-1 as threads; `late`: rank -> the round the others reach before it starts; `client`: makes
    each rank's own client of the job's store (a TCPStore's, an etcd cluster's; None: one HashStore shared);
    `results`: where the ranks' ends go (read by the caller while they run)."""
    results = {} if results is None else results
    shared = dist.HashStore()

    def store() -> Any:
        return client() if client is not None else shared

    reader = store()
    late = late or {}
    threads = {}
    for rank in range(world):
        if rank not in late:
            threads[rank] = threading.Thread(
                target=_rank,
                args=(store(), rank, world, results),
                kwargs=faults_by_rank.get(f"rank{rank}", {}),
                daemon=True,
            )
            threads[rank].start()
    for rank, after in late.items():
        deadline = time.monotonic() + 60
        while not _reached(reader, after):
            assert time.monotonic() < deadline, f"the job did not reach round {after}"
            time.sleep(0.01)
        threads[rank] = threading.Thread(target=_rank, args=(store(), rank, world, results), daemon=True)
        threads[rank].start()
    for thread in threads.values():
        thread.join(120)
        assert not thread.is_alive(), "a rank hung"
    managers = results.pop("managers")
    if close:  # (else the caller closes them)
        for manager in managers.values():
            manager.close()
    return results, managers


def test_the_readme_loop_with_a_failed_round_a_lost_rank_and_a_late_one_equals_the_reference():
    """Rank 1's average fails in round 5 (dropped on every member); rank 2 vanishes in round 12's middle (the
    round fails, it is dropped from the next); rank 3 starts once round 20 is decided and joins from live state."""
    waits = {"await_join": (20, 3)}  # (the job must not end before rank 3, started late, joins)
    results, managers = _run(4, late={3: 20}, rank0=waits, rank1={"fail_round": 5, **waits}, rank2={"vanish_round": 12})
    ends = {rank: results[rank][0] for rank in range(4)}
    assert ends == {0: "done", 1: "done", 2: "vanished", 3: "done"}, results
    logs = {rank: managers[rank].log for rank in (0, 1, 3)}
    by_round = {r: (m, c) for r, m, c in logs[0]}
    assert by_round[5] == ([0, 1, 2], False)  # one member's failure drops the round on every member
    assert by_round[12][1] is False and 2 not in by_round[13][0]  # lost mid-round: dropped, then left out
    joined = [r for r, m, _ in logs[0] if 3 in m]
    assert joined and joined[0] > 20 and managers[0].events[-1].joined == [3], managers[0].events
    assert [r for r, _, _ in logs[0]] == list(range(1, STEPS + 1))  # rank 0 took part in every round
    reference = _reference(list(logs.values()))
    for rank in (0, 1, 3):
        for got, want in zip(results[rank][1], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[3][1], strict=True))  # bit for bit
    assert managers[3].rejoined == 1 and managers[0].rejoined == 0


def test_a_joiner_whose_join_round_failed_takes_part_in_the_next_round_without_failing_it():
    """Rank 2 starts late; rank 1 fails the round rank 2 joins in. The next round is decided with rank 2 as a
    joiner again: rank 2 receives the live state there and the round commits (it used to announce itself once
    more and leave that round, which then failed on every member)."""
    waits = {"await_join": (8, 2)}  # (the job must not end before rank 2, started late on a loaded machine, joins)
    results, managers = _run(3, late={2: 8}, rank0=waits, rank1={"fail_when_joins": 2, **waits})
    assert {rank: results[rank][0] for rank in range(3)} == {0: "done", 1: "done", 2: "done"}, results
    log = managers[0].log
    failed = [(r, m) for r, m, c in log if not c]
    assert len(failed) == 1 and 2 in failed[0][1], log  # only the join round failed
    after = [(r, m, c) for r, m, c in log if r == failed[0][0] + 1]
    assert after and after[0][2] and 2 in after[0][1], log
    reference = _reference([managers[r].log for r in range(3)])
    for rank in range(3):
        for got, want in zip(results[rank][1], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_heal_sends_the_live_state_to_the_joiners_alone_and_nothing_is_unpickled(monkeypatch):
    """Four ranks, two of them late (each joins in a round of its own or together): the heal source sends the
    live state once per joiner, point to point: every tensor's bytes once and a small JSON header, never a
    pickle (pickle's and torch's loaders fail the test if anything calls them); the members that hold it already
    receive nothing (a broadcast sent it to every member)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a fault-tolerant rank unpickled bytes it received")

    for module, name in ((pickle, "loads"), (pickle, "load"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    comm_stats.reset()
    results, managers = _run(4, late={2: 6, 3: 6})
    assert all(results[rank][0] == "done" for rank in range(4)), results
    joins = sum(len(e.joined) for e in managers[0].events)
    assert joins == 2, managers[0].events
    tensors = sum(t.numel() * t.element_size() for t in _tensors_of(managers[0].live_state()))
    sent = comm_stats.snapshot()[("send", "heal")]
    assert sent.calls == joins
    length_field, header_at_most = 8, 4096  # the payload's length, sent first; its JSON description
    assert joins * (tensors + length_field) < sent.sent_bytes <= joins * (tensors + length_field + header_at_most)


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_of(v)]
    return []


def test_an_uncommitted_round_leaves_every_member_where_it_was():
    """Counter-check of the reference: had the failed round's gradients been applied (the un-averaged one on
    the rank that failed, or the average elsewhere), the models would differ from it."""
    results, managers = _run(2, rank0={"fail_round": 3})
    logs = [managers[r].log for r in (0, 1)]
    assert [c for r, _, c in logs[0] if r == 3] == [False]
    reference = _reference(logs)
    forced = _reference([[(r, m, True) for r, m, _ in log] for log in logs])
    for rank in (0, 1):
        got = results[rank][1]
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, reference, strict=True))
        assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, forced, strict=True))


def _until_rank_0_ended(results: dict) -> None:
    deadline = time.monotonic() + 60
    while results.get(0) is None:
        assert time.monotonic() < deadline, "rank 0 never vanished"
        time.sleep(0.01)


def test_the_embedded_store_lost_with_machine_0_stops_every_survivor_naming_the_etcd_option():
    """The job's TCPStore and rank 0 (its machine) go in round 10. No survivor decides alone where to go on: each
    stops within the round's timeouts with `StoreLost`, which names the store and the highly available option."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    holder = {"server": server}
    port = server.port
    del server

    def kill_the_store_once_rank_0_is_gone(results: dict) -> None:
        _until_rank_0_ended(results)
        holder.pop("server")  # the only reference: the server stops, every client's connection breaks

    results: dict = {}
    killer = threading.Thread(target=kill_the_store_once_rank_0_is_gone, args=(results,), daemon=True)
    killer.start()
    since = time.monotonic()
    got, managers = _run(3, client=lambda: _client(port), results=results, rank0={"vanish_round": 10})
    killer.join(5)
    assert got[0][0] == "vanished", got
    for rank in (1, 2):
        end, exc = got[rank]
        assert end == "error" and isinstance(exc, StoreLost), got[rank]
        assert f"store at 127.0.0.1:{port} is gone" in str(exc) and "--store etcd://" in str(exc), exc
        assert managers[rank].log and managers[rank].log[-1][0] < STEPS, "a survivor went on alone"
    assert time.monotonic() - since < 60


def test_a_store_restarted_empty_at_the_same_address_is_never_taken_for_the_jobs():
    """Rank 0 vanishes in round 10 and the job's store is started again at once, empty, at the same address (a
    service manager restarting `ddpkit store`). The survivors' connections break and a new one reaches the new
    store: each stops with `StoreLost` naming both incarnations, and no round is decided there (a survivor that
    took it for the job's went on in it alone, or waited to be healed from nothing)."""
    from ddpkit.fault_tolerance import job_store, store_identity

    server = job_store.host(0, 30)
    port, old = server.port, store_identity.read(server)
    holder: dict[str, Any] = {"server": server}
    del server

    def restart_the_store_once_rank_0_is_gone(results: dict) -> None:
        _until_rank_0_ended(results)
        holder.pop("server")  # the only reference: the server stops, every client's connection breaks
        holder["again"] = job_store.host(port, 30)

    results: dict = {}
    restarter = threading.Thread(target=restart_the_store_once_rank_0_is_gone, args=(results,), daemon=True)
    restarter.start()
    survivor = {"join_timeout": 5.0}
    got, managers = _run(
        3, client=lambda: _client(port), results=results, rank0={"vanish_round": 10}, rank1=survivor, rank2=survivor
    )
    restarter.join(5)
    new = store_identity.read(holder["again"])
    assert got[0][0] == "vanished" and new not in (None, old), (got, new)
    for rank in (1, 2):
        end, exc = got[rank]
        assert end == "error" and isinstance(exc, StoreLost), got[rank]
        assert "came back as another store" in str(exc) and old in str(exc) and new in str(exc), exc
        assert managers[rank].incarnation == old
    assert not holder["again"].check(["ddpkit/ft/latest"]), "a round was decided on the restarted store"


def test_on_etcd_the_job_outlives_machine_0_and_an_etcd_member_and_machine_0_comes_back(etcd):
    """The job's coordination in a three-member etcd cluster (no machine hosts it). Rank 0 vanishes in round 10,
    then one etcd member is killed (SIGKILL) while the survivors train on; rank 0 started again with the same
    store joins them from live state. Every rank's model equals the reference, the joiner's bit for bit."""
    url = etcd.url("outlives-machine-0")
    results: dict = {}
    restarted: dict = {}

    def lose_a_member_then_start_rank_0_again() -> None:
        deadline = time.monotonic() + 60
        while results.get(0) is None:
            assert time.monotonic() < deadline, "rank 0 never vanished"
            time.sleep(0.01)
        etcd.kill(1)  # one of three etcd members: the other two still decide every write
        thread = threading.Thread(target=_rank, args=(EtcdStore(url, 30), 0, 3, restarted), daemon=True)
        thread.start()
        thread.join(90)

    helper = threading.Thread(target=lose_a_member_then_start_rank_0_again, daemon=True)
    helper.start()
    waiting = {"await_join": (11, 0)}
    got, managers = _run(
        3,
        client=lambda: EtcdStore(url, 30),
        results=results,
        close=False,
        rank0={"vanish_round": 10},
        rank1=waiting,
        rank2=waiting,
    )
    helper.join(90)
    assert {rank: got[rank][0] for rank in range(3)} == {0: "vanished", 1: "done", 2: "done"}, got
    assert restarted.get(0, ("missing",))[0] == "done", restarted
    assert len(etcd.alive()) == 2
    back = restarted["managers"][0]
    assert back.rejoined == 1 and any(0 in e.joined for e in managers[1].events), managers[1].events
    by_round = {r: (m, c) for r, m, c in managers[1].log}
    assert by_round[10] == ([0, 1, 2], False), by_round  # lost mid-round: dropped everywhere
    logs = [managers[1].log, managers[2].log, back.log]
    reference = _reference(logs)
    for params in (got[1][1], got[2][1], restarted[0][1]):
        for a, b in zip(params, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got[1][1], restarted[0][1], strict=True))  # bit for bit
    for manager in (back, managers[1], managers[2]):
        manager.close()


# -- agreement and visibility --------------------------------------------------------------------------------------


def _managers(store: Any, world: int, settings: list[dict], **kwargs: Any) -> list[Manager]:
    lines: list[str] = []
    return [Manager(store, r, world, settings=settings[r], report=lines.append, **kwargs) for r in range(world)]


def _in_threads(work: dict[int, Any]) -> dict[int, Any]:
    out: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = work[rank]()
        except Exception as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_ranks_whose_settings_differ_are_refused_at_the_first_round_naming_the_setting_and_the_ranks():
    store = dist.HashStore()
    settings = [{"--lr": 0.05, "--seed": 1}, {"--lr": 0.2, "--seed": 1}, {"--lr": 0.05, "--seed": 1}]
    managers = _managers(store, 3, settings, start_timeout=20)
    out = _in_threads({r: managers[r].start for r in range(3)})
    for rank in range(3):
        assert isinstance(out[rank], RanksDisagree), out
        assert "--lr: 0.05 on ranks 0, 2; 0.2 on rank 1" in str(out[rank]), out[rank]


@dataclasses.dataclass
class Recipe:
    lr: float
    layers: tuple[int, ...]


def test_settings_compare_by_value_dataclasses_sets_and_tensors_of_any_size():
    """Values whose text was their type's name (a dataclass, a set, a tensor past 16 elements) compared equal
    whatever they held: two ranks with different recipes trained together. They are compared by value now."""
    weights = torch.zeros(100)
    other = weights.clone()
    other[57] = 1e-6
    cases = [
        ({"recipe": Recipe(0.1, (2, 3))}, {"recipe": Recipe(0.2, (2, 3))}, "recipe: Recipe(lr=0.1"),
        ({"tags": {"a", "b"}}, {"tags": {"a", "c"}}, "tags: {'a', 'b'} on rank 0"),
        ({"init": weights}, {"init": other}, "init: tensor(100,) float32 sha256"),
    ]
    for first, second, named in cases:
        managers = _managers(dist.HashStore(), 2, [first, second], start_timeout=20)
        out = _in_threads({r: managers[r].start for r in range(2)})
        for rank in range(2):
            assert isinstance(out[rank], RanksDisagree) and named in str(out[rank]), out[rank]
    same = _managers(dist.HashStore(), 2, [{"recipe": Recipe(0.1, (2,))}, {"recipe": Recipe(0.1, (2,))}])
    out = _in_threads({r: same[r].start for r in range(2)})
    assert all(q.members == [0, 1] for q in out.values()), out


def test_a_setting_that_cannot_be_compared_is_refused_naming_it():
    with pytest.raises(CannotCompare, match="the setting 'loader': a object cannot be compared across processes"):
        Manager(dist.HashStore(), 0, 2, settings={"loader": object()}, report=None)
    manager = Manager(dist.HashStore(), 0, 1, report=None, start_timeout=1)
    manager.require_same({"optimizer 0 group 0 lr": 0.1})
    with pytest.raises(ValueError, match="given already"):
        manager.require_same({"optimizer 0 group 0 lr": 0.2})
    manager.start_round()
    with pytest.raises(RuntimeError, match="before the first start_round"):
        manager.require_same({"late": 1})
    manager.close()


def test_a_replica_whose_optimizer_alone_sets_another_lr_is_refused():
    """The Lightning and Fabric strategies add every optimizer's hyper-parameters to the manager's settings
    (`optimizer_settings`): replica 1 silently took replica 0's lr when lr was set only in its optimizer."""
    params = [torch.nn.Parameter(torch.zeros(2))]
    settings = [optimizer_settings([torch.optim.SGD(params, lr=lr, momentum=0.9)]) for lr in (0.1, 0.3)]
    managers = _managers(dist.HashStore(), 2, settings, start_timeout=20)
    out = _in_threads({r: managers[r].start for r in range(2)})
    for rank in range(2):
        assert isinstance(out[rank], RanksDisagree), out[rank]
        assert "optimizer 0 group 0 lr: 0.1 on rank 0; 0.3 on rank 1" in str(out[rank]), out[rank]


def test_a_rank_given_another_world_size_is_refused_like_the_others_before_any_connection():
    """Rank 2 believes the job has 4 ranks. Every rank, rank 2 included, is refused naming max_world, as soon as
    round 0's members are decided (the one that differed got a raw connection error while the others stopped)."""
    store = dist.HashStore()
    managers = [Manager(store, r, 4 if r == 2 else 3, start_timeout=3, quorum_timeout=1, report=None) for r in range(3)]
    out = _in_threads({r: managers[r].start for r in range(3)})
    for rank in range(3):
        assert isinstance(out[rank], RanksDisagree), out[rank]
        assert "max_world: 3 on ranks 0, 1; 4 on rank 2" in str(out[rank]), out[rank]
        assert managers[rank].quorum is None  # refused before its group was made


def test_a_joiner_whose_settings_differ_is_refused_before_it_takes_part():
    store = dist.HashStore()
    good = {"--lr": 0.05, "model parameter 0": "w: shape (4, 2)"}
    managers = _managers(store, 2, [good, good], start_timeout=20, quorum_timeout=1)
    out = _in_threads({0: lambda: managers[0].start_round(), 1: lambda: managers[1].start_round()})
    assert all(q.members == [0, 1] for q in out.values()), out
    stranger = Manager(store, 1, 2, settings={**good, "--lr": 0.2}, quorum_timeout=1, report=None)
    with pytest.raises(RanksDisagree, match=r"rank 1 may not join.*--lr: 0.05 in the job, 0.2 on rank 1"):
        stranger.start_round()
    assert not store.check(["ddpkit/ft/r3/joiners"]) and not store.check(["ddpkit/ft/r2/joiners"])


def test_a_rank_that_never_starts_is_named_on_every_member_and_training_goes_on():
    store, lines = dist.HashStore(), []
    managers = [Manager(store, r, 3, start_timeout=1, quorum_timeout=1, report=lines.append) for r in range(2)]
    out = _in_threads({r: managers[r].start_round for r in range(2)})
    assert all(q.members == [0, 1] for q in out.values()), out
    assert managers[0].never_joined == managers[1].never_joined == [2]
    assert sorted(lines) == [f"ddpkit: rank {r}: rank 2 never joined: training with 2 of 3" for r in range(2)]


def test_gradients_averaged_in_buckets_while_backward_runs_equal_the_mean_gradient():
    """Several buckets (a tiny bucket size), a parameter that backward never reaches (it sends zeros, as DDP with
    find_unused_parameters), every bucket's average in its own parameters: the mean of the ranks' gradients."""
    store = dist.HashStore()
    with SEEDING:
        torch.manual_seed(3)
        models = [MyModel(seed=3) for _ in range(2)]
    for model in models:
        model.unused = nn.Linear(2, 2)  # never in forward
    inputs = [batch(0, r) for r in range(2)]
    want = []
    for rank, model in enumerate(models):
        model.zero_grad()
        loss_fn(model(inputs[rank][0]), inputs[rank][1]).backward()
        want.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    mean = [(a + b) / 2 for a, b in zip(*want, strict=True)]
    managers = [Manager(store, r, 2, quorum_timeout=5, start_timeout=10, report=None) for r in range(2)]

    def step(rank: int) -> list[torch.Tensor]:
        manager, model = managers[rank], models[rank]
        manager.overlap_gradients(model.parameters(), bucket_mb=4 / 2**20)  # 4 bytes: a bucket per tensor
        assert len(manager._buckets.buckets) > 3, manager._buckets.buckets
        manager.start_round()
        loss_fn(model(inputs[rank][0]), inputs[rank][1]).backward()
        manager.average_gradients(model.parameters())
        assert manager.should_commit()
        return [p.grad for p in model.parameters()]

    got = _in_threads({r: lambda r=r: step(r) for r in range(2)})
    assert all(isinstance(g, list) for g in got.values()), got
    for rank in range(2):
        for a, b in zip(got[rank], mean, strict=True):
            torch.testing.assert_close(a, b)


def test_the_store_keeps_a_bounded_number_of_rounds():
    store = dist.HashStore()
    managers = [Manager(store, r, 2, quorum_timeout=2, start_timeout=10, report=None) for r in range(2)]

    def loop(manager: Manager) -> None:
        for _ in range(40):
            manager.start_round()
            manager.average(torch.ones(3))
            assert manager.should_commit()

    _in_threads({r: lambda r=r: loop(managers[r]) for r in range(2)})
    time.sleep(0.5)  # the deletions run beside training
    assert not store.check(["ddpkit/ft/r3/members"]) and not store.check(["ddpkit/ft/r3/in/0"])
    assert store.check(["ddpkit/ft/r40/members"])
    assert store.num_keys() < 90, store.num_keys()  # 40 rounds kept would be about 280


def test_too_few_ranks_end_every_member_with_the_minimum_named():
    store = dist.HashStore()
    manager = Manager(store, 0, 2, min_replicas=2, start_timeout=0.5, quorum_timeout=0.5, report=None)
    with pytest.raises(TooFewReplicas, match="fewer than min_replicas=2"):
        manager.start_round()


def test_manager_arguments_are_checked():
    manager = Manager(dist.HashStore(), 0, 2, report=None)
    manager.register("model", nn.Linear(2, 2))
    with pytest.raises(ValueError, match="'model' is registered already"):
        manager.register("model", nn.Linear(2, 2))
    with pytest.raises(TypeError, match="'step' has no state_dict"):
        manager.register("step", 3)
    with pytest.raises(ValueError, match="lacks \\['model'\\]"):
        manager.load_live_state({})
    with pytest.raises(RuntimeError, match="no round is open"):
        manager.should_commit()


def test_a_sharded_optimizer_is_refused_by_name_at_register():
    """An OSS's state is split over a process group: registered whole it failed at the first heal (its
    state_dict() needs consolidation); it is refused at `register`, saying what to register instead."""
    from ddpkit.optim import OSS

    store = dist.HashStore()
    manager = Manager(store, 0, 1, quorum_timeout=1, report=None)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"'optimizer' is a sharded optimizer \(OSS\).*optimizer.optim"):
        manager.register("optimizer", OSS.__new__(OSS))
    manager.register("optimizer", torch.optim.SGD(model.parameters(), lr=0.1))  # a plain one is taken


def test_finish_tells_the_store_the_job_is_over_and_a_late_rank_is_told_so():
    """Two ranks run two rounds and `finish()`: the store's watcher (what `ddpkit store` runs) returns "finished"
    at once, and a rank started afterwards raises `JobFinished` instead of waiting to join. `finish()` before any
    committed round is refused."""
    from ddpkit.fault_tolerance import job_store
    from ddpkit.fault_tolerance.membership import JobFinished

    store = dist.HashStore()
    early = Manager(store, 0, 2, quorum_timeout=5, report=None)
    with pytest.raises(RuntimeError, match="after the job's last committed round"):
        early.finish()
    errors: list[BaseException] = []

    def replica(rank: int) -> None:
        try:
            manager = early if rank == 0 else Manager(store, rank, 2, quorum_timeout=5, report=None)
            model = MyModel()
            manager.register("model", model)
            for _ in range(2):
                manager.start_round()
                manager.average_gradients([])
                assert manager.should_commit()
            manager.finish()
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert job_store.wait_until_finished(store, start_timeout=1) == "finished"
    late = Manager(store, 1, 2, quorum_timeout=5, report=None)
    with pytest.raises(JobFinished) as finished:
        late.start_round()
    assert "on a fresh store" in str(finished.value) and "another --master-port" in str(finished.value)


def test_with_a_job_secret_every_store_value_is_tagged_and_a_heal_still_equals_the_reference():
    """The README loop with rank 2 late, every rank's store a SignedStore over one HashStore: the job trains as
    without a secret (the reference), the joiner is healed from a tagged payload, and the rounds' keys in the store
    carry tags (read raw, a decision is not plain JSON)."""
    from ddpkit.fault_tolerance.job_secret import MARK, SignedStore

    raw = dist.HashStore()
    results, managers = _run(3, late={2: 6}, client=lambda: SignedStore(raw, b"a secret of 16 bytes or more"))
    assert {rank: results[rank][0] for rank in range(3)} == {0: "done", 1: "done", 2: "done"}, results
    assert managers[2].rejoined == 1
    reference = _reference([managers[r].log for r in range(3)])
    for rank in range(3):
        for got, want in zip(results[rank][1], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert raw.get("ddpkit/ft/latest").startswith(MARK) and raw.get("ddpkit/ft/settings").startswith(MARK)


def test_the_library_and_the_command_share_the_quorum_timeout_default():
    """`Manager()` and `ddpkit train --fault-tolerant` wait for a missing rank equally long unless told otherwise."""
    import inspect

    from ddpkit.fault_tolerance.membership import Membership
    from ddpkit.train.settings.config import TrainConfig

    for cls in (Manager, Membership):
        assert inspect.signature(cls).parameters["quorum_timeout"].default == TrainConfig.quorum_timeout, cls
