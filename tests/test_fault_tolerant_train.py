"""`ddpkit train --fault-tolerant`: the survivors of a lost rank train on, and the rank started again
rejoins from their live state.

References, written apart from the code under test: without failures a fault-tolerant run must train exactly as
torch DDP (``--strategy ddp``), SlowMo (``--strategy slowmo``) and SGP (``--slowmo-base sgp``) do with the same
flags; with a failure, every replica must end bit-identical, the survivor must never stop (every step once in its
steps.csv), and the membership it records must name who left and who came back. The library-level rounds are
checked against a one-process simulation of the membership schedule in tests/test_membership.py.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import warm_processes
from test_train_cli import DDPKIT, _env, _proc_table, descendants, procs  # noqa: F401  (fixture)

from ddpkit.distributed.launch import free_port
from ddpkit.distributed.local_processes import RANK_NAME_PREFIX
from ddpkit.train.settings.config import TrainConfig, validate

HERE = Path(__file__).resolve().parent
ENV = _env(PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
SHORT = ["--epochs", "1", "--max-steps", "30", "--batch-size", "16", "--no-progress", "--timeout", "60"]
SLOW_RUN = ["--model", "ft_factories:slow_mlp", "--epochs", "20", "--batch-size", "16", "--lr", "0.01"]
SLOW_RUN += ["--no-progress", "--quorum-timeout", "2", "--timeout", "60"]


def _steps(out: Path) -> list[dict[str, str]]:
    with open(out / "steps.csv") as f:
        return list(csv.DictReader(f))


def _summary(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())["summary"]


def _latest_round(store: dist.TCPStore) -> int:
    return int(store.get("ddpkit/ft/latest")) if store.check(["ddpkit/ft/latest"]) else -1


def _wait_for_round(store: dist.TCPStore, round_: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _latest_round(store) < round_:
        assert time.monotonic() < deadline, f"the job did not reach round {round_} within {timeout:.0f} s"
        time.sleep(0.05)


def _store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=90))


def _node(procs, port: int, rank: int, nodes: int, out: Path, *flags: str, name: str, env=None):  # noqa: F811
    where = ["--nnodes", str(nodes), "--nproc-per-node", "1", "--node-rank", str(rank)]
    where += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    return procs([*DDPKIT, "train", "--fault-tolerant", *where, *flags, "--out", out], name, env=env or ENV)


@pytest.mark.slow
def test_without_failures_it_trains_exactly_as_ddp_slowmo_sgp_compressed_diloco_and_fp16(tmp_path, procs):  # noqa: F811
    slowmo = ["--strategy", "slowmo", "--optimizer", "sgd", "--lr", "0.05"]
    runs = {"ddp": ["--strategy", "ddp", "--lr", "0.01"], "slowmo": [*slowmo, "--localsgd-frequency", "3"]}
    runs["slowmo"] += ["--slowmo-frequency", "6"]
    runs["sgp"] = [*slowmo, "--slowmo-base", "sgp", "--slowmo-frequency", "6"]
    runs["diloco-int8"] = ["--strategy", "slowmo", "--optimizer", "adamw", "--lr", "0.01", "--localsgd-frequency", "4"]
    runs["diloco-int8"] += ["--slowmo-frequency", "4", "--slowmo-nesterov", "--slowmo-momentum", "0.9"]
    runs["diloco-int8"] += ["--slowmo-compression", "int8", "--slowmo-error-feedback", "--slowmo-fragments", "2"]
    runs["ddp-fp16"] = ["--strategy", "ddp", "--lr", "0.01", "--amp", "fp16"]  # torch's loss scaler on each rank
    for name, flags in runs.items():
        plain = procs([*DDPKIT, "train", *flags, *SHORT, "--out", tmp_path / name], name, env=ENV)
        ft = procs(
            [*DDPKIT, "train", "--fault-tolerant", *flags, *SHORT, "--out", tmp_path / f"{name}-ft"],
            f"{name}-ft",
            env=ENV,
        )
        for proc in (plain, ft):
            result = proc.wait(180)
            assert result.returncode == 0, result
        reference, tolerant = _steps(tmp_path / name), _steps(tmp_path / f"{name}-ft")
        assert len(reference) == len(tolerant) == 30
        for a, b in zip(reference, tolerant, strict=True):
            assert float(b["loss"]) == pytest.approx(float(a["loss"]), abs=1e-6), (name, a, b)
            assert b["members"] == "2" and b["membership_change"] == ""
        expected, got = _summary(tmp_path / name), _summary(tmp_path / f"{name}-ft")
        assert got["test_loss"] == pytest.approx(expected["test_loss"], abs=1e-6), name
        assert got["fp16_skipped_steps"] == expected["fp16_skipped_steps"], name  # None without fp16
        assert got["replicas_equal"] and got["membership"] == [] and got["final_members"] == [0, 1]
        assert got["strategy"] == f"{flags[1]} (fault-tolerant)" and got["settings"]["fault_tolerant"] is True
        # the same exchange, plus the count each average carries: 4 bytes more per all-reduce's payload
        assert got["sent_bytes_total"] == pytest.approx(expected["sent_bytes_total"], rel=1e-3), name
    # checkpoints: 20 steps saving every 10, then --resume to 30 goes on exactly as the uninterrupted DDP run
    out = tmp_path / "ddp-resumed"
    for extra in (["--max-steps", "20", "--checkpoint-every", "10"], ["--resume"]):
        result = procs(
            [*DDPKIT, "train", "--fault-tolerant", *runs["ddp"], *SHORT, *extra, "--out", out],
            f"resume{len(extra)}",
            env=ENV,
        ).wait(180)
        assert result.returncode == 0, result
    assert "resuming from step 20" in result.stderr, result.stderr
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["step-00000010", "step-00000020"]
    resumed, reference = _steps(out), _steps(tmp_path / "ddp")
    assert [int(r["step"]) for r in resumed] == list(range(30))
    for a, b in zip(reference[20:], resumed[20:], strict=True):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), abs=1e-6), (a, b)
    assert _summary(out)["test_loss"] == pytest.approx(_summary(tmp_path / "ddp")["test_loss"], abs=1e-6)


DDP = ["--strategy", "ddp"]
LOSS_BOUND = 15
"""Seconds within which a lost rank must be dropped with SLOW_RUN's --quorum-timeout 2: room for a machine at load
15, a quarter of its --timeout 60 (the bound the quorum timeout exists to beat)."""
SGP = ["--strategy", "slowmo", "--slowmo-base", "sgp", "--slowmo-frequency", "12"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [DDP, SGP], ids=["ddp", "sgp"])
def test_a_lost_rank_is_dropped_and_its_restart_rejoins_from_live_state(tmp_path, procs, strategy):  # noqa: F811
    """Per step: DDP's gradient average, and SGP's gossip (its last round averages exactly: replicas end equal)."""
    port = free_port()
    flags = [*strategy, *SLOW_RUN, "--max-steps", "360"]
    hold = tmp_path / "hold"  # (tests/ft_factories.py: training waits while it exists)
    env = {**ENV, "DDPKIT_TEST_HOLD_FILE": str(hold)}
    survivor = _node(procs, port, 0, 2, tmp_path / "a", *flags, name="node0", env=env)
    lost = _node(procs, port, 1, 2, tmp_path / "b", *flags, name="node1", env=env)
    store = _store(port)
    _wait_for_round(store, 40, 120)
    lost.kill()  # SIGKILL to node 1's launcher and rank: its machine is gone
    killed_at = _latest_round(store)
    wait_until_dropped(store, 1, 60)
    hold.touch()  # the survivor cannot finish before the restart (slow on a loaded machine) joins
    back = _node(procs, port, 1, 2, tmp_path / "b2", *flags, name="node1-again", env=env)
    wait_for_output(back, JOINING, 180)
    hold.unlink()
    for proc in (survivor, back):
        result = proc.wait(240)
        assert result.returncode == 0, result
    assert "joins the fault-tolerant job under way" in back.result().stderr
    summary = _summary(tmp_path / "a")
    events = summary["membership"]
    left = [e for e in events if e["left"] == [1]]
    joined = [e for e in events if e["joined"] == [1]]
    assert len(left) == 1 and len(joined) == 1, events
    assert killed_at - 2 <= left[0]["round"] <= killed_at + 3, (killed_at, events)
    # the loss cost one --quorum-timeout (2 s) plus what a loaded machine adds, never --timeout (60 s)
    assert left[0]["waited_seconds"] < LOSS_BOUND, events
    # what the change held training up: the failed step's commit and the next quorum, a --quorum-timeout each
    assert 1.5 < sum(e["blocked_seconds"] for e in events) < 2 * LOSS_BOUND, events
    assert joined[0]["round"] > left[0]["round"] and joined[0]["members"] == [0, 1]
    failed = [e for e in events if e["committed"] is False]
    # at most the step during which rank 1 died and the next one, whose quorum (formed in the background while
    # that step computed) may still have counted it: each dropped on every member
    assert len(failed) <= 2, events
    assert summary["final_members"] == [0, 1] and summary["replicas_equal"], summary["parameter_digests"]
    # the two commands found each other on this machine through the store and split its cores
    assert summary["settings"]["threads_per_rank"] == max(1, len(os.sched_getaffinity(0)) // 2)
    rows = _steps(tmp_path / "a")
    assert [int(r["step"]) for r in rows] == list(range(360))  # the survivor never stopped nor restarted
    members = [int(r["members"]) for r in rows]
    assert members[0] == 2 and members[-1] == 2 and 1 in members
    assert {r["membership_change"] for r in rows} == {"", "-1", "+1"}
    assert summary["test_accuracy"] > 0.85


@pytest.mark.slow
def test_ranks_that_disagree_are_refused_and_a_rank_that_never_starts_is_named(tmp_path, procs):  # noqa: F811
    """Two jobs side by side: in one, rank 1 has another --lr (every rank is refused at the first round, naming
    the flag and the ranks); in the other, the third rank of --world-size 3 never starts (the others train, say
    so on stdout as it happens and record it)."""
    flags = ["--strategy", "slowmo", *SLOW_RUN, "--max-steps", "20"]
    port_a, port_b = free_port(), free_port()
    a = [
        _node(procs, port_a, r, 2, tmp_path / f"a{r}", *flags, *(["--lr", "0.2"] if r else []), name=f"a{r}")
        for r in range(2)
    ]
    # (--timeout also bounds how long rank 0 waits for rank 1 to start: room for a loaded machine)
    b = [_node(procs, port_b, r, 3, tmp_path / f"b{r}", *flags, "--timeout", "15", name=f"b{r}") for r in range(2)]
    for proc in a:
        result = proc.wait(120)
        assert result.returncode == 1, result
        assert "ranks disagree on their settings: --lr: 0.01 on rank 0; 0.2 on rank 1" in result.stderr, result
    for proc in b:
        result = proc.wait(120)
        assert result.returncode == 0, result
    assert "rank 2 never joined: training with 2 of 3" in b[0].result().stdout
    summary = _summary(tmp_path / "b0")
    assert summary["never_joined"] == [2] and summary["trained_ranks"] == [0, 1], summary
    assert "ranks 0, 1 trained (2 never joined)" in b[0].result().stdout


def _children(pid: int) -> list[int]:
    """`pid`'s child processes, without the tests' spare fork server (`warm_processes.SPARE_NAME`)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    children = [int(c) for c in path.read_text().split()] if path.exists() else []
    return [c for c in children if not warm_processes.is_spare(c)]


