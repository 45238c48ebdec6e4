"""`ddpkit train --fault-tolerant --store etcd://...`: the job's coordination in a real three-member etcd cluster,
so that any machine may be lost, machine 0 included, for per-process replicas and for sharded machines.

References, written apart from the code under test: the survivors must exit 0 and train every step (each step
once in the writer's steps.csv), every replica must end bit-identical (equal parameter digests), exactly one
rank writes the outputs, and the machine started again must rejoin from live state. Without etcd, losing machine
0 must end every survivor with a message naming the lost store and the etcd option, never a rank training alone.
"""

from __future__ import annotations

import csv
import json
import re
import shlex
import time
from pathlib import Path

import pytest
from test_fault_tolerant_train import (
    ENV,
    SLOW_RUN,
    _node,
    _steps,
    _store,
    _summary,
    _wait_for_round,
    wait_until_dropped,
)
from test_train_cli import DDPKIT, procs  # noqa: F401  (fixture)

from ddpkit.distributed.launch import free_port
from ddpkit.fault_tolerance.etcd_store import EtcdStore
from ddpkit.testing.etcd_cluster import etcd_binary
from ddpkit.train.settings.config import TrainConfig, validate


def _etcd_round(store: EtcdStore) -> int:
    return int(store.get("ddpkit/ft/latest")) if store.check(["ddpkit/ft/latest"]) else -1


