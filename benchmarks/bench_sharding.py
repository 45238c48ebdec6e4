"""Step time, memory and traffic of sharded data parallelism against torch DDP, on 2 gloo CPU ranks.

Every strategy trains the same ~8.4M-parameter MLP (1024 -> 2048 -> 2048 -> 1024, ReLU) with Adam (lr 1e-3) on
the same synthetic data, in a fresh pair of spawned processes (so peak memory is per strategy), each rank with
``torch.set_num_threads(1)`` (2 ranks share 2 cores). After `--warmup` untimed steps, `--steps` steps are timed:

* step time: wall clock of zero_grad + forward + backward + optimizer step, after a barrier (not timed) so both
  ranks start each step together; median over the timed steps, then the max over ranks;
* optimizer state: bytes of the tensors in the optimizer state held on the rank (for sharded optimizers, their
  local optimizer's state), max over ranks;
* peak memory: the peak resident set (VmHWM) of the rank's process, max over ranks, and its growth over the
  resident set the rank had when it started (torch imported, process group up). A page shared between the ranks
  (ddpkit's shared-memory segments) counts in full in each rank's resident set, so the table also gives the
  proportional set size (PSS, each shared page split between the processes that map it) after the last step,
  summed over the ranks: the memory the job occupies;
* bytes sent per step and rank, in the bandwidth-optimal wire model of `ddpkit.distributed.stats.wire_bytes`:
  ddpkit's collectives count themselves in `comm_stats`; DDP's C++ all-reduce is routed through
  `counting_allreduce_hook`; collectives that torch's ZeroRedundancyOptimizer and fairscale call from Python
  (``torch.distributed.broadcast/reduce/all_reduce/all_gather``) are counted by a shim installed in the rank
  processes, which skips calls made by ddpkit's own `comm` module so nothing is counted twice;
* bytes handed over through shared memory per step and rank (ddpkit on one host: OSS's parameters and
  ShardedDataParallel's gradients; CommStats kind ``shared_memory``), which do not touch the network;
* final parameters: max absolute difference from the DDP baseline's (and between the two ranks), so the
  comparison is between runs that computed the same thing.

Run ``python benchmarks/bench_sharding.py`` (see benchmarks/README.md for the flags and the figures).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import comm_stats, counting_allreduce_hook
from ddpkit.distributed.stats import CommStats, wire_bytes
from ddpkit.testing import run_distributed

WORLD_SIZE = 2
LR = 1e-3
DIM_IN, DIM_HIDDEN, DIM_OUT = 1024, 2048, 1024
SHIMMED = ("broadcast", "reduce", "all_reduce", "all_gather")
DDPKIT_COMM = "ddpkit.distributed.comm"
LABEL_WIDTH = 47


# -- the model and the data ------------------------------------------------------------------------------------------


def make_model(seed: int) -> nn.Module:
    """The benchmark MLP, initialised identically on every rank and for every strategy."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(DIM_IN, DIM_HIDDEN),
        nn.ReLU(),
        nn.Linear(DIM_HIDDEN, DIM_HIDDEN),
        nn.ReLU(),
        nn.Linear(DIM_HIDDEN, DIM_OUT),
    )


def count_parameters() -> int:
    return sum(p.numel() for p in make_model(0).parameters())


def make_batches(seed: int, rank: int, count: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (input, target) batches for `rank`, made before timing starts."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return [
        (torch.randn(batch, DIM_IN, generator=generator), torch.randn(batch, DIM_OUT, generator=generator))
        for _ in range(count)
    ]


# -- counting the collectives that torch's ZeRO and fairscale call from Python ---------------------------------------


def install_counting_shim(stats: CommStats) -> None:
    """Wraps torch.distributed's Python collectives so calls made outside ddpkit are recorded in `stats`."""
    for kind in SHIMMED:
        original = getattr(dist, kind)
        if getattr(original, "_bench_shim", False):
            continue
        setattr(dist, kind, _counting(kind, original, stats))


