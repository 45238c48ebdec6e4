"""Fault scenarios for `ddpkit train --fault-tolerant`, run by hand (not in CI): each N times, counting outcomes.

    python tools/ft_scenarios.py --runs 5 [--scenarios pause,machine0,etcd-machine0,etcd-member,etcd-sharded]
                                 [--logs DIR] [--json FILE]

Each "machine" is one `ddpkit train --fault-tolerant` command on this host (its own session, its own --out folder
under the run's folder), meeting either in node 0's embedded TCPStore or in a real three-member etcd cluster
(`ddpkit.testing.etcd_cluster.EtcdCluster`, a fresh cluster and a fresh job name per run). The model is the tests'
slowed MLP (`tests/ft_factories.py:slow_mlp`). Once round 30 is decided (`ddpkit/ft/latest` in the job's store),
the scenario's fault is injected:

  pause          3 machines, embedded store, ddp, --quorum-timeout 3: machine 2's rank SIGSTOPped 8 s then
                 SIGCONTed, three times, 5 s apart. Correct: all exit 0, one writer, replicas equal, final [0,1,2].
  machine0       3 machines, embedded store, ddp: machine 0 (launcher and rank) SIGKILLed. Correct: machines 1
                 and 2 exit non-zero within 60 s naming the lost store and --store etcd://, nobody writes.
  etcd-machine0  3 machines on etcd, ddp: machine 0 SIGKILLed. Correct: 1, 2 exit 0, one writer (machine 1),
                 replicas equal, final [1,2].
  etcd-member    3 machines on etcd, ddp: etcd member 1 SIGKILLed. Correct: all exit 0, one writer, replicas
                 equal, final [0,1,2].
  etcd-sharded   2 machines of 2 processes, sharded + adam on etcd: machine 0 SIGKILLed. Correct: machine 1 exits
                 0, one writer (machine 1), final [1].

For every run it records each command's exit code, the metrics.json written (writers), their replicas_equal and
final_members, a split (two writers, two different final_members, or a writer that exits 0 with members=1 rows in
its steps.csv while another survivor also exits 0), a hang (a command still running 240 s after the fault ended),
a raw error (stderr holding "Traceback", "DistNetworkError" or "Failed to recv" with no "ddpkit:" line after it),
and the last "ddpkit:" lines of each failing command; also, for information, every "training with 1 of N" line of
a machine's stdout (a rank training alone) and the leftover processes of a command's session. Logs stay under --logs
(one folder per run, the etcd members' logs in its etcd/); --json keeps every run's record.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddpkit.distributed.launch import TORCHRUN_VARIABLES, free_port  # noqa: E402

HANG_SECONDS = 240.0  # a command still running this long after the fault ended hangs
ROUND = 30  # the fault comes once this round is decided
RAW = ("Traceback", "DistNetworkError", "Failed to recv")
BASE = ["--model", "ft_factories:slow_mlp", "--epochs", "1000", "--batch-size", "16", "--lr", "0.01"]
BASE += ["--no-progress", "--timeout", "60"]


@dataclass
class Scenario:
    name: str
    nodes: int
    per_node: int
    etcd: bool
    flags: list[str]
    fault: str  # pause | kill-machine0 | kill-etcd-member
    survivors: list[int]  # machines that must end by themselves
    survivors_exit_zero: bool
    writer: int | None  # the machine whose --out must hold metrics.json (None: any one; -1: nobody)
    final_members: list[int] | None


# --max-steps: the job must outlast the faults (2-rank steps run at up to ~28/s here), then end soon after them
PAUSE = ["--strategy", "ddp", "--quorum-timeout", "3", "--max-steps", "1100"]
MACHINE0 = ["--strategy", "ddp", "--quorum-timeout", "2", "--max-steps", "2000"]
ETCD_DDP = ["--strategy", "ddp", "--quorum-timeout", "2", "--max-steps", "300"]
ETCD_SHARDED = ["--strategy", "sharded", "--optimizer", "adam", "--quorum-timeout", "3", "--max-steps", "400"]
SCENARIOS = {
    "pause": Scenario("pause", 3, 1, False, PAUSE, "pause", [0, 1, 2], True, None, [0, 1, 2]),
    "machine0": Scenario("machine0", 3, 1, False, MACHINE0, "kill-machine0", [1, 2], False, -1, None),
    "etcd-machine0": Scenario("etcd-machine0", 3, 1, True, ETCD_DDP, "kill-machine0", [1, 2], True, 1, [1, 2]),
    "etcd-member": Scenario("etcd-member", 3, 1, True, ETCD_DDP, "kill-etcd-member", [0, 1, 2], True, None, [0, 1, 2]),
    "etcd-sharded": Scenario("etcd-sharded", 2, 2, True, ETCD_SHARDED, "kill-machine0", [1], True, 1, [1]),
}


def environment() -> dict[str, str]:
    dropped = (*TORCHRUN_VARIABLES, "LOCAL_WORLD_SIZE", "DDPKIT_DEBUG", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    paths = [str(ROOT), str(ROOT / "tests"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))
    return env


class Command:
    """One machine's `ddpkit train`, in its own session (so its launcher, ranks and helpers can all be signalled)."""

    def __init__(self, args: list[str], folder: Path, name: str, env: dict[str, str]) -> None:
        self.name, self.args = name, args
        self.out_path, self.err_path = folder / f"{name}.out", folder / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.popen = subprocess.Popen(
                args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True
            )
        self.pid = self.popen.pid
        self.ended_at: float | None = None
        self.killed_by_us = False

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self.ended_at is None:
            self.ended_at = time.monotonic()
        return code

    def rank_processes(self) -> list[int]:
        """The ranks the launcher spawned (multiprocessing spawn children, not its resource tracker)."""
        found = []
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        with contextlib.suppress(OSError):
            for child in (int(c) for c in children.read_text().split()):
                with contextlib.suppress(OSError):
                    if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                        found.append(child)
        return found

    def kill(self) -> None:
        """SIGCONT and SIGKILL to the whole session (the launcher, its ranks, its helpers)."""
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self.poll()

    def session_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        # zombies count as ended
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    fields = stat[stat.rindex(")") + 2 :].split()
                    if int(fields[2]) == self.pid and fields[0] not in ("Z", "X"):
                        return True
        return False

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def latest_round(store: Any) -> int:
    try:
        return int(store.get("ddpkit/ft/latest")) if store.check(["ddpkit/ft/latest"]) else -1
    except Exception:  # (the store not answering yet)
        return -1