def _wait_for_etcd_round(store: EtcdStore, round_: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _etcd_round(store) < round_:
        assert time.monotonic() < deadline, f"the job did not reach round {round_} within {timeout:.0f} s"
        time.sleep(0.1)


def _machine(procs, url: str, node: int, nodes: int, per_node: int, out: Path, *flags: str, name: str):  # noqa: F811
    where = ["--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--node-rank", str(node), "--store", url]
    return procs([*DDPKIT, "train", "--fault-tolerant", *where, *flags, "--out", out], name, env=ENV)


LATE_SURVIVOR_ROOM = ["--quorum-timeout", "5"]
"""More time than SLOW_RUN's 2 s for a survivor that notices a lost machine late (seconds after the others, on a
loaded machine) to be in the next round: at 2 s one was left out, and rejoined, in a CI run (the rule working, not
the test's subject). With an etcd member lost too, survivors waited up to 3 s for the lost one in twelve runs
three at once."""


@pytest.mark.slow
def test_machine_0_and_an_etcd_member_lost_the_others_train_on_and_machine_0_comes_back(tmp_path, procs, etcd):  # noqa: F811
    url = etcd.url("cli-ddp")
    flags = ["--strategy", "ddp", *SLOW_RUN, *LATE_SURVIVOR_ROOM, "--max-steps", "400"]
    nodes = [_machine(procs, url, r, 3, 1, tmp_path / f"n{r}", *flags, name=f"node{r}") for r in range(3)]
    watcher = EtcdStore(url)
    _wait_for_etcd_round(watcher, 30, 120)
    nodes[0].kill()  # machine 0: its launcher and its rank (with etcd it hosts nothing of the job's)
    etcd.kill(0)  # and one of the three etcd members
    wait_until_dropped(watcher, 0, 120)  # the others train on without it, then it comes back
    again = _machine(procs, url, 0, 3, 1, tmp_path / "n0-again", *flags, name="node0-again")
    for proc in [*nodes[1:], again]:
        result = proc.wait(180)
        assert result.returncode == 0, result
    summary = _summary(tmp_path / "n1")  # the lowest final member that never rejoined writes the outputs
    assert summary["final_members"] == [0, 1, 2] and summary["replicas_equal"], summary
    assert any(e["left"] == [0] for e in summary["membership"]), summary["membership"]
    assert any(e["joined"] == [0] for e in summary["membership"]), summary["membership"]
    assert [int(r["step"]) for r in _steps(tmp_path / "n1")] == list(range(400))
    assert not (tmp_path / "n2" / "metrics.json").exists() and not (tmp_path / "n0-again" / "metrics.json").exists()
    finished = _machine(procs, url, 0, 3, 1, tmp_path / "n0-late", *flags, name="node0-late").wait(60)
    assert finished.returncode == 0 and "finished already" in finished.stderr, finished  # nothing to join
    assert not (tmp_path / "n0-late" / "metrics.json").exists()


@pytest.mark.slow
def test_a_sharded_jobs_machine_0_lost_on_etcd_the_other_machine_trains_on(tmp_path, procs, etcd):  # noqa: F811
    """Two machines of two processes (ZeRO-2 inside a machine): machine 0 is lost. With the embedded store this
    ended the job; on etcd machine 1 trains on alone and machine 0, started again, rejoins."""
    url = etcd.url("cli-sharded")
    flags = ["--strategy", "sharded", "--optimizer", "adam", *SLOW_RUN, "--max-steps", "700", *LATE_SURVIVOR_ROOM]
    first = _machine(procs, url, 0, 2, 2, tmp_path / "a", *flags, name="machine0")
    other = _machine(procs, url, 1, 2, 2, tmp_path / "b", *flags, name="machine1")
    _wait_for_etcd_round(EtcdStore(url), 30, 120)
    first.kill()
    wait_until_dropped(EtcdStore(url), 0, 120)  # machine 1 trains on alone, then machine 0 comes back
    back = _machine(procs, url, 0, 2, 2, tmp_path / "a2", *flags, name="machine0-again")
    for proc in (other, back):
        result = proc.wait(240)
        assert result.returncode == 0, result
    summary = _summary(tmp_path / "b")
    events = summary["membership"]
    assert [e["left"] for e in events if e["left"]] == [[0]], events
    assert [e["joined"] for e in events if e["joined"]] == [[0]], events
    assert summary["final_members"] == [0, 1] and summary["replicas_equal"], summary["parameter_digests"]
    assert [int(r["step"]) for r in _steps(tmp_path / "b")] == list(range(460))  # 20 epochs of 23 steps: all


@pytest.mark.slow
def test_without_etcd_losing_machine_0_ends_every_survivor_naming_the_store(tmp_path, procs):  # noqa: F811
    """The embedded store lives on machine 0: once it is lost, no survivor trains alone (the job split in two
    that way before); each ends non-zero within the round's timeouts with a message naming the etcd option."""
    port = free_port()
    flags = ["--strategy", "ddp", *SLOW_RUN, "--max-steps", "2000"]
    nodes = [_node(procs, port, r, 3, tmp_path / f"n{r}", *flags, name=f"node{r}") for r in range(3)]
    _wait_for_round(_store(port), 30, 120)
    nodes[0].kill()
    killed = time.monotonic()
    for proc in nodes[1:]:
        result = proc.wait(120)
        assert result.returncode != 0, result
        assert "the fault-tolerant job's store at 127.0.0.1" in result.stderr, result.stderr[-2000:]
        assert "--store etcd://" in result.stderr, result.stderr[-2000:]
    assert time.monotonic() - killed < 60
    for r in (1, 2):
        assert not (tmp_path / f"n{r}" / "metrics.json").exists()
    # machine 0's command started again: a new, empty store at the same address, a new job of one from step 0
    # over the lost job's --out; it refuses instead, naming --resume
    again = _node(procs, port, 0, 3, tmp_path / "n0", *flags, name="node0-again")
    result = again.wait(120)
    assert result.returncode != 0, result
    assert "holds the outputs of a fault-tolerant job that did not finish" in result.stderr, result.stderr[-2000:]
    assert "Pass --resume" in result.stderr and not (tmp_path / "n0" / "metrics.json").exists()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"store": "etcd://127.0.0.1:2379"}, "--store keeps a fault-tolerant job's coordination in etcd: it needs"),
        ({"store": "etcd://a", "fault_tolerant": True}, "'a' in 'etcd://a' is not HOST:PORT"),
        ({"store": "tcp://a:1", "fault_tolerant": True}, "expected etcd://HOST:PORT"),
    ],
)
def test_the_store_flag_is_checked_before_any_process_starts(fields, message):
    with pytest.raises(ValueError) as error:
        validate(TrainConfig(nproc_per_node=2, **fields))
    assert message in str(error.value)