def _counting(kind: str, original: Callable[..., Any], stats: CommStats) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def shim(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_globals.get("__name__") != DDPKIT_COMM:  # ddpkit counts its own
            bound = signature.bind(*args, **kwargs)
            tensor = bound.arguments["tensor"]
            group = bound.arguments.get("group")
            payload = tensor.numel() * tensor.element_size()
            size = dist.get_world_size(group)
            stats.record(kind, "python", payload, wire_bytes(kind, payload, size))
        return original(*args, **kwargs)

    shim._bench_shim = True  # type: ignore[attr-defined]
    return shim


# -- the strategies ---------------------------------------------------------------------------------------------------


@dataclass
class Setup:
    """What a strategy builds: the module to call, the optimizer to step, and the optimizer that holds the state."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    local_optimizer: torch.optim.Optimizer


def _counted_ddp(model: nn.Module) -> DDP:
    ddp = DDP(model)
    ddp.register_comm_hook(None, counting_allreduce_hook)
    return ddp


def build_ddp(model: nn.Module) -> Setup:
    ddp = _counted_ddp(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=LR)
    return Setup(ddp, optimizer, optimizer)


def build_ddp_fused(model: nn.Module) -> Setup:
    ddp = _counted_ddp(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=LR, fused=True)
    return Setup(ddp, optimizer, optimizer)


def build_zero(model: nn.Module) -> Setup:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = _counted_ddp(model)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    return Setup(ddp, optimizer, optimizer.optim)


def build_fairscale(model: nn.Module) -> Setup:
    from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP
    from fairscale.optim import OSS as FairscaleOSS

    optimizer = FairscaleOSS(model.parameters(), optim=torch.optim.Adam, lr=LR)
    return Setup(FairscaleSDP(model, optimizer), optimizer, optimizer.optim)


def build_oss_ddp(model: nn.Module) -> Setup:
    from ddpkit.optim import OSS

    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=LR)
    return Setup(_counted_ddp(model), optimizer, optimizer.optim)


def _build_oss_sdp(model: nn.Module, sdp: dict[str, Any] | None = None, **adam: Any) -> Setup:
    from ddpkit.nn import ShardedDataParallel
    from ddpkit.optim import OSS

    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=LR, **adam)
    return Setup(ShardedDataParallel(model, optimizer, **(sdp or {})), optimizer, optimizer.optim)


def build_oss_sdp(model: nn.Module) -> Setup:
    return _build_oss_sdp(model)


def build_oss_sdp_unfused(model: nn.Module) -> Setup:
    return _build_oss_sdp(model, fused=False)


def build_oss_sdp_unbucketed(model: nn.Module) -> Setup:
    return _build_oss_sdp(model, sdp={"reduce_buffer_size": 0})


def build_oss_sdp_sockets(model: nn.Module) -> Setup:
    os.environ["DDPKIT_SHARED_MEMORY"] = "0"  # as between hosts: every byte over gloo (fresh processes per run)
    return _build_oss_sdp(model)


def build_no_comm(model: nn.Module) -> Setup:
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    return Setup(model, optimizer, optimizer)


@dataclass(frozen=True)
class Strategy:
    key: str
    label: str
    build: Callable[[nn.Module], Setup]
    extra: bool = False  # not one of the five the issue asks for; shown for honesty
    reference: bool = False  # not data parallel: a floor for the step time, its parameters differ from DDP's


STRATEGIES = [
    Strategy("ddp", "torch DDP + Adam (default, baseline)", build_ddp),
    Strategy("ddp_fused", "torch DDP + Adam(fused=True)", build_ddp_fused, extra=True),
    Strategy("zero", "torch DDP + ZeroRedundancyOptimizer(Adam)", build_zero),
    Strategy("fairscale", "fairscale OSS(Adam) + ShardedDDP", build_fairscale),
    Strategy("oss_ddp", "ddpkit OSS(Adam) + torch DDP", build_oss_ddp),
    Strategy("oss_sdp", "ddpkit OSS(Adam) + ShardedDataParallel", build_oss_sdp),
    Strategy("oss_sdp_unfused", "ddpkit OSS(Adam, fused=False) + SDP", build_oss_sdp_unfused, extra=True),
    Strategy("oss_sdp_rbs0", "ddpkit OSS(Adam) + SDP(reduce_buffer_size=0)", build_oss_sdp_unbucketed, extra=True),
    Strategy("oss_sdp_sockets", "ddpkit OSS(Adam) + SDP, no shared memory", build_oss_sdp_sockets, extra=True),
    Strategy("no_comm", "reference: no communication, Adam(fused)", build_no_comm, extra=True, reference=True),
]
BY_KEY = {s.key: s for s in STRATEGIES}


def fairscale_unavailable() -> str | None:
    """Why fairscale cannot be benchmarked here, or None when it imports."""
    try:
        import fairscale  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        name = f"{type(exc).__name__}: {exc}"
        return f"`import fairscale` failed ({name}); to compare: pip install --no-deps fairscale==0.4.13"
    return None


# -- one rank's run ---------------------------------------------------------------------------------------------------


@dataclass
class Timer:
    """Wall-clock seconds per phase for the current step; `local_step` is filled in by the wrapped local optimizer."""

    phases: dict[str, list[float]] = field(default_factory=dict)
    local_step: float = 0.0

    def add(self, name: str, seconds: float) -> None:
        self.phases.setdefault(name, []).append(seconds)


def wrap_local_step(optimizer: torch.optim.Optimizer, timer: Timer) -> None:
    """Times the local optimizer's own update, to tell it apart from the sharded optimizer's communication."""
    original = optimizer.step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timer.local_step += time.perf_counter() - start

    optimizer.step = timed_step  # type: ignore[method-assign]


def train_step(setup: Setup, batch: tuple[torch.Tensor, torch.Tensor], timer: Timer) -> None:
    """One timed step: zero_grad + forward, backward (with its gradient communication), optimizer step."""
    x, y = batch
    timer.local_step = 0.0
    t0 = time.perf_counter()
    setup.model.zero_grad(set_to_none=True)  # fairscale's ShardedDDP needs its own zero_grad (bucket views)
    loss = nn.functional.mse_loss(setup.model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    setup.optimizer.step()
    t3 = time.perf_counter()
    timer.add("step", t3 - t0)
    timer.add("forward", t1 - t0)
    timer.add("backward", t2 - t1)
    timer.add("optimizer", t3 - t2)
    timer.add("local_update", timer.local_step)
    timer.add("optimizer_other", t3 - t2 - timer.local_step)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in `optimizer.state` (exp_avg, exp_avg_sq, step for Adam)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total


def memory_mb(field_name: str) -> float:
    """`VmHWM` (peak resident set) or `VmRSS` (current) of this process, in MiB, from /proc/self/status.

    Not ``getrusage().ru_maxrss``: Linux carries that over from the parent across fork + exec, so a spawned rank
    would report the benchmark parent's size; VmHWM belongs to the process's own address space.
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"{field_name} not found in /proc/self/status")


