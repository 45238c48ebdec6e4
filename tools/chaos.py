"""The chaos run: a fault-tolerant job on network-namespace hosts under a nemesis, then checked from every rank's
history (as Jepsen checks a database: faults injected from outside, a checker that trusts nothing but the logs).

    python tools/chaos.py --store etcd --hosts 4 --minutes 30 --seed 1        # the long run (root, iptables)
    python tools/chaos.py --store etcd --hosts 3 --steps 150 --faults 6 --seed 7   # the short form CI runs

Hosts are network namespaces on one bridge (`benchmarks/lib/netns.py`). With ``--store etcd`` a three-member etcd
cluster runs on hosts 0-2 (one member each); with ``--store embedded`` a TCPStore hosted as `ddpkit store` hosts it
on host 0. Each host runs one rank of `tools/chaos_worker.py` (the digits MLP trained as DDP through `Manager`),
restarted whenever it ends before the job does, as torchrun or a service manager would. A first run without faults
is the reference (run without ``--step-seconds``' pauses, which are added back to its time: its steps, batches
and verdicts are the same); then the nemesis injects faults one after another, each drawn (seeded) from:

- ``kill-rank`` (SIGKILL, restarted after 1-5 s), ``kill-machine`` (every process of the host, its etcd member
  too, restarted), ``pause-rank`` (SIGSTOP for 1-30 s);
- ``cut-peers``, ``cut-store``, ``cut-both``: iptables DROP in the host's namespace between it and the other hosts'
  training traffic, the store's ports, or everything, for 5-20 s;
- ``etcd-kill``, ``etcd-pause``, ``etcd-blackhole`` (a member's ports dropped) for 5-20 s (``--store etcd``);
- ``store-restart`` (``--store embedded``, the last fault): the store killed and started again, empty, at its
  address after 1-5 s. That ends the job by design: every rank must stop with StoreLost and none commit a round
  in the new store (no rank is restarted after it: one started now would begin another job).

``--script KIND:HOST:SECONDS,...`` gives the faults in order instead of a draw (the short forms CI runs).

The checker reads every history: no round committed by two groups with different members or states (a split),
every committed round's members agree, no hang (the job ends within ``--finish-timeout`` of the last fault), no
stuck stretch (no committed round for ``--stuck-seconds``, nor more than ``--stuck-failures`` rounds in a row
failed with the same members, while the job runs), every paused rank back in a committed round within 4 quorum
timeouts (and `CATCH_UP_SLACK`) of waking, no process left in any host, the final replicas equal; and it
reports the healthy ranks dropped (whose host no fault hit: a violation with ``--strict-drops``), the held-out
loss against the reference's and goodput (steps per second against the reference's). It prints the fault mix and
the verdict, writes ``OUT/chaos.json``, and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lib import netns  # noqa: E402
from ddpkit.testing.etcd_cluster import etcd_binary, etcd_command  # noqa: E402

ETCD_CLIENT, ETCD_PEER, EMBEDDED_PORT = 2379, 2380, 29700
DROP_GRACE = 20.0  # seconds after a fault on its host during which a rank may still be dropped (a restart's join)
UNEXPLAINED_DROPS = 2  # healthy ranks dropped that a run tolerates (a machine too loaded to answer in time)
WORKER = [sys.executable, str(ROOT / "tools" / "chaos_worker.py")]
KINDS = {
    "etcd": [
        "kill-rank",
        "kill-machine",
        "pause-rank",
        "cut-peers",
        "cut-store",
        "cut-both",
        "etcd-kill",
        "etcd-pause",
        "etcd-blackhole",
    ],
    "embedded": ["kill-rank", "pause-rank", "cut-peers", "cut-both", "store-restart"],
}
LAST_KINDS = ("store-restart",)  # a fault that ends the job by design comes last (once)
CATCH_UP_SLACK = 10.0  # seconds beyond 4 quorum timeouts a woken rank may take to be back (a heal on a loaded machine)


@dataclass
class Fault:
    """One fault: its kind, the host it hits, how long it lasts, the pause before it, and when it began."""

    kind: str
    host: int
    seconds: float
    gap: float = 1.0
    at: float = 0.0
    began: float = 0.0  # wall-clock time, as the histories', when it was applied and undone
    ended: float = 0.0


@dataclass
class Job:
    """The hosts, their ranks and the store; everything it starts it can end."""

    hosts: netns.Hosts
    store: str
    out: Path
    steps: int
    quorum_timeout: float
    step_seconds: float
    workers: dict[int, subprocess.Popen] = field(default_factory=dict)
    servers: dict[int, subprocess.Popen] = field(default_factory=dict)  # etcd members, or the embedded store (0)
    finished: bool = False
    store_restarted: float = 0.0  # when the embedded store was killed to come back empty (0: never); no restarts after
    store_back: float = 0.0  # when it listened again, empty

    @property
    def url(self) -> str:
        if self.store == "etcd":
            members = ",".join(f"{a}:{ETCD_CLIENT}" for a in self.hosts.addresses[:3])
            return f"etcd://{members}/chaos-{self.out.name}"
        return f"tcp://{self.hosts.addresses[0]}:{EMBEDDED_PORT}"

    def start_store(self) -> None:
        if self.store == "etcd":
            for k in range(3):
                self.start_server(k)
        else:
            self.start_server(0)
        time.sleep(3)  # (an election, or the store's listen)

    def start_server(self, k: int) -> None:
        log = open(self.out / f"server{k}.log", "ab")
        if self.store == "etcd":
            address = self.hosts.addresses[k]
            initial = ",".join(f"e{i}=http://{a}:{ETCD_PEER}" for i, a in enumerate(self.hosts.addresses[:3]))
            command = etcd_command(
                etcd_binary(), f"e{k}", self.out / f"etcd{k}", address, ETCD_CLIENT, ETCD_PEER, initial
            )
        else:
            command = [sys.executable, "-m", "ddpkit", "store", "--port", str(EMBEDDED_PORT), "--timeout", "600"]
        self.servers[k] = subprocess.Popen(
            [*self.hosts.prefix(k), *command], stdout=log, stderr=log, start_new_session=True
        )
        log.close()

    def start_worker(self, k: int) -> None:
        command = [
            *WORKER,
            "--rank",
            str(k),
            "--world",
            str(self.hosts.count),
            "--store",
            self.url,
            "--history",
            str(self.out / f"rank{k}.jsonl"),
            "--steps",
            str(self.steps),
            "--quorum-timeout",
            str(self.quorum_timeout),
            "--step-seconds",
            str(self.step_seconds),
        ]
        log = open(self.out / f"rank{k}.log", "ab")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.hosts.ifnames[k], "OMP_NUM_THREADS": "1"}
        self.workers[k] = subprocess.Popen(
            [*self.hosts.prefix(k), *command], stdout=log, stderr=log, env=env, start_new_session=True
        )
        log.close()

    def supervise(self) -> None:
        """Starts again every rank that ended before the job did (exit 0 means the job is over; after the store's
        restart, the job is gone: a rank started now would start another)."""
        for k, proc in list(self.workers.items()):
            code = proc.poll()
            if code == 0:
                self.finished = True
            elif code is not None and not self.finished and not self.store_restarted:
                self.start_worker(k)

    def signal(self, k: int, signum: int, server: bool = False) -> None:
        proc = (self.servers if server else self.workers).get(k)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)

    def kill_machine(self, k: int) -> None:
        listed = subprocess.run(["ip", "netns", "pids", self.hosts.namespaces[k]], capture_output=True, text=True)
        for pid in map(int, listed.stdout.split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def iptables(self, k: int, *rule: str) -> None:
        subprocess.run([*self.hosts.prefix(k), "iptables", *rule], check=True, capture_output=True, timeout=30)

    def cut(self, k: int, what: str) -> None:
        """Host `k` loses the other hosts' training traffic (`peers`), the store's ports (`store`) or both."""
        store_ports = f"{ETCD_CLIENT},{ETCD_PEER}" if self.store == "etcd" else str(EMBEDDED_PORT)
        for other, address in enumerate(self.hosts.addresses):
            if other == k:
                continue
            for chain, side in (("OUTPUT", "-d"), ("INPUT", "-s")):
                ports = ["-p", "tcp", "-m", "multiport", "--ports", store_ports]
                if what == "peers":
                    self.iptables(k, "-A", chain, side, address, *ports, "-j", "ACCEPT")
                    self.iptables(k, "-A", chain, side, address, "-j", "DROP")
                elif what == "store":
                    self.iptables(k, "-A", chain, side, address, *ports, "-j", "DROP")
                else:
                    self.iptables(k, "-A", chain, side, address, "-j", "DROP")

    def blackhole_member(self, k: int) -> None:
        ports = f"{ETCD_CLIENT},{ETCD_PEER}"
        self.iptables(k, "-A", "INPUT", "-p", "tcp", "-m", "multiport", "--dports", ports, "-j", "DROP")
        self.iptables(k, "-A", "OUTPUT", "-p", "tcp", "-m", "multiport", "--sports", ports, "-j", "DROP")

    def heal(self, k: int) -> None:
        self.iptables(k, "-F")

    def alive(self) -> list[int]:
        return [k for k, proc in self.workers.items() if proc.poll() is None]

    def stop(self) -> None:
        for k in range(self.hosts.count):
            with contextlib.suppress(subprocess.CalledProcessError):
                self.heal(k)
            self.signal(k, signal.SIGCONT)
            self.signal(k, signal.SIGCONT, server=True)
        for proc in [*self.workers.values(), *self.servers.values()]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def draw_faults(rng: random.Random, kinds: list[str], count: int, hosts: int, longest: float = 30.0) -> list[Fault]:
    """`count` faults (seeded), each kind in turn first so that a short run has every kind, then at random, a kind
    that ends the job (`LAST_KINDS`) last; none lasts more than `longest` seconds."""
    last = [kind for kind in kinds if kind in LAST_KINDS]
    every = [kind for kind in kinds if kind not in LAST_KINDS]
    order = [every[i % len(every)] for i in range(count - len(last))]
    rng.shuffle(order)
    order += last
    faults = []
    for kind in order:
        host = 0 if kind == "store-restart" else rng.randrange(3) if kind.startswith("etcd") else rng.randrange(hosts)
        low, high = (1, 30) if kind == "pause-rank" else (1, 5) if "kill" in kind or "restart" in kind else (5, 20)
        seconds = min(longest, rng.uniform(low, high))
        faults.append(Fault(kind, host, round(seconds, 1), round(rng.uniform(1, 3), 1)))
    return faults


def parse_script(text: str) -> list[Fault]:
    """Faults written out as ``KIND:HOST:SECONDS,...`` (``--script``), in that order, 1.5 s apart."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, host, seconds = item.split(":")
        if kind not in {k for kinds in KINDS.values() for k in kinds}:
            raise SystemExit(f"chaos: --script: unknown fault kind {kind!r} in {item!r}")
        faults.append(Fault(kind, int(host), float(seconds), 1.5))
    return faults