def _wait_for_worker(agent: int, other_than: int | None, timeout: float) -> int:
    """The pid of torchrun `agent`'s worker (a new one when `other_than` is the old one's)."""
    deadline = time.monotonic() + timeout
    while True:
        workers = [c for c in _children(agent) if c != other_than]
        if workers:
            return workers[0]
        assert time.monotonic() < deadline, "torchrun started no worker"
        time.sleep(0.1)


@pytest.mark.slow
def test_under_torchrun_a_lost_worker_is_restarted_by_torchrun_and_rejoins(tmp_path, procs):  # noqa: F811
    """One torchrun per machine (--nnodes 1 --max-restarts 1) meeting at `ddpkit store`: torchrun starts the killed
    worker again, it rejoins from live state; the other machine's worker never stops."""
    port = free_port()
    store_proc = procs([*DDPKIT, "store", "--port", str(port), "--timeout", "60"], "store", env=ENV)
    flags = ["--strategy", "ddp", *SLOW_RUN, "--max-steps", "300", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    flags += ["--master-port", str(port)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    torchrun += ["--max-restarts", "1", "-m", "ddpkit", "train", "--fault-tolerant", *flags]
    hold = tmp_path / "hold"  # (tests/ft_factories.py: training waits while it exists)
    env = {**ENV, "DDPKIT_TEST_HOLD_FILE": str(hold)}
    agents = [
        procs([*torchrun, "--node-rank", str(k), "--out", tmp_path / f"m{k}"], f"torchrun{k}", env=env)
        for k in range(2)
    ]
    store = _store(port)
    _wait_for_round(store, 40, 120)
    worker = _wait_for_worker(agents[1].popen.pid, None, 10)
    os.kill(worker, signal.SIGKILL)  # the worker only: its torchrun starts it again
    hold.touch()  # machine 0 cannot finish before the restarted worker (a cold start, slow at load) joins
    _wait_for_worker(agents[1].popen.pid, worker, 60)
    wait_for_output(agents[1], JOINING, 180)
    hold.unlink()
    for proc in (*agents, store_proc):
        result = proc.wait(240)
        assert result.returncode == 0, result
    assert "joins the fault-tolerant job under way" in agents[1].result().stderr
    summary = _summary(tmp_path / "m0")
    # torchrun starts the worker again within about --quorum-timeout: it may be back before it is dropped
    assert [e["left"] for e in summary["membership"] if e["left"]] in ([[1]], []), summary["membership"]
    assert [e["joined"] for e in summary["membership"] if e["joined"]] == [[1]], summary["membership"]
    assert summary["final_members"] == [0, 1] and summary["replicas_equal"], summary["parameter_digests"]
    assert [int(r["step"]) for r in _steps(tmp_path / "m0")] == list(range(300))
    assert "its store stops" in store_proc.result().stderr


def test_fault_tolerant_torchrun_across_machines_or_without_a_store_is_refused():
    from ddpkit.distributed.launch import Placement
    from ddpkit.train.loop.launcher import fault_tolerant_under_torchrun

    cfg = TrainConfig(fault_tolerant=True, strategy="ddp", nnodes=2, node_rank=1, master_port=29511)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        with pytest.raises(ValueError, match="needs one torchrun per machine"):
            fault_tolerant_under_torchrun(cfg, Placement(1, 2, 0, "10.0.0.1", 29400))
        with pytest.raises(ValueError, match="start `ddpkit store --port P`"):
            fault_tolerant_under_torchrun(TrainConfig(fault_tolerant=True, nnodes=2), Placement(0, 1, 0, "h", 1))
        cfg, placement = fault_tolerant_under_torchrun(cfg, Placement(0, 1, 0, "127.0.0.1", 29400))
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    assert (placement.rank, placement.world_size, placement.master_port) == (1, 2, 29511) and cfg.nproc_per_node == 1


def _rank_processes(launcher: int) -> list[int]:
    """The ranks a `ddpkit train` launcher started (named ddpkit-local-N: not its fork server or resource tracker)."""
    table = _proc_table()
    return [p for p in descendants(launcher, table) if table[p][4].startswith(RANK_NAME_PREFIX)]


def test_when_every_rank_is_gone_node_0s_launcher_ends_within_the_heartbeat_silence(tmp_path, procs):  # noqa: F811
    """Node 0's launcher hosts the store for the other machines' ranks; once no rank anywhere is alive (here: its
    own rank and the other machine killed) it ends with an error within the heartbeat silence (20 s), instead of
    waiting for a round that never comes."""
    port = free_port()
    flags = ["--strategy", "ddp", *SLOW_RUN, "--max-steps", "2000"]
    node0 = _node(procs, port, 0, 2, tmp_path / "a", *flags, name="node0")
    node1 = _node(procs, port, 1, 2, tmp_path / "b", *flags, name="node1")
    _wait_for_round(_store(port), 20, 120)
    node1.kill()
    for rank in _rank_processes(node0.popen.pid):
        os.kill(rank, signal.SIGKILL)
    killed = time.monotonic()
    result = node0.wait(60)
    assert result.returncode == 1, result
    assert 15 < time.monotonic() - killed < 20 + 15, result  # the silence, then the exit
    assert "process 0 terminated with signal SIGKILL" in result.stderr, result
    assert "no rank of the job was left: no heartbeat for 20 s" in result.stderr, result


@pytest.mark.slow
def test_fewer_live_ranks_than_min_replicas_end_the_job_with_a_clear_error(tmp_path, procs):  # noqa: F811
    port = free_port()
    flags = ["--strategy", "ddp", *SLOW_RUN, "--max-steps", "2000", "--min-replicas", "2"]
    survivor = _node(procs, port, 0, 2, tmp_path / "a", *flags, name="node0")
    lost = _node(procs, port, 1, 2, tmp_path / "b", *flags, name="node1")
    _wait_for_round(_store(port), 20, 120)
    lost.kill()
    killed = time.monotonic()
    result = survivor.wait(60)
    assert result.returncode == 1, result
    assert "fewer than min_replicas=2" in result.stderr and "--min-replicas 2" in result.stderr, result
    # two quorum timeouts, three more waiting for a rank to come back, and the processes' exit
    assert time.monotonic() - killed < 2 * 2 + 3 * 2 + 15


@pytest.mark.slow
def test_four_ranks_lose_two_at_once_and_get_them_back_with_slowmo(tmp_path, procs):  # noqa: F811
    port = free_port()
    flags = ["--strategy", "slowmo", "--localsgd-frequency", "4", "--slowmo-frequency", "8", *SLOW_RUN]
    flags += ["--max-steps", "400"]
    hold = tmp_path / "hold"  # (tests/ft_factories.py: training waits while it exists)
    env = {**ENV, "DDPKIT_TEST_HOLD_FILE": str(hold)}
    nodes = [_node(procs, port, r, 4, tmp_path / f"n{r}", *flags, name=f"node{r}", env=env) for r in range(4)]
    store = _store(port)
    _wait_for_round(store, 10, 180)
    nodes[2].kill()
    nodes[3].kill()
    wait_until_dropped(store, 2, 60)
    hold.touch()  # the survivors cannot finish before the restarted ranks (slow on a loaded machine) join
    back = [_node(procs, port, r, 4, tmp_path / f"n{r}-again", *flags, name=f"node{r}-again", env=env) for r in (2, 3)]
    for proc in back:
        wait_for_output(proc, JOINING, 180)
    hold.unlink()
    for proc in (nodes[0], nodes[1], *back):
        result = proc.wait(300)
        assert result.returncode == 0, result
    summary = _summary(tmp_path / "n0")
    events = summary["membership"]
    assert any(e["left"] == [2, 3] for e in events), events
    assert {r for e in events for r in e["joined"]} == {2, 3}, events
    assert summary["final_members"] == [0, 1, 2, 3] and summary["replicas_equal"]
    assert [int(r["step"]) for r in _steps(tmp_path / "n0")] == list(range(400))


def _machine(procs, port: int, node: int, out: Path, *flags: str, name: str, env=None):  # noqa: F811
    """Machine `node` of two, its two processes one replica sharding the optimizer state (HSDP's shape)."""
    where = ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node)]
    where += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    return procs([*DDPKIT, "train", "--fault-tolerant", *where, *flags, "--out", out], name, env=env or ENV)