def proportional_set_mb() -> float:
    """This process's PSS in MiB (shared pages split between their mappers), from /proc/self/smaps_rollup."""
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("Pss not found in /proc/self/smaps_rollup")


def rank_divergence(params: torch.Tensor) -> float:
    """Max |difference| between this rank's parameters and any other rank's (a collective)."""
    high, low = params.clone(), params.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return float((high - low).abs().max())


def run_rank(rank: int, world_size: int, key: str, config: dict[str, Any]) -> dict[str, Any]:
    """Builds strategy `key` on this rank, trains, and returns its measurements (rank 0 adds its parameters)."""
    torch.set_num_threads(1)
    python_stats = CommStats()
    install_counting_shim(python_stats)
    base_rss = memory_mb("VmRSS")
    steps, warmup = config["steps"], config["warmup"]
    batches = make_batches(config["seed"], rank, warmup + steps, config["batch"])
    setup = BY_KEY[key].build(make_model(config["seed"]))
    timer = Timer()
    wrap_local_step(setup.local_optimizer, timer)
    for i, batch in enumerate(batches):
        if i == warmup:
            timer.phases.clear()
            comm_stats.reset()
            python_stats.reset()
        dist.barrier()
        train_step(setup, batch, timer)
        if rank == 0 and (i + 1) % 5 == 0:
            print(f"    {key}: step {i + 1}/{len(batches)}", flush=True)
    sent = comm_stats.total().sent_bytes + python_stats.total().sent_bytes
    shared = comm_stats.payload_bytes("shared_memory")
    calls = comm_stats.total().calls + python_stats.total().calls
    params = torch.cat([p.detach().reshape(-1) for p in setup.model.parameters()])
    result = {
        "phases_ms": {name: statistics.median(v) * 1e3 for name, v in timer.phases.items()},
        "state_bytes": state_bytes(setup.local_optimizer),
        "peak_rss_mb": memory_mb("VmHWM"),
        "rss_growth_mb": memory_mb("VmHWM") - base_rss,
        "pss_mb": proportional_set_mb(),
        "sent_bytes_per_step": sent / steps,
        "shared_bytes_per_step": shared / steps,
        "calls_per_step": calls / steps,
        "rank_divergence": rank_divergence(params),
    }
    if rank == 0:
        result["params"] = params
    return result


