"""Which strategy for this model on this network: measure the link, predict each strategy's step time, recommend.

`ddpkit bench` times every strategy for a few steps on the user's model and records, per strategy, the step time
``t_step`` (`ddpkit.measure.timing.step_time`: the median over windows of 3 steps of their mean, so SlowMo's
averaging steps count in proportion and a slow spell of the machine does not; the one statistic of the table, the
plot, the prediction and the recommendation), the step of the bare model ``t_local`` (forward, backward and the
torch optimizer on one rank, no wrapper, no communication), the bytes one rank puts on the wire per step ``W``
(`ddpkit.distributed.stats` models them per collective; the maximum over ranks) and the collectives per step ``M``
that go through the network stack (everything but shared-memory hand-overs).

**The link** is described by a bandwidth ``B`` (bytes/s each way) and a per-collective latency ``L``. It is
measured with a gloo all-reduce of two sizes ``s0 < s1`` on the job's process group (`measure_link`): with ``w(s)``
the wire bytes of an all-reduce of s bytes, the median times give ``B = (w(s1) - w(s0)) / (t1 - t0)`` and
``L = t0 - w(s0) / B``; across hosts (one process per host) that is the link between them. ``--link-mbit N``
(with ``--link-latency-ms``) gives one instead.

**The prediction** for a link (B, L), from a run measured on a link (B0, L0)::

    t_comm(B, L)    = W / B + M * L
    t_compute       = max(t_step - t_comm(B0, L0), t_local)  # what the measured step spent not communicating
    t_predicted     = t_compute + t_comm(B, L)

The floor ``t_local`` keeps a prediction from falling below what the model itself costs where the link model
overestimates the measured link's share (a tiny model, whose collectives are all latency). Communication is
assumed not to overlap computation (DDP overlaps its all-reduce with backward, so on a link
where the two are comparable the prediction errs high by at most the backward time). SlowMo's inter-node traffic
happens every ``localsgd_frequency`` steps, so its ``W`` and ``M``, averaged over the timed steps (a multiple of
that frequency), are its averaging traffic divided by the frequency. To predict a multi-host job from a run on one
host, the bench runs with ``DDPKIT_SHARED_MEMORY=0``, so ``W`` and ``M`` are what the strategies send over
sockets, as between hosts; the prediction then assumes each process on its own host (hierarchical sharding, with
several processes per host, is not modelled). ``W/B`` also assumes a rank's bytes keep both directions of its
link busy, as a ring all-reduce does; ShardedDataParallel and OSS do too since their receives are posted before
their sends (within 9% for every strategy on two namespace hosts, `benchmarks/README.md`, advisor section).

**The recommendation** is the strategy with the lowest predicted (or, without a link, measured) step time. The
strategies within the margin of it count as equally fast: the margin is the larger of 5% and the noise of the two
fastest (each one's `ddpkit.measure.timing.relative_spread` of its windows, added). Of those the least memory
wins: the least peak memory per rank (within 5%: memory is measured too), then the least optimizer state per rank
(within 5%), then the fastest. When the runner-up is within the margin the advice
says so ("no clear winner: ... within N%"), so two runs of the same bench do not seem to contradict each other.
The reason names its ratios to DDP, whether DDP is communication-bound on the link and what SlowMo predicts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ddpkit.distributed import comm
from ddpkit.distributed.env import group_size
from ddpkit.distributed.stats import wire_bytes

SMALL, LARGE, LARGEST = 4096, 1 << 20, 64 << 20  # all-reduce sizes (bytes) that measure a link
LONG_ENOUGH = 0.1  # seconds: the large all-reduce grows (x4) until it takes this long (TCP at full speed)
NEAR_BEST = 1.05  # strategies within 5% of the fastest count as equally fast; memory decides


@dataclass(frozen=True)
class Link:
    """A network link: bandwidth in bytes per second each way and latency per collective in seconds."""

    bandwidth: float
    latency: float
    source: str = "given"

    @property
    def mbit(self) -> float:
        return self.bandwidth * 8 / 1e6

    def describe(self) -> str:
        rate = f"{self.mbit / 1e3:,.1f} Gbit/s" if self.mbit >= 1e4 else f"{self.mbit:,.0f} Mbit/s"
        return f"{rate}, {self.latency * 1e3:.2f} ms per collective ({self.source})"

    def comm_seconds(self, wire: float, messages: float) -> float:
        """``W / B + M * L``: the time `messages` collectives sending `wire` bytes take on this link."""
        return wire / self.bandwidth + messages * self.latency


def link_from_mbit(mbit: float, latency_ms: float = 0.5) -> Link:
    """The link ``--link-mbit`` and ``--link-latency-ms`` describe."""
    if mbit <= 0 or latency_ms < 0:
        raise ValueError(f"--link-mbit must be > 0 and --link-latency-ms >= 0; got {mbit}, {latency_ms}")
    return Link(mbit * 1e6 / 8, latency_ms / 1e3, "given")


def fit_link(small: tuple[float, float], large: tuple[float, float], source: str) -> Link:
    """The link through two (wire bytes, seconds) points of the same collective at two sizes."""
    (w0, t0), (w1, t1) = small, large
    if t1 <= t0:  # noise swamped the difference: all of the large call's time counts as transfer
        return Link(w1 / max(t1, 1e-9), 0.0, source)
    bandwidth = (w1 - w0) / (t1 - t0)
    return Link(bandwidth, max(t0 - w0 / bandwidth, 0.0), source)


def _median_all_reduce_seconds(size: int, repeats: int) -> float:
    """The median over `repeats` timed all-reduces of `size` bytes, after an untimed one; rank 0's figure."""
    tensor = torch.zeros(size // 4)
    comm.all_reduce(tensor)
    seconds = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        comm.all_reduce(tensor)
        seconds.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(seconds)], dtype=torch.float64)
    comm.broadcast(median, 0)  # every rank decides and reports with the same figure
    return float(median)