def ddpkit_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("ddpkit:")]


def raw_error(stderr: str) -> bool:
    """A raw error: a Traceback / DistNetworkError / Failed to recv with no ddpkit: line after its last one."""
    lines = stderr.splitlines()
    last = max(
        (i for i, line in enumerate(lines) if any(p in line for p in RAW) and not line.startswith("ddpkit:")),
        default=None,
    )
    if last is None:
        return False
    return not any(line.startswith("ddpkit:") for line in lines[last + 1 :])


def read_summary(out: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError, KeyError):
        return json.loads((out / "metrics.json").read_text())["summary"]
    return None


def members_column(out: Path) -> list[int]:
    with contextlib.suppress(OSError, ValueError, KeyError):
        with open(out / "steps.csv") as f:
            return [int(r["members"]) for r in csv.DictReader(f)]
    return []


def command_line(sc: Scenario, node: int, where: str, out: str) -> list[str]:
    args = [sys.executable, "-m", "ddpkit", "train", "--fault-tolerant", "--nnodes", str(sc.nodes)]
    args += ["--nproc-per-node", str(sc.per_node), "--node-rank", str(node)]
    if sc.etcd:
        args += ["--store", where]
    else:
        args += ["--master-addr", "127.0.0.1", "--master-port", where]
    return [*args, *BASE, *sc.flags, "--out", out]