# -- the parent: run every strategy, compare, print -----------------------------------------------------------------


def run_strategy(key: str, config: dict[str, Any]) -> dict[str, Any]:
    """Runs `key` on fresh ranks; returns its row (max over ranks) plus rank 0's final parameters."""
    ranks = run_distributed(run_rank, WORLD_SIZE, key, config, fresh=True, timeout=config["timeout"], pg_timeout=300)
    return {
        "key": key,
        "label": BY_KEY[key].label,
        "extra": BY_KEY[key].extra,
        "reference": BY_KEY[key].reference,
        "step_ms": max(r["phases_ms"]["step"] for r in ranks),
        "phases_ms": {name: max(r["phases_ms"][name] for r in ranks) for name in ranks[0]["phases_ms"]},
        "state_mb": max(r["state_bytes"] for r in ranks) / 2**20,
        "state_mb_per_rank": [r["state_bytes"] / 2**20 for r in ranks],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "rss_growth_mb": max(r["rss_growth_mb"] for r in ranks),
        "pss_sum_mb": sum(r["pss_mb"] for r in ranks),
        "sent_mb_per_step": max(r["sent_bytes_per_step"] for r in ranks) / 2**20,
        "shared_mb_per_step": max(r["shared_bytes_per_step"] for r in ranks) / 2**20,
        "calls_per_step": max(r["calls_per_step"] for r in ranks),
        "rank_divergence": max(r["rank_divergence"] for r in ranks),
        "params": ranks[0]["params"],
    }