def inject(job: Job, fault: Fault) -> None:
    """Applies `fault`, waits its seconds (supervising the ranks), and undoes it."""
    k, kind = fault.host, fault.kind
    if kind == "kill-rank":
        job.signal(k, signal.SIGKILL)
    elif kind == "kill-machine":
        job.kill_machine(k)
    elif kind == "pause-rank":
        job.signal(k, signal.SIGSTOP)
    elif kind.startswith("cut-"):
        job.cut(k, kind.removeprefix("cut-"))
    elif kind == "etcd-kill":
        job.signal(k, signal.SIGKILL, server=True)
    elif kind == "etcd-pause":
        job.signal(k, signal.SIGSTOP, server=True)
    elif kind == "etcd-blackhole":
        job.blackhole_member(k)
    elif kind == "store-restart":
        job.store_restarted = time.time()
        job.signal(0, signal.SIGKILL, server=True)
    until = time.monotonic() + fault.seconds
    while time.monotonic() < until:
        if kind not in ("kill-rank", "kill-machine"):
            job.supervise()
        time.sleep(0.2)
    if kind == "pause-rank":
        job.signal(k, signal.SIGCONT)
    elif kind.startswith("cut-") or kind == "etcd-blackhole":
        job.heal(k)
    elif kind == "etcd-pause":
        job.signal(k, signal.SIGCONT, server=True)
    elif kind == "etcd-kill" or (kind == "kill-machine" and job.store == "etcd" and k < 3):
        job.start_server(k)
    elif kind == "store-restart":
        job.servers[0].wait()
        job.start_server(0)  # (empty, at the same address)
        job.store_back = time.time()
    job.supervise()