def measure_link(source: str, repeats: int = 5) -> Link:
    """Fits a `Link` to all-reduce times on the default group (a collective: every rank calls it): 4 KB, and
    1 MB grown x4 until one call takes `LONG_ENOUGH` seconds (at most 64 MB); medians of `repeats` calls.
    Every rank gets rank 0's figures."""
    n = group_size()
    small = (wire_bytes("all_reduce", SMALL, n), _median_all_reduce_seconds(SMALL, repeats))
    size = LARGE
    while size < LARGEST and _median_all_reduce_seconds(size, 1) < LONG_ENOUGH:  # one probe per size
        size *= 4
    large = (wire_bytes("all_reduce", size, n), _median_all_reduce_seconds(size, repeats))
    return fit_link(small, large, source)


def predict_seconds(result: dict[str, Any], measured_on: Link, target: Link) -> float:
    """`result`'s step time on `target`, from its step measured on `measured_on` (see the module doc)."""
    wire, messages = result["wire_bytes_per_step"], result["messages_per_step"]
    # the bare model's step, never above the measured step itself (a cold or loaded moment can time it high)
    floor = min(result.get("local_compute_ms", 0.0), result["step_ms"]) / 1e3
    compute = max(result["step_ms"] / 1e3 - measured_on.comm_seconds(wire, messages), floor)
    return compute + target.comm_seconds(wire, messages)


@dataclass
class Advice:
    """The recommended strategy, why, and every strategy's step time in seconds (predicted or measured)."""

    strategy: str
    reason: str
    seconds: dict[str, float]


def margin(results: list[dict[str, Any]], seconds: dict[str, float]) -> float:
    """The relative difference under which two step times count as equal: 5%, or the noise of the two fastest
    strategies (their window spreads added) where that is larger."""
    fastest = sorted(results, key=lambda r: seconds[r["strategy"]])[:2]
    return max(NEAR_BEST - 1, sum(r.get("step_spread", 0.0) for r in fastest))


def _pick(results: list[dict[str, Any]], seconds: dict[str, float], within: float) -> tuple[str, list[str]]:
    """The recommended strategy, and every strategy within `within` of the fastest (fastest first). Of those, the
    least memory wins: the ones whose peak memory is within `NEAR_BEST` of the least, then of those the ones whose
    optimizer state per rank is within `NEAR_BEST` of the least (peak memories a few percent apart can hide half
    the state), then the fastest of them."""
    best = min(seconds.values())
    near = sorted(
        (r for r in results if seconds[r["strategy"]] <= best * (1 + within)), key=lambda r: seconds[r["strategy"]]
    )
    lightest = _least(near, "peak_memory_mb")
    smallest_state = _least(lightest, "optimizer_state_bytes_per_rank")
    return smallest_state[0]["strategy"], [r["strategy"] for r in near]