def add_comparisons(rows: list[dict[str, Any]], tolerance: float) -> None:
    """Ratios against the DDP baseline, and each run's max parameter difference from it."""
    base = next((r for r in rows if r["key"] == "ddp"), rows[0])
    for row in rows:
        row["step_vs_ddp"] = row["step_ms"] / base["step_ms"]
        row["median_rounds_vs_ddp"] = row["step_ms_median_rounds"] / base["step_ms_median_rounds"]
        row["bytes_vs_ddp"] = row["sent_mb_per_step"] / base["sent_mb_per_step"] if base["sent_mb_per_step"] else None
        row["max_param_diff_vs_ddp"] = float((row["params"] - base["params"]).abs().max())
        same = row["max_param_diff_vs_ddp"] <= tolerance and row["rank_divergence"] <= tolerance
        row["matches_ddp"] = None if row["reference"] else same


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'strategy':<{LABEL_WIDTH}}{'step ms':>8}{'x DDP':>7}{'rounds med':>11}{'x DDP':>7}"
        f"{'opt state MB':>14}{'peak RSS MB':>13}{'RSS +MB':>9}{'PSS sum MB':>12}"
        f"{'sent MB/step':>14}{'x DDP':>7}{'shm MB/step':>13}{'max |dp|':>10}  same?"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio_bytes = f"{r['bytes_vs_ddp']:.2f}" if r["bytes_vs_ddp"] is not None else "-"
        lines.append(
            f"{r['label']:<{LABEL_WIDTH}}{r['step_ms']:>8.1f}{r['step_vs_ddp']:>7.2f}"
            f"{r['step_ms_median_rounds']:>11.1f}{r['median_rounds_vs_ddp']:>7.2f}{r['state_mb']:>14.1f}"
            f"{r['peak_rss_mb']:>13.0f}{r['rss_growth_mb']:>9.0f}{r.get('pss_sum_mb', float('nan')):>12.0f}"
            f"{r['sent_mb_per_step']:>14.1f}{ratio_bytes:>7}"
            f"{r['shared_mb_per_step']:>13.1f}"
            f"{r['max_param_diff_vs_ddp']:>10.1e}  {_same(r['matches_ddp'])}"
        )
    return "\n".join(lines)


def _same(matches: bool | None) -> str:
    return "n/a" if matches is None else "yes" if matches else "NO"


def format_phases(rows: list[dict[str, Any]]) -> str:
    names = ["forward", "backward", "optimizer", "local_update", "optimizer_other"]
    header = f"{'strategy':<{LABEL_WIDTH}}" + "".join(f"{n:>17}" for n in names)
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['label']:<{LABEL_WIDTH}}" + "".join(f"{r['phases_ms'][n]:>17.1f}" for n in names))
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> str:
    """The issue's goal: ddpkit OSS + SDP at or below 0.60x DDP's step time and 0.90x fairscale's."""
    by_key = {r["key"]: r for r in rows}
    ours = by_key.get("oss_sdp")
    if ours is None:
        return "verdict: ddpkit OSS + ShardedDataParallel was not run"
    parts = [_against(ours, by_key.get("ddp"), "DDP", 0.60), _against(ours, by_key.get("fairscale"), "fairscale", 0.90)]
    return "verdict: ddpkit OSS + ShardedDataParallel " + "; ".join(parts)


def _against(ours: dict[str, Any], other: dict[str, Any] | None, name: str, goal: float) -> str:
    if other is None:
        return f"{name} not measured"
    best = ours["step_ms"] / other["step_ms"]
    median = ours["step_ms_median_rounds"] / other["step_ms_median_rounds"]
    met = "met" if max(best, median) <= goal else "NOT met"
    return f"{best:.3f}x {name}'s step time (fastest rounds), {median:.3f}x (median of rounds): goal <= {goal} {met}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per strategy (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole list this many times, round-robin, and keep each strategy's fastest round (default 1)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument(
        "--strategies",
        default=",".join(s.key for s in STRATEGIES),
        help="comma-separated subset of: " + ", ".join(s.key for s in STRATEGIES),
    )
    parser.add_argument("--no-extra", action="store_true", help="only the five strategies the issue asks for")
    parser.add_argument("--tol", type=float, default=1e-4, help="max |param difference| from DDP counted as same")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per strategy")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.rounds < 1:
        parser.error("--steps, --batch and --rounds must be >= 1, --warmup >= 0")
    return args