def run_once(sc: Scenario, folder: Path, index: int, log: Callable[[str], None]) -> dict:
    from ddpkit.testing.etcd_cluster import EtcdCluster

    folder.mkdir(parents=True, exist_ok=True)
    env = environment()
    record: dict = {"scenario": sc.name, "run": index, "folder": str(folder), "events": []}
    started = time.monotonic()
    cluster = None
    commands: list[Command] = []
    watcher = None

    def note(what: str) -> None:
        record["events"].append(f"{time.monotonic() - started:6.1f} s {what}")

    try:
        if sc.etcd:
            from ddpkit.fault_tolerance.etcd_store import EtcdStore

            (folder / "etcd").mkdir(exist_ok=True)
            cluster = EtcdCluster(3, folder=str(folder / "etcd"))
            cluster.start()
            where = cluster.url(f"ftsc-{sc.name}-{os.getpid()}-{index}-{int(time.time())}")
            note(f"etcd up: {where}")
        else:
            where = str(free_port())
        record["where"] = where
        for node in range(sc.nodes):
            args = command_line(sc, node, where, str(folder / f"n{node}"))
            commands.append(Command(args, folder, f"n{node}", env))
        record["commands"] = [" ".join(c.args) for c in commands]
        if sc.etcd:
            watcher = EtcdStore(where, timeout=10)
        else:
            import torch.distributed as dist

            deadline = time.monotonic() + 120
            while not listening(int(where)) and time.monotonic() < deadline and commands[0].poll() is None:
                time.sleep(0.2)  # (node 0's launcher starts the store; no client of ours until it listens)
            with contextlib.suppress(Exception):
                watcher = dist.TCPStore("127.0.0.1", int(where), is_master=False, timeout=timedelta(seconds=30))
        deadline = time.monotonic() + 150
        reached = -1
        while watcher is not None and time.monotonic() < deadline:
            reached = latest_round(watcher)
            if reached >= ROUND or any(c.poll() is not None for c in commands):
                break
            time.sleep(0.05)
        record["round_at_fault"] = reached
        if reached < ROUND:
            note(f"round {ROUND} never decided (latest {reached})")
            record["setup_failed"] = True
            fault_end = time.monotonic()
        else:
            note(f"round {reached} decided")
            record["setup_failed"] = False
            fault_end = inject(sc, commands, cluster, note)
        if not sc.etcd:
            watcher = None  # (close our client before the store may vanish)
        record["fault_end"] = fault_end - started
        hang_deadline = fault_end + HANG_SECONDS
        while any(c.poll() is None for c in commands) and time.monotonic() < hang_deadline:
            time.sleep(0.2)
        for c in commands:
            if c.poll() is None:
                note(f"{c.name} still running {HANG_SECONDS:.0f} s after the fault: killed")
                c.killed_by_us = True
                c.kill()
        time.sleep(0.5)
        record["leftover"] = [c.name for c in commands if c.session_alive()]
    finally:
        for c in commands:
            c.kill()
        if cluster is not None:
            cluster.stop()
            for member in cluster.members:  # (its data folder; the member's log stays)
                shutil.rmtree(cluster.folder / member.name, ignore_errors=True)
    record["seconds"] = time.monotonic() - started
    machines = {}
    for node, c in enumerate(commands):
        out = folder / f"n{node}"
        stderr, stdout = c.stderr(), c.stdout()
        summary = read_summary(out)
        lines = ddpkit_lines(stderr) or ddpkit_lines(stdout)
        machines[node] = {
            "exit": None if c.killed_by_us else c.popen.returncode,
            "hung": c.killed_by_us,
            "seconds_after_fault": None if c.ended_at is None else c.ended_at - fault_end,
            "wrote": summary is not None,
            "replicas_equal": None if summary is None else summary.get("replicas_equal"),
            "final_members": None if summary is None else summary.get("final_members"),
            "membership": None if summary is None else summary.get("membership"),
            "alone_rows": members_column(out).count(1),
            "alone_lines": len(re.findall(r"training with 1 of \d+", stdout)),
            "raw_error": raw_error(stderr),
            "raw_seen": sum(stderr.count(p) for p in RAW),
            "store_message": "the fault-tolerant job's store at 127.0.0.1" in stderr and "--store etcd://" in stderr,
            "last_ddpkit": lines[-2:],  # (the rank's cause, then the launcher's own last line)
            "logs": [str(c.out_path), str(c.err_path)],
        }
    record["machines"] = machines
    record["wrong"] = classify(sc, record)
    log(
        f"{sc.name} run {index}: {'correct' if not record['wrong'] else 'WRONG ' + ', '.join(record['wrong'])} "
        f"({record['seconds']:.0f} s; exits {[m['exit'] for m in machines.values()]}; "
        f"writers {[n for n, m in machines.items() if m['wrote']]}; {folder})"
    )
    return record