def wait_for_output(proc, text: str, timeout: float) -> None:
    """Waits until `proc` (a running command) has printed `text`; fails if it ends first or the time runs out."""
    deadline = time.monotonic() + timeout
    while text not in proc.out_path.read_text() + proc.err_path.read_text():
        if proc.popen.poll() is not None:
            pytest.fail(f"{proc.name} ended without printing {text!r}:\n{proc.result()}")
        assert time.monotonic() < deadline, f"{proc.name} did not print {text!r} within {timeout:.0f} s"
        time.sleep(0.1)


JOINING = "joins the fault-tolerant job under way"


def wait_until_dropped(store: dist.Store, replica: int, timeout: float) -> None:
    """Waits until the job's latest round no longer has `replica` among its members (the others noticed the loss);
    `store` is the job's (a TCPStore or an EtcdStore)."""
    deadline = time.monotonic() + timeout
    while True:
        key = f"ddpkit/ft/r{_latest_round(store)}/members"
        with contextlib.suppress(dist.DistStoreError):  # a round's keys are deleted a few rounds later
            if store.check([key]) and replica not in json.loads(store.get(key)):
                return
        assert time.monotonic() < deadline, f"the job still counted replica {replica} after {timeout:.0f} s"
        time.sleep(0.05)


SHARDED = ["--strategy", "sharded", "--optimizer", "adam"]