def histories(out: Path, hosts: int) -> dict[int, list[dict[str, Any]]]:
    found = {}
    for k in range(hosts):
        path = out / f"rank{k}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        found[k] = [json.loads(line) for line in lines if line.strip().startswith("{") and line.endswith("}")]
    return found


def check(
    logs: dict[int, list[dict[str, Any]]],
    stuck_seconds: float,
    stuck_failures: int = 3,
    faults: list[Fault] | tuple = (),
    strict_drops: bool = False,
    catch_up_seconds: float = float("inf"),
    store_restarted: float = 0.0,
) -> tuple[list[str], dict[str, Any]]:
    """The violations in the ranks' histories (module doc) and the run's figures. Stuck is either no committed
    round for `stuck_seconds`, or more than `stuck_failures` rounds in a row failed with the same members (a
    decision that does not learn what failed). A rank dropped while no fault hit its host (an etcd member's
    fault, say, or a machine too loaded to beat in time) is a healthy rank dropped: counted, and with
    `strict_drops` more than `UNEXPLAINED_DROPS` of them is a violation (on a loaded machine they happen). A rank
    woken from a pause must be a member of a committed round within `catch_up_seconds` (unless the job ended or
    another fault hit it first). Once the embedded store is back empty (`store_restarted`, a time), no rank may commit
    a round, and every rank must have stopped with StoreLost."""
    wrong: list[str] = []
    rounds: dict[int, tuple[list[int], bool, str | None, int]] = {}
    commits = []
    for rank, entries in logs.items():
        for e in entries:
            if "round" not in e or e["committed"] is None:  # (None: forgotten while it was stopped; it rejoins)
                continue
            seen = (e["members"], e["committed"], e["digest"])
            first = rounds.setdefault(e["round"], (*seen, rank))
            if first[:3] != seen:
                wrong.append(f"split: round {e['round']} was {first[:3]} on rank {first[3]} and {seen} on rank {rank}")
            if rank not in e["members"]:
                wrong.append(f"rank {rank} logged round {e['round']} without being a member")
            if e["committed"]:
                commits.append(e["t"])
    finals = {rank: e for rank, entries in logs.items() for e in entries if "final" in e}
    if len({e["final"] for e in finals.values()}) > 1:
        wrong.append(f"final replicas differ: { {r: e['final'] for r, e in finals.items()} }")
    run, longest_run = 0, 0
    for number in sorted(rounds):
        members, committed = rounds[number][0], rounds[number][1]
        previous = rounds.get(number - 1)
        run = 0 if committed else run + 1 if previous is not None and previous[0] == members else 1
        longest_run = max(longest_run, run)
    if longest_run > stuck_failures:
        wrong.append(f"stuck: {longest_run} rounds in a row failed with the same members")
    unexplained = _unexplained_drops(logs, rounds, faults)
    if strict_drops and len(unexplained) > UNEXPLAINED_DROPS:
        wrong.append(f"healthy ranks dropped (no fault on their host): {unexplained[:10]}")
    catch_ups = _catch_ups(logs, faults)
    wrong += [
        f"slow catch-up: rank {f.host} was back {late:.0f} s after its {f.seconds:g} s pause ended"
        for f, late, window in catch_ups
        if late > catch_up_seconds and window > catch_up_seconds
    ]
    if store_restarted:
        wrong += _after_store_restart(logs, store_restarted)
        commits = [t for t in commits if t < store_restarted]
    commits.sort()
    gaps = [b - a for a, b in itertools.pairwise(commits)]
    if gaps and max(gaps) > stuck_seconds:
        wrong.append(f"stuck: no round committed for {max(gaps):.0f} s")
    steps = max((e["step"] + 1 for entries in logs.values() for e in entries if e.get("committed")), default=0)
    figures = {
        "committed_rounds": sum(1 for r in rounds.values() if r[1]),
        "failed_rounds": sum(1 for r in rounds.values() if not r[1]),
        "steps": steps,
        "seconds": (commits[-1] - commits[0]) if commits else 0.0,
        "longest_gap_seconds": round(max(gaps), 1) if gaps else 0.0,
        "longest_failed_run": longest_run,
        "unexplained_drops": len(unexplained),
        "longest_catch_up_seconds": round(max((late for _, late, _ in catch_ups if late < math.inf), default=0.0), 1),
        "finished_ranks": sorted(finals),
        "heldout_loss": next(iter(finals.values()))["heldout_loss"] if finals else None,
        "restarts": {r: sum(1 for e in entries if "start" in e) - 1 for r, entries in logs.items()},
    }
    return wrong, figures