def _least(results: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The results whose `key` is within `NEAR_BEST` of the least (all of them where a result lacks it), in order."""
    if any(key not in r for r in results):
        return results
    least = min(r[key] for r in results)
    return [r for r in results if r[key] <= least * NEAR_BEST]


def _reasons(
    results: dict[str, dict[str, Any]], seconds: dict[str, float], choice: str, target: Link | None
) -> list[str]:
    base = "ddp" if "ddp" in results else next(iter(results))
    where = "measured here" if target is None else f"predicted over {target.mbit:,.0f} Mbit/s"
    fastest = min(seconds, key=seconds.__getitem__)
    if choice == base and choice == fastest:
        parts = [f"{choice}: the fastest, {seconds[choice] * 1e3:.1f} ms per step {where}"]
    elif choice == base:
        slower = seconds[choice] / seconds[fastest]
        parts = [
            f"{choice}: {seconds[choice] * 1e3:.1f} ms per step {where}, {slower:.2f}x the fastest ({fastest}, "
            f"{seconds[fastest] * 1e3:.1f} ms)"
        ]
    else:
        time_ratio = seconds[choice] / seconds[base]
        memory_ratio = results[choice]["peak_memory_mb"] / results[base]["peak_memory_mb"]
        parts = [f"{choice}: {time_ratio:.2f}x {base}'s step time and {memory_ratio:.2f}x its peak memory {where}"]
    if target is not None and "ddp" in results:
        ddp = results["ddp"]
        busy = target.comm_seconds(ddp["wire_bytes_per_step"], ddp["messages_per_step"])
        bound = "communication" if busy > seconds["ddp"] - busy else "compute"
        parts.append(
            f"on that link DDP is {bound}-bound at {seconds['ddp'] * 1e3:.0f} ms per step, "
            f"{busy * 1e3:.0f} ms of it communicating"
        )
    if "slowmo" in seconds and "ddp" in seconds and choice != "slowmo":
        verb = "runs at" if target is None else "predicts"
        parts.append(
            f"slowmo (local SGD, averaging every 3 steps) {verb} {seconds['ddp'] / seconds['slowmo']:.1f}x DDP's speed"
        )
    if choice == "slowmo":
        parts.append("SlowMo averages the replicas only every few steps: check that your model converges as well")
    return parts


def advise(results: list[dict[str, Any]], target: Link | None) -> Advice:
    """Recommends a strategy from the bench's `results` (each with the link it was measured on) for `target`
    (None: for the machines the bench ran on, from the measured step times)."""
    if target is None:
        seconds = {r["strategy"]: r["step_ms"] / 1e3 for r in results}
    else:
        seconds = {r["strategy"]: predict_seconds(r, Link(**r["link"]), target) for r in results}
    within = margin(results, seconds)
    choice, near = _pick(results, seconds, within)
    reasons = _reasons({r["strategy"]: r for r in results}, seconds, choice, target)
    if len(near) > 1:
        reasons.insert(
            0,
            f"no clear winner: {', '.join(near)} within {within:.0%} of the fastest step time (the "
            "margin: 5% or the noise between windows, whichever is larger); of those the least memory "
            "wins: the least peak memory, then the least optimizer state (each within 5%), then the "
            "fastest",
        )
    return Advice(choice, "; ".join(reasons), seconds)


def format_advice(results: list[dict[str, Any]], target: Link | None) -> str:
    """The links, each strategy's predicted step (with a target link) and the recommendation, as printed."""
    measured = Link(**results[0]["link"])
    lines = [f"link {measured.describe()}"]
    advice = advise(results, target)
    if target is not None:
        lines.append(f"predicted for {target.describe()}, each process on its own host:")
        lines.append(f"{'strategy':<9}{'compute ms':>12}{'comm ms':>10}{'step ms':>10}{'x ddp':>7}")
        base = advice.seconds.get("ddp", next(iter(advice.seconds.values())))
        for r in results:
            comm_s = target.comm_seconds(r["wire_bytes_per_step"], r["messages_per_step"])
            total = advice.seconds[r["strategy"]]
            lines.append(
                f"{r['strategy']:<9}{(total - comm_s) * 1e3:>12.1f}{comm_s * 1e3:>10.1f}{total * 1e3:>10.1f}"
                f"{total / base:>7.2f}"
            )
    lines.append(f"recommendation: {advice.reason}")
    return "\n".join(lines)