@pytest.mark.slow
def test_sharded_replicas_of_two_machines_train_as_plain_sharded_training(tmp_path, procs):  # noqa: F811
    """Two machines of two processes each (ZeRO-2 inside a machine, fault tolerance across machines) against
    plain ``--strategy sharded --nproc-per-node 4`` (the same four data shards): the same step losses (float
    rounding apart: a mean of two means), the same held-out loss; each machine's processes hold one shard each."""
    port = free_port()
    plain = procs(
        [*DDPKIT, "train", *SHARDED, *SHORT, "--nproc-per-node", "4", "--out", tmp_path / "plain"], "plain", env=ENV
    )
    machines = [_machine(procs, port, n, tmp_path / f"m{n}", *SHARDED, *SHORT, name=f"m{n}") for n in range(2)]
    for proc in (plain, *machines):
        result = proc.wait(180)
        assert result.returncode == 0, result
    reference, tolerant = _steps(tmp_path / "plain"), _steps(tmp_path / "m0")
    assert len(reference) == len(tolerant) == 23  # (one epoch of digits at 4 x 16 per step)
    for a, b in zip(reference, tolerant, strict=True):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), abs=1e-5), (a, b)
        assert b["members"] == "2"
    expected, got = _summary(tmp_path / "plain"), _summary(tmp_path / "m0")
    assert got["test_loss"] == pytest.approx(expected["test_loss"], abs=1e-5)
    assert got["strategy"] == "sharded (fault-tolerant)" and got["final_members"] == [0, 1]
    assert got["replicas_equal"] and got["membership"] == []
    assert not (tmp_path / "m1" / "metrics.json").exists()  # one writer
    # Adam's state (two fp32 moments per element and a 4-byte step per tensor) split over each machine's two
    # processes as OSS's documented rule does: largest tensor first, to the least-loaded process
    sizes = sorted([64 * 256, 256, 256 * 256, 256, 256 * 10, 10], reverse=True)  # the digits MLP's parameters
    assert sum(sizes) == expected["settings"]["parameters"]
    loads = [0, 0]
    for size in sizes:
        loads[loads.index(min(loads))] += 8 * size + 4
    for machine in got["optimizer_state_bytes"]:
        assert sorted(machine) == sorted(loads), got["optimizer_state_bytes"]