def _catch_ups(logs: dict[int, list[dict[str, Any]]], faults: list[Fault] | tuple) -> list[tuple[Fault, float, float]]:
    """For each pause that ended while the job ran: (the pause, seconds from its end until the paused rank was a
    member of a committed round again, the quiet window it had). The window ends at the next fault (any host's:
    another fault may hold the rejoin up) or the job's last commit; a rank not back within it counts as infinite."""
    commits = sorted((e["t"], rank) for rank, entries in logs.items() for e in entries if e.get("committed"))
    last = commits[-1][0] if commits else 0.0
    found = []
    for fault in faults:
        if fault.kind != "pause-rank" or not fault.ended:
            continue
        following = [f.began for f in faults if f.began > fault.ended]
        limit = min([*following, last])
        back = next((t for t, rank in commits if rank == fault.host and t > fault.ended), None)
        if back is not None and back <= limit:
            found.append((fault, back - fault.ended, limit - fault.ended))
        elif limit > fault.ended:
            found.append((fault, float("inf"), limit - fault.ended))
    return found


def _after_store_restart(logs: dict[int, list[dict[str, Any]]], restarted: float) -> list[str]:
    """The violations once the embedded store is back empty (at `restarted`): a round committed in it, or a rank
    that did not stop with StoreLost (the job's rounds are gone: going on would be a second job beside the first)."""
    wrong = [
        f"rank {rank} committed round {e['round']} in the restarted store"
        for rank, entries in logs.items()
        for e in entries
        if e.get("committed") and e["t"] > restarted
    ]
    for rank, entries in logs.items():
        last = entries[-1] if entries else {}
        if last.get("end") != "StoreLost":
            wrong.append(f"rank {rank} did not stop with StoreLost after the store's restart: {last}")
    return wrong