def selected_strategies(args: argparse.Namespace) -> list[Strategy]:
    keys = [k.strip() for k in args.strategies.split(",") if k.strip()]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        raise SystemExit(f"unknown strategies: {', '.join(unknown)}; choose from {', '.join(BY_KEY)}")
    return [BY_KEY[k] for k in keys if not (args.no_extra and BY_KEY[k].extra)]


def run_all(
    strategies: list[Strategy], config: dict[str, Any], rounds: int
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Runs every strategy `rounds` times (round-robin); keeps, per strategy, the round with the lowest step time."""
    runs: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    total = rounds * len(strategies)
    for r in range(rounds):
        for i, strategy in enumerate(strategies, 1):
            if strategy.key in skipped:
                continue
            print(f"[{r * len(strategies) + i}/{total}] round {r + 1}/{rounds}: {strategy.label} ...", flush=True)
            row, reason = run_one(strategy, config)
            if reason:
                print(f"    {reason}", flush=True)
                skipped[strategy.key] = reason
                continue
            tries = runs.setdefault(strategy.key, [])
            if tries and not torch.equal(row["params"], tries[0]["params"]):
                print("    note: final parameters differ from this strategy's first round", flush=True)
            tries.append(row)
    return [best_round(tries) for tries in runs.values()], skipped


def best_round(tries: list[dict[str, Any]]) -> dict[str, Any]:
    best = dict(min(tries, key=lambda row: row["step_ms"]))
    best["step_ms_rounds"] = [row["step_ms"] for row in tries]
    best["step_ms_median_rounds"] = statistics.median(best["step_ms_rounds"])
    return best


def run_one(strategy: Strategy, config: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(row, None), or (None, why it was skipped or failed)."""
    if strategy.key == "fairscale":
        reason = fairscale_unavailable()
        if reason:
            return None, f"skipped: {reason}"
    start = time.monotonic()
    try:
        row = run_strategy(strategy.key, config)
    except Exception as exc:  # e.g. fairscale on a torch it does not support: report it and go on
        lines = str(exc).strip().splitlines()
        return None, f"failed: {type(exc).__name__}: {lines[-1] if lines else ''}"
    print(f"    done in {time.monotonic() - start:.1f} s: {row['step_ms']:.1f} ms/step", flush=True)
    return row, None


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "backend": "gloo",
        "world_size": WORLD_SIZE,
        "threads_per_rank": 1,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "seed": args.seed}
    config["rounds"] = args.rounds
    config["timeout"] = args.timeout
    n_params = count_parameters()
    print(
        f"MLP {DIM_IN}->{DIM_HIDDEN}->{DIM_HIDDEN}->{DIM_OUT}: {n_params:,} parameters ({n_params * 4 / 2**20:.1f} MB "
        f"fp32); Adam lr {LR}; {WORLD_SIZE} gloo ranks, torch.set_num_threads(1) per rank; batch {args.batch}/rank; "
        f"{args.warmup} warm-up + {args.steps} timed steps",
        flush=True,
    )
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}", flush=True)
    rows, skipped = run_all(selected_strategies(args), config, args.rounds)
    if not rows:
        print("nothing ran")
        return 1
    add_comparisons(rows, args.tol)
    print()
    print(format_table(rows))
    print()
    print("median ms per phase (max over ranks); optimizer = local_update + optimizer_other (communication, copies)")
    print(format_phases(rows))
    for key, reason in skipped.items():
        print(f"skipped {key}: {reason}")
    load_end = os.getloadavg()
    print(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    print(verdict(rows))
    if args.json:
        for row in rows:
            row.pop("params")
        report = {"config": config, "parameters": n_params, "machine": machine(), "results": rows}
        report["skipped"] = skipped
        report["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        report["load_average_start"] = list(load_start)
        report["load_average_end"] = list(os.getloadavg())
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0 if all(r["matches_ddp"] is not False for r in rows) else 2


if __name__ == "__main__":
    raise SystemExit(main())