@pytest.mark.slow
def test_a_lost_machine_of_sharded_replicas_restarts_and_every_process_rejoins(tmp_path, procs):  # noqa: F811
    port = free_port()
    flags = [*SHARDED, *SLOW_RUN, "--max-steps", "240", "--quorum-timeout", "3"]
    hold = tmp_path / "hold"  # (tests/ft_factories.py: training waits while it exists)
    env = {**ENV, "DDPKIT_TEST_HOLD_FILE": str(hold)}
    survivor = _machine(procs, port, 0, tmp_path / "a", *flags, name="machine0", env=env)
    lost = _machine(procs, port, 1, tmp_path / "b", *flags, name="machine1", env=env)
    store = _store(port)
    _wait_for_round(store, 30, 120)
    lost.kill()  # SIGKILL to machine 1's launcher: its two processes end with it
    wait_until_dropped(store, 1, 60)
    hold.touch()  # the survivor cannot finish its 240 steps before the restart (slow on a loaded machine) joins
    back = _machine(procs, port, 1, tmp_path / "b2", *flags, name="machine1-again", env=env)
    wait_for_output(back, JOINING, 180)
    hold.unlink()
    for proc in (survivor, back):
        result = proc.wait(240)
        assert result.returncode == 0, result
    summary = _summary(tmp_path / "a")
    events = summary["membership"]
    assert [e["left"] for e in events if e["left"]] == [[1]], events
    assert [e["joined"] for e in events if e["joined"]] == [[1]], events
    assert summary["final_members"] == [0, 1] and summary["replicas_equal"], summary["parameter_digests"]
    assert [int(r["step"]) for r in _steps(tmp_path / "a")] == list(range(240))  # the survivor never stopped
    assert summary["test_accuracy"] > 0.8


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"strategy": "sharded", "checkpoint_every": 5}, "--checkpoint-every / --resume with --strategy oss or"),
        ({"strategy": "oss", "amp": "fp16"}, "does not combine with --amp fp16 with --strategy oss or sharded"),
        ({"strategy": "sharded", "min_replicas": 2}, "--min-replicas must be in [1, 1] (the machines (--nnodes 1)"),
        ({"adascale": True, "optimizer": "sgd"}, "does not combine with --adascale"),
        ({"slowmo_sync_delay": 1, "strategy": "slowmo"}, "does not combine with --slowmo-sync-delay"),
        ({"slowmo_base": "sgp", "overlap": True, "strategy": "slowmo"}, "does not combine with --overlap"),
        ({"slowmo_base": "sgp", "push_sum": False, "strategy": "slowmo"}, "does not combine with --no-push-sum"),
        ({"min_replicas": 3}, "--min-replicas must be in [1, 2] (the world size 2)"),
        ({"quorum_timeout": 0.0}, "--quorum-timeout must be a finite number > 0"),
        ({"job_id": "two words"}, "--job-id must be 1-64 letters, digits, '.', '-' or '_'"),
    ],
)
def test_fault_tolerant_flags_are_checked_before_any_process_starts(flags, message):
    with pytest.raises(ValueError) as error:
        validate(TrainConfig(fault_tolerant=True, strategy=flags.pop("strategy", "ddp"), nproc_per_node=2, **flags))
    assert message in str(error.value)
    with pytest.raises(ValueError, match="--min-replicas and --quorum-timeout need --fault-tolerant"):
        validate(TrainConfig(min_replicas=2, nproc_per_node=2))
    with pytest.raises(ValueError, match="--job-id names a fault-tolerant job in its store: it needs --fault-tolerant"):
        validate(TrainConfig(job_id="alpha", nproc_per_node=2))