def _unexplained_drops(
    logs: dict[int, list[dict[str, Any]]], rounds: dict[int, tuple], faults: list[Fault] | tuple
) -> list[tuple[int, int]]:
    """(round, rank) for each rank that left the members at a round while no fault on its host was under way (or
    had ended less than `DROP_GRACE` seconds before)."""
    when = {e["round"]: e["t"] for entries in logs.values() for e in entries if "round" in e}
    drops = []
    for number in sorted(rounds):
        if number - 1 not in rounds:
            continue
        for rank in set(rounds[number - 1][0]) - set(rounds[number][0]):
            hit = any(
                f.host == rank and not f.kind.startswith("etcd") and f.began - 1 <= when[number] <= f.ended + DROP_GRACE
                for f in faults
            )
            if not hit:
                drops.append((number, rank))
    return drops


def run(args: argparse.Namespace, hosts: netns.Hosts, out: Path, faults: list[Fault]) -> tuple[list[str], dict]:
    """One job on `hosts` under `faults` (none: the reference); its violations and figures."""
    out.mkdir(parents=True)
    job = Job(hosts, args.store, out, args.steps, args.quorum_timeout, args.step_seconds)
    wrong: list[str] = []
    try:
        job.start_store()
        for k in range(hosts.count):
            job.start_worker(k)
        if faults and not _await_first_commit(job, out, hosts.count, args.finish_timeout):
            wrong.append(f"the job committed no round within {args.finish_timeout:g} s of its start, before any fault")
            faults = []
        began = time.monotonic()
        for fault in faults:
            if job.finished:
                break
            time.sleep(fault.gap)
            fault.at = round(time.monotonic() - began, 1)
            print(f"  {fault.at:7.1f} s  {fault.kind} host {fault.host} for {fault.seconds:g} s", flush=True)
            fault.began = time.time()
            inject(job, fault)
            fault.ended = time.time()
        deadline = time.monotonic() + args.finish_timeout
        while job.alive() and time.monotonic() < deadline:
            job.supervise()
            time.sleep(0.2)
        if job.alive():
            wrong.append(f"hang: ranks {job.alive()} still ran {args.finish_timeout:g} s after the last fault")
    finally:
        job.stop()
    time.sleep(1)
    left = {
        ns: subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for ns in hosts.namespaces
    }
    wrong += [f"processes left in {ns}: {pids}" for ns, pids in left.items() if pids]
    logs = histories(out, hosts.count)
    catch_up = 4 * args.quorum_timeout + CATCH_UP_SLACK
    found, figures = check(
        logs, args.stuck_seconds, args.stuck_failures, faults, args.strict_drops, catch_up, job.store_back
    )
    if job.store_restarted:
        ends = [e["t"] for entries in logs.values() for e in entries if e.get("end")]
        figures["stopped_after_store_restart_seconds"] = round(max(ends, default=0.0) - job.store_restarted, 1)
    return wrong + found, figures