def inject(sc: Scenario, commands: list[Command], cluster: Any, note: Callable[[str], None]) -> float:
    """The scenario's fault; returns when it ended (monotonic)."""
    if sc.fault == "pause":
        target = commands[2]
        for time_ in range(3):
            ranks = target.rank_processes()
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            note(f"SIGSTOP {ranks} (machine 2's ranks)")
            time.sleep(8)
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            note(f"SIGCONT {ranks}")
            if time_ < 2:
                time.sleep(5)
    elif sc.fault == "kill-machine0":
        ranks = commands[0].rank_processes()
        commands[0].kill()  # its whole session: launcher, ranks, helpers
        note(f"SIGKILL machine 0 (launcher {commands[0].pid}, ranks {ranks})")
    elif sc.fault == "kill-etcd-member":
        cluster.kill(1)
        note("SIGKILL etcd member 1")
    return time.monotonic()


def classify(sc: Scenario, record: dict) -> list[str]:
    if record.get("setup_failed"):
        return ["no-round-30"]
    machines = record["machines"]
    wrong = []
    survivors = {n: machines[n] for n in sc.survivors}
    writers = [n for n, m in machines.items() if m["wrote"]]
    if any(m["hung"] for m in survivors.values()):
        wrong.append("hang")
    # split: two writers, two different final_members, or a writer training alone while another survivor exits 0
    finals = {json.dumps(machines[n]["final_members"]) for n in writers}
    split = len(writers) > 1 or len(finals) > 1
    for n in writers:
        m = machines[n]
        others_ok = [o for o in survivors if o != n and machines[o]["exit"] == 0]
        if m["exit"] == 0 and m["alone_rows"] and others_ok:
            split = True
    if split:
        wrong.append("split")
    if any(m["raw_error"] for m in machines.values() if not (sc.fault == "kill-machine0" and m is machines[0])):
        wrong.append("raw-error")
    for n, m in survivors.items():
        if m["hung"]:
            continue
        if sc.survivors_exit_zero and m["exit"] != 0:
            wrong.append(f"exit-nonzero(n{n}={m['exit']})")
        if not sc.survivors_exit_zero and m["exit"] == 0:
            wrong.append(f"exit-zero(n{n})")
    if sc.name == "machine0":
        for n, m in survivors.items():
            if not m["store_message"]:
                wrong.append(f"no-store-message(n{n})")
            if m["seconds_after_fault"] is None or m["seconds_after_fault"] > 60:
                wrong.append(f"late-exit>60s(n{n})")
    if sc.writer == -1:
        if writers:
            wrong.append(f"writers={len(writers)}")
    else:
        if len(writers) != 1:
            wrong.append(f"writers={len(writers)}")
        elif sc.writer is not None and writers != [sc.writer]:
            wrong.append(f"writer=n{writers[0]}")
        for n in writers:
            if machines[n]["replicas_equal"] is not True:
                wrong.append("replicas-unequal")
            if sc.final_members is not None and machines[n]["final_members"] != sc.final_members:
                wrong.append(f"final_members={machines[n]['final_members']}")
    return list(dict.fromkeys(wrong))


def kind(wrong: str) -> str:
    """The kind of a wrong outcome, without the machine it names (for counting)."""
    return re.sub(r"\(n\d+(=[^)]*)?\)", "", wrong)