def test_a_plain_rank_that_reaches_a_fault_tolerant_jobs_store_is_told_to_add_the_flag(tmp_path):
    """Machine 1 started without --fault-tolerant against a fault-tolerant job's store: it waited its whole
    --timeout for a plain group that never forms; it is told at once what to do. A plain job's store passes."""
    from test_train_cli import run

    from ddpkit.distributed.launch import LaunchError
    from ddpkit.fault_tolerance import job_store

    port = free_port()
    store = job_store.host(port, 30)
    with pytest.raises(LaunchError, match="is a fault-tolerant job: start this machine with --fault-tolerant"):
        job_store.refuse_plain_rank("127.0.0.1", port, 5)
    where = ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    result = run([*DDPKIT, "train", *where, "--master-port", str(port), "--timeout", "60"], 60, tmp_path, "plain")
    assert result.returncode == 1 and "start this machine with --fault-tolerant" in result.stderr, result
    assert result.seconds < 30, result
    del store
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job_store.refuse_plain_rank("127.0.0.1", plain.port, 5)  # a plain job's store: nothing to say


def test_a_rank_of_another_job_at_the_same_address_is_refused_by_name(tmp_path):
    """Job beta's machine 1 pointed at the port where job alpha's store listens: it would have joined alpha's
    rounds (same settings) or been refused for settings it never chose; it is told whose store that is."""
    from test_train_cli import run

    from ddpkit.fault_tolerance import job_store

    port = free_port()
    store = job_store.host(port, 30, "alpha")
    where = ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    command = [*DDPKIT, "train", "--fault-tolerant", *where, "--master-port", str(port), *SHORT, "--job-id", "beta"]
    result = run(command, 60, tmp_path, "beta")
    assert result.returncode == 1, result
    assert (
        f"the store at 127.0.0.1:{port} belongs to job 'alpha', and this rank was started for job 'beta'"
        in result.stderr
    ), result
    assert result.seconds < 30, result
    assert store.get(job_store.JOB_KEY) == b"alpha" and not store.check([job_store.PREFIX + "latest"])