def test_steps_and_summary_helpers_read_what_the_writer_wrote(tmp_path):
    """(The helpers this module's checks rely on, against files written by hand.)"""
    (tmp_path / "metrics.json").write_text(json.dumps({"summary": {"replicas_equal": True}}))
    with open(tmp_path / "steps.csv", "w", newline="") as f:
        csv.writer(f).writerows([["step"], ["0"], ["1"]])
    assert _summary(tmp_path) == {"replicas_equal": True} and [r["step"] for r in _steps(tmp_path)] == ["0", "1"]


ONE_MACHINE_ETCD = [
    f"etcd --name m{i} --data-dir /tmp/etcd-m{i} --listen-client-urls http://127.0.0.1:{c} --advertise-client-urls "
    f"http://127.0.0.1:{c} --listen-peer-urls http://127.0.0.1:{p} --initial-advertise-peer-urls http://127.0.0.1:{p} "
    "--initial-cluster m0=http://127.0.0.1:2380,m1=http://127.0.0.1:22380,m2=http://127.0.0.1:32380 "
    "--initial-cluster-state new --initial-cluster-token ddpkit-try"
    for i, (c, p) in enumerate([(2379, 2380), (22379, 22380), (32379, 32380)])
]
ONE_MACHINE_TRAIN = [
    f"ddpkit train --fault-tolerant --strategy ddp --nnodes 3 --nproc-per-node 1 --node-rank {k} "
    f"--store etcd://127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379/try-1 --epochs 40 --out runs/try-1-n{k}"
    for k in range(3)
]


def test_the_docs_one_machine_etcd_commands_run_as_written(tmp_path, procs):  # noqa: F811
    """docs/fault-tolerance.md's "Trying it on one machine": its three etcd lines and three `ddpkit train` lines,
    run as written but for free ports in place of etcd's usual ones, folders under the test's, and a short run
    (--max-steps 6 in place of --epochs 40): the cluster forms and the three machines train one job."""
    from test_readme import command

    page = Path(__file__).resolve().parent.parent / "docs" / "fault-tolerance.md"
    ports = {port: str(free_port()) for port in ("2379", "2380", "22379", "22380", "32379", "32380")}

    def local(text: str) -> list[str]:
        text = re.sub(r":(2379|2380|22379|22380|32379|32380)\b", lambda m: ":" + ports[m.group(1)], text)
        text = text.replace("/tmp/", f"{tmp_path}/").replace("runs/", f"{tmp_path}/runs/")
        return shlex.split(text.replace("--epochs 40", "--epochs 1 --max-steps 6 --batch-size 16 --no-progress"))

    for i, line in enumerate(ONE_MACHINE_ETCD):
        args = local(command(line, page))
        procs([etcd_binary(), *args[1:]], f"etcd-m{i}")
    store = EtcdStore(f"etcd://127.0.0.1:{ports['2379']},127.0.0.1:{ports['22379']}/try-1", timeout=30)
    store.set("ready", "1")  # the cluster elected a leader
    store.delete_key("ready")
    machines = [
        procs([*DDPKIT, *local(command(line, page))[1:]], f"n{k}", env=ENV) for k, line in enumerate(ONE_MACHINE_TRAIN)
    ]
    for machine in machines:
        result = machine.wait(180)
        assert result.returncode == 0, result
    summary = _summary(tmp_path / "runs" / "try-1-n0")
    assert summary["final_members"] == [0, 1, 2] and summary["replicas_equal"], summary