def table(sc: Scenario, records: list[dict]) -> str:
    seconds = [r["seconds"] for r in records]
    counts = Counter(kind(w) for r in records for w in r["wrong"])
    correct = sum(1 for r in records if not r["wrong"])
    lines = [f"== {sc.name}: {len(records)} runs, {correct} correct"]
    if seconds:
        lines.append(f"   seconds per run: median {statistics.median(seconds):.1f}, max {max(seconds):.1f}")
    splits = sum(1 for r in records if "split" in r["wrong"])
    hangs = sum(1 for r in records if "hang" in r["wrong"])
    raws = sum(1 for r in records if "raw-error" in r["wrong"])
    writers = Counter(sum(m["wrote"] for m in r["machines"].values()) for r in records if "machines" in r)
    alone = sum(1 for r in records if any(m["alone_lines"] for m in r.get("machines", {}).values()))
    lines.append(f"   runs with a 'training with 1 of N' line: {alone}")
    lines.append(
        f"   splits {splits}, hangs {hangs}, raw errors {raws}; writers per run: "
        + ", ".join(f"{k}: {v} runs" for k, v in sorted(writers.items()))
    )
    exits = Counter(json.dumps([m["exit"] for m in r["machines"].values()]) for r in records if "machines" in r)
    lines.append("   exit codes (n0, n1, ...): " + "; ".join(f"{k} x{v}" for k, v in exits.most_common()))
    finals = Counter(
        json.dumps([m["final_members"] for m in r["machines"].values() if m["wrote"]])
        for r in records
        if "machines" in r
    )
    lines.append("   final_members written: " + "; ".join(f"{k} x{v}" for k, v in finals.most_common()))
    for what, count in sorted(counts.items()):
        lines.append(f"   wrong: {what}: {count} runs")
    for r in records:
        if not r["wrong"]:
            continue
        lines.append(f"   -- run {r['run']} wrong ({', '.join(r['wrong'])}), logs {r['folder']}")
        for event in r["events"]:
            lines.append(f"      {event}")
        for n, m in r.get("machines", {}).items():
            failing = m["hung"] or m["exit"] != 0
            if failing or m["raw_error"] or m["wrote"]:
                after = m["seconds_after_fault"]
                lines.append(
                    f"      n{n}: exit {m['exit']}{' (hung)' if m['hung'] else ''}"
                    f"{'' if after is None else f' {after:.1f} s after the fault'}, wrote {m['wrote']}, "
                    f"final {m['final_members']}, replicas_equal {m['replicas_equal']}, "
                    f"raw {m['raw_error']} (seen {m['raw_seen']}), alone rows {m['alone_rows']}, "
                    f"alone lines {m['alone_lines']}"
                )
                for line in m["last_ddpkit"]:
                    lines.append(f"          {line}")
    return "\n".join(lines)


def describe(sc: Scenario) -> str:
    where = "etcd://M1,M2,M3/JOB" if sc.etcd else "PORT"
    return " ".join(command_line(sc, "K", where, "RUN/nK")).replace(sys.executable, "python")  # type: ignore[arg-type]


def stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--logs", default=None, help="where each run's folder goes (default: a new temporary one)")
    parser.add_argument("--json", default=None, help="also write every run's record to this file")
    args = parser.parse_args()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a stopped harness still kills the run's commands (finally)
        signal.signal(sig, stop)
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="ft-scenarios-"))
    logs.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        print(line, flush=True)

    import ddpkit

    log(f"ddpkit from {ddpkit.__file__}; logs under {logs}")
    everything = {}
    for name in names:
        sc = SCENARIOS[name]
        log(f"-- {name}: {describe(sc)}")
        if sc.etcd:
            log("   (a fresh three-member EtcdCluster and job name per run)")
        records = []
        for i in range(args.runs):
            try:
                records.append(run_once(sc, logs / f"{name}-{i}", i, log))
            except Exception as error:  # (the harness itself failed: counted, not hidden)
                log(f"{name} run {i}: harness error {type(error).__name__}: {error}")
                records.append(
                    {
                        "run": i,
                        "folder": str(logs / f"{name}-{i}"),
                        "wrong": ["harness-error"],
                        "events": [f"{type(error).__name__}: {error}"],
                        "seconds": 0.0,
                    }
                )
        everything[name] = records
        log(table(sc, records))
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1, default=str))
    log("\n==== summary")
    for name, records in everything.items():
        seconds = [r["seconds"] for r in records]
        counts = Counter(kind(w) for r in records for w in r["wrong"])
        wrong = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"
        log(
            f"{name:14s} runs {len(records):3d}  correct {sum(not r['wrong'] for r in records):3d}  wrong: {wrong}  "
            f"seconds median {statistics.median(seconds):.1f} max {max(seconds):.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