def test_a_job_with_a_secret_trains_and_a_rank_without_it_or_with_another_is_refused_by_name(tmp_path, procs):  # noqa: F811
    """Both machines of a job given DDPKIT_JOB_SECRET train as without it (the same losses: tags change no number);
    a third command pointed at that job's store (held in its first steps), without the secret or with another, is
    refused at once, naming the variable."""
    from ddpkit.fault_tolerance.job_secret import SignedStore

    secret, hold = "the job's secret, 32 bytes long", tmp_path / "hold"
    hold.touch()
    flags = [*DDP, *SHORT, "--model", "ft_factories:slow_mlp"]
    env = {**ENV, "DDPKIT_JOB_SECRET": secret, "DDPKIT_TEST_HOLD_FILE": str(hold)}
    port = free_port()
    nodes = [_node(procs, port, r, 2, tmp_path / "signed", *flags, name=f"signed{r}", env=env) for r in range(2)]
    _wait_for_round(SignedStore(_store(port), secret.encode()), 0, 120)  # (a reader with the secret)
    where = ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    command = [*DDPKIT, "train", "--fault-tolerant", *where, "--master-port", str(port), *SHORT]
    for name, env, says in (
        ("without", ENV, "belongs to a job with a secret, and this rank was started without one"),
        (
            "another",
            {**ENV, "DDPKIT_JOB_SECRET": "another secret of 32 bytes long"},
            "was written by a job with another secret, or without one",
        ),
    ):
        result = procs([*command, "--out", tmp_path / name], name, env=env).wait(60)
        assert result.returncode == 1 and says in result.stderr, result
        assert "DDPKIT_JOB_SECRET" in result.stderr and result.seconds < 30, result
    hold.unlink()
    for node in nodes:
        result = node.wait(180)
        assert result.returncode == 0, result
    plain = procs([*DDPKIT, "train", "--fault-tolerant", *flags, "--out", tmp_path / "plain"], "plain", env=ENV)
    assert plain.wait(180).returncode == 0
    for a, b in zip(_steps(tmp_path / "plain"), _steps(tmp_path / "signed"), strict=True):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), abs=1e-6), (a, b)


def test_a_rank_that_finds_no_store_is_told_why_that_may_be():
    """A process started again after its job ended (node 0's store gone) got the transport's raw timeout."""
    from ddpkit.distributed.launch import LaunchError
    from ddpkit.fault_tolerance import job_store

    with pytest.raises(LaunchError, match=r"no fault-tolerant job's store answered at 127\.0\.0\.1:.* it is over"):
        job_store.connect("127.0.0.1", free_port(), 1.0)