def _await_first_commit(job: Job, out: Path, hosts: int, timeout: float) -> bool:
    """Waits until a rank's history holds a committed round (the job is under way), supervising the ranks: the
    nemesis strikes a running job, not the first round's start, whose failure on every member ends them all (a
    start that fails is not a round any rank holds live state from). False if none within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(entry.get("committed") for log in histories(out, hosts).values() for entry in log):
            return True
        job.supervise()
        time.sleep(0.2)
    return False


def build_parser() -> argparse.ArgumentParser:
    """The chaos run's options (module doc)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["etcd", "embedded"], default="etcd")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300, help="committed steps the job trains")
    parser.add_argument("--faults", type=int, default=0, help="faults to inject (0: as many as --minutes allow)")
    parser.add_argument("--minutes", type=float, default=0.0, help="with --faults 0: inject for this long")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--script", default="", help="the faults written out, KIND:HOST:SECONDS,... (no draw)")
    parser.add_argument("--longest-fault", type=float, default=30.0, help="no fault lasts longer (seconds)")
    parser.add_argument("--quorum-timeout", type=float, default=2.0)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="a pause per step (slows the job)")
    parser.add_argument("--finish-timeout", type=float, default=240.0)
    parser.add_argument("--stuck-seconds", type=float, default=60.0, help="stuck: no commit for this long")
    parser.add_argument("--stuck-failures", type=int, default=3, help="stuck: more failed rounds in a row")
    parser.add_argument("--strict-drops", action="store_true", help="healthy ranks dropped are a violation")
    parser.add_argument("--out", type=Path, default=None, help="where the histories go (a new folder by default)")
    parser.add_argument("--no-reference", action="store_true", help="skip the fault-free run")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    why = netns.unavailable()
    if why:
        print(f"chaos: {why}")
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="ddpkit-chaos-"))
    rng = random.Random(args.seed)
    count = args.faults or max(1, int(args.minutes * 60 / 14))  # (a fault every 14 s on average)
    faults = parse_script(args.script) or draw_faults(rng, KINDS[args.store], count, args.hosts, args.longest_fault)
    with netns.Hosts(args.hosts, rate="1gbit", latency="5ms") as hosts:
        reference = None
        if not args.no_reference:
            print("the reference run (no fault):", flush=True)
            unpaced = argparse.Namespace(**{**vars(args), "step_seconds": 0.0})  # (its steps are the same)
            problems, reference = run(unpaced, hosts, out / "reference", [])
            if problems:
                print("the reference run itself failed:", *problems, sep="\n  ")
                return 1
        print(f"the chaos run ({len(faults)} faults, seed {args.seed}):", flush=True)
        wrong, figures = run(args, hosts, out / "chaos", faults)
    if reference is not None:
        figures["reference"] = reference
        if reference["seconds"] and figures["seconds"]:  # the reference ran unpaced: its pauses added back
            paced = reference["seconds"] + reference["steps"] * args.step_seconds
            rate = figures["steps"] / figures["seconds"]  # (steps up to the store's restart, where there is one)
            figures["goodput"] = round(rate / (reference["steps"] / paced), 3)
        if reference["heldout_loss"] and figures["heldout_loss"]:
            figures["loss_ratio"] = round(figures["heldout_loss"] / reference["heldout_loss"], 4)
    mix: dict[str, int] = {}
    for fault in faults:
        if fault.at:
            mix[fault.kind] = mix.get(fault.kind, 0) + 1
    record = {
        "settings": vars(args) | {"out": str(out)},
        "fault_mix": mix,
        "faults": [vars(f) for f in faults],
        "violations": wrong,
        "figures": figures,
    }
    (out / "chaos.json").write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps({"fault_mix": mix, "figures": figures}, indent=1))
    print("violations:" if wrong else "no violation", *wrong, sep="\n  ")
    print(f"wrote {out / 'chaos.json'}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
