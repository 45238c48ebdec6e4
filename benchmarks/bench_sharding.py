"""Sharding: is ddpkit's OSS + ShardedDataParallel faster and smaller than torch DDP, torch ZeRO and fairscale?

Every strategy trains the same MLP with Adam (lr 1e-3) on the same synthetic data, in fresh spawned gloo CPU
processes (so peak memory is per strategy), one thread per rank, at each world size of ``--world-size``; the
strategies run interleaved, ``--rounds`` times round-robin. Measured per strategy and world size: the median step
time (zero_grad + forward + backward + optimizer step, after an untimed barrier), max over ranks, best and median
over rounds; the optimizer state, peak RSS and PSS (summed over ranks: the job's memory); bytes sent per step in
ddpkit's wire model and bytes handed over through shared memory; the final parameters' difference from DDP's.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.lib import memory, peers, plotting, workloads
from benchmarks.lib.cli import UsageError, progress
from benchmarks.lib.counting import install_counting_shim
from benchmarks.lib.tables import markdown, num
from ddpkit.distributed import comm_stats, counting_allreduce_hook
from ddpkit.distributed.stats import CommStats
from ddpkit.measure.timing import PhaseTimer, RoundSummary, interleaved, optimizer_state_bytes, ratio
from ddpkit.testing import run_distributed
from ddpkit.train.loop.strategies import build_strategy
from ddpkit.train.settings.config import TrainConfig

QUESTION = "sharding: step time, memory and bytes of OSS + ShardedDataParallel against DDP, torch ZeRO, fairscale"
FIVE = "ddp,zero,fairscale,oss_ddp,oss_sdp"  # the strategies the goal names
QUICK = {"steps": 3, "warmup": 1, "rounds": 1, "batch": 8, "strategies": FIVE + ",fsdp2", "reuse_processes": True}
LR = 1e-3
PYTHON_STATS = CommStats()  # collectives that torch's ZeRO and fairscale call from Python, per rank process
GOAL_VS_DDP, GOAL_VS_FAIRSCALE = 0.60, 0.90

# -- the strategies ---------------------------------------------------------------------------------------------------


@dataclass
class Setup:
    """What a strategy builds: the module to call, the optimizer to step, and the optimizer that holds the state."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    local_optimizer: torch.optim.Optimizer


def _ddpkit(strategy: str, model: nn.Module) -> Setup:
    """The strategies `ddpkit train` and `ddpkit bench` offer, built by the same code."""
    built = build_strategy(TrainConfig(strategy=strategy, optimizer="adam", lr=LR), model, torch.device("cpu"))
    local = getattr(built.optimizer, "optim", built.optimizer)
    return Setup(built.model, built.optimizer, local)


def _counted_ddp(model: nn.Module) -> DDP:
    ddp = DDP(model)
    ddp.register_comm_hook(None, counting_allreduce_hook)  # its C++ all-reduce then shows in comm_stats
    return ddp


def _ddp_fused(model: nn.Module) -> Setup:
    ddp = _counted_ddp(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=LR, fused=True)
    return Setup(ddp, optimizer, optimizer)


def _zero(model: nn.Module) -> Setup:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = _counted_ddp(model)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    return Setup(ddp, optimizer, optimizer.optim)


def _fairscale(model: nn.Module) -> Setup:
    from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP
    from fairscale.optim import OSS as FairscaleOSS

    optimizer = FairscaleOSS(model.parameters(), optim=torch.optim.Adam, lr=LR)
    return Setup(FairscaleSDP(model, optimizer), optimizer, optimizer.optim)


def _oss_sdp(model: nn.Module, sdp: dict[str, Any] | None = None, **adam: Any) -> Setup:
    from ddpkit.nn import ShardedDataParallel
    from ddpkit.optim import OSS

    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=LR, **adam)
    return Setup(ShardedDataParallel(model, optimizer, **(sdp or {})), optimizer, optimizer.optim)


def _oss_sdp_mmap(model: nn.Module) -> Setup:
    from ddpkit.distributed.allocator import return_freed_memory

    return_freed_memory()  # this rank's freed large blocks go back to the system (fresh processes per run)
    return _ddpkit("sharded", model)


def _oss_sdp_sockets(model: nn.Module) -> Setup:
    os.environ["DDPKIT_SHARED_MEMORY"] = "0"  # as between hosts: every byte over gloo (fresh processes per run)
    return _oss_sdp(model)


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one, as its users wrap them: the elements of the model's ModuleLists (the
    GPT's blocks; its embeddings and the head tied to them stay with the root), or, without any, the root's
    children that hold parameters (the MLP's layers). The root is wrapped last, with whatever is left."""
    units = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    return units or [c for c in model.children() if any(True for _ in c.parameters())]


def _fsdp2(model: nn.Module, reshard_after_forward: bool) -> Setup:
    """torch's FSDP2 (`fully_shard`): every parameter split over the ranks, gathered for forward and backward,
    gradients reduce-scattered; ``reshard_after_forward=False`` keeps the gathered parameters from forward to
    backward (ZeRO-2's memory), True gathers them again in backward (ZeRO-3)."""
    from torch.distributed.fsdp import fully_shard

    for unit in _fsdp_units(model):
        fully_shard(unit, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return Setup(model, optimizer, optimizer)


def _no_comm(model: nn.Module) -> Setup:
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    return Setup(model, optimizer, optimizer)


STRATEGIES: dict[str, tuple[str, Any]] = {  # key: (label, build); extras after the five the goal names
    "ddp": ("torch DDP + Adam (baseline)", lambda m: _ddpkit("ddp", m)),
    "zero": ("torch DDP + ZeroRedundancyOptimizer(Adam)", _zero),
    "fairscale": ("fairscale OSS(Adam) + ShardedDDP", _fairscale),
    "oss_ddp": ("ddpkit OSS(Adam) + torch DDP", lambda m: _ddpkit("oss", m)),
    "oss_sdp": ("ddpkit OSS(Adam) + ShardedDataParallel", lambda m: _ddpkit("sharded", m)),
    "ddp_fused": ("extra: torch DDP + Adam(fused=True)", _ddp_fused),
    "oss_sdp_unfused": ("extra: ddpkit OSS(Adam, fused=False) + SDP", lambda m: _oss_sdp(m, fused=False)),
    "oss_sdp_rbs0": ("extra: ddpkit SDP(reduce_buffer_size=0)", lambda m: _oss_sdp(m, {"reduce_buffer_size": 0})),
    "oss_sdp_sockets": ("extra: ddpkit OSS + SDP, no shared memory", _oss_sdp_sockets),
    "oss_sdp_mmap": ("extra: ddpkit OSS + SDP, freed memory returned at once", _oss_sdp_mmap),
    "oss_sdp_shared": (
        "ddpkit OSS(shared_parameters) + SDP: parameters once per host",
        lambda m: _oss_sdp(m, shared_parameters=True),
    ),
    "fsdp2": ("torch FSDP2 fully_shard(reshard_after_forward=False) + Adam", lambda m: _fsdp2(m, False)),
    "fsdp2_reshard": ("torch FSDP2 fully_shard(reshard_after_forward=True) + Adam", lambda m: _fsdp2(m, True)),
    "no_comm": ("reference: no communication, Adam(fused)", _no_comm),
}
REFERENCE = {"no_comm"}  # not data parallel: a floor for the step time; its parameters differ from DDP's
FRESH_ALWAYS = {
    "oss_sdp_sockets",
    "oss_sdp_mmap",
}  # sets DDPKIT_SHARED_MEMORY=0 for its processes: never shared with others
PEERS = {"fairscale": ("fairscale", "pip install --no-deps fairscale==0.4.13")}  # compared where installed


# -- one rank's run ---------------------------------------------------------------------------------------------------


def _time_local_update(optimizer: torch.optim.Optimizer, timer: PhaseTimer) -> None:
    """Records the local optimizer's own update as phase "local_update", apart from the sharding's communication."""
    original = optimizer.step

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timer.add("local_update", time.perf_counter() - start)

    optimizer.step = timed  # type: ignore[method-assign]


def _step(setup: Setup, workload: workloads.Workload, batch: workloads.Batch, timer: PhaseTimer) -> None:
    x, y = batch
    timer.start()
    setup.model.zero_grad(set_to_none=True)  # fairscale's ShardedDDP needs its own zero_grad (bucket views)
    loss = workload.loss(setup.model(x), y)
    timer.lap("forward")
    loss.backward()
    timer.lap("backward")
    setup.optimizer.step()
    timer.lap("optimizer")
    timer.stop()


def run_rank(rank: int, world_size: int, key: str, workload: workloads.Workload, cfg: dict[str, Any]) -> dict:
    """Builds strategy `key` on this rank, trains, and returns its measurements (rank 0 adds its parameters)."""
    torch.set_num_threads(1)
    python_stats = PYTHON_STATS  # the shim is installed once per process and records here
    install_counting_shim(python_stats)
    base_rss = memory.rss_mb()
    batches = workload.batches(cfg["seed"], rank, cfg["warmup"] + cfg["steps"], cfg["batch"])
    setup = STRATEGIES[key][1](workload.model(cfg["seed"]))
    timer = PhaseTimer()
    _time_local_update(setup.local_optimizer, timer)
    for i, batch in enumerate(batches):
        if i == cfg["warmup"]:
            timer.clear()
            comm_stats.reset()
            python_stats.reset()
        dist.barrier()
        _step(setup, workload, batch, timer)
    steps = cfg["steps"]
    sent = (comm_stats.total().sent_bytes + python_stats.total().sent_bytes) / steps  # before the checks below
    params = torch.cat([_whole(p).reshape(-1) for p in setup.model.parameters()])
    high, low = params.clone(), params.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return {
        "phases_ms": timer.medians_ms(),
        "state_bytes": optimizer_state_bytes(setup.local_optimizer),
        "peak_rss_mb": memory.peak_rss_mb(),
        "rss_growth_mb": memory.peak_rss_mb() - base_rss,
        "pss_mb": memory.pss_mb(),
        "sent_bytes": sent,
        "shared_bytes": comm_stats.payload_bytes("shared_memory") / steps,
        "rank_divergence": float((high - low).abs().max()),
        "params": params if rank == 0 else None,
    }


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor on every rank: FSDP2's sharded DTensors are gathered (a collective)."""
    full = getattr(param, "full_tensor", None)
    return (full() if full is not None else param).detach()


def measure(key: str, world_size: int, workload: workloads.Workload, cfg: dict[str, Any]) -> dict[str, Any]:
    """One strategy at one world size on fresh ranks: its row (max over ranks; PSS summed) and rank 0's params."""
    fresh = not cfg["reuse_processes"] or key in FRESH_ALWAYS
    ranks = run_distributed(
        run_rank, world_size, key, workload, cfg, fresh=fresh, timeout=cfg["timeout"], pg_timeout=300
    )
    phases = {name: max(r["phases_ms"][name] for r in ranks) for name in ranks[0]["phases_ms"]}
    phases["optimizer_other"] = phases["optimizer"] - phases.get("local_update", 0.0)
    return {
        "step_ms": phases["step"],
        "phases_ms": phases,
        "state_mb": max(r["state_bytes"] for r in ranks) / 2**20,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "rss_growth_mb": max(r["rss_growth_mb"] for r in ranks),
        "pss_sum_mb": sum(r["pss_mb"] for r in ranks),
        "sent_mb_per_step": max(r["sent_bytes"] for r in ranks) / 2**20,
        "shared_mb_per_step": max(r["shared_bytes"] for r in ranks) / 2**20,
        "rank_divergence": max(r["rank_divergence"] for r in ranks),
        "params": ranks[0]["params"],
    }


# -- every strategy at every world size, interleaved -----------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = parse_sizes(args.world_size)
    keys = parse_strategies(args.strategies)
    workload = workloads.workload(args.workload, quick=args.quick)
    cfg = {k: getattr(args, k) for k in ("steps", "warmup", "batch", "seed", "timeout", "reuse_processes")}
    skipped = {k: why for k in keys if k in PEERS and (why := peers.unavailable(*PEERS[k]))}
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    plan = [(size, r, key) for size in sizes for r, key in interleaved(keys, args.rounds) if key not in skipped]
    for size, _, key in progress(plan, desc="sharding"):
        if key in skipped:
            continue
        try:
            runs.setdefault((size, key), []).append(measure(key, size, workload, cfg))
        except Exception as exc:  # e.g. a peer library on a torch it does not support: report it and go on
            skipped[key] = f"failed at world size {size}: {type(exc).__name__}: {str(exc).strip()[-300:]}"
            print(f"{key}: {skipped[key]}", flush=True)
    by_size = {str(size): compare([(k, runs[size, k]) for k in keys if (size, k) in runs], args.tol) for size in sizes}
    return {
        "workload": workload.describe(),
        "parameters": sum(p.numel() for p in workload.model(0).parameters()),
        "world_sizes": sizes,
        "by_world_size": by_size,
        "scaling": scaling(by_size),
        "skipped": skipped,
        "verdict": verdict(by_size),
    }


def compare(tries: list[tuple[str, list[dict[str, Any]]]], tol: float) -> list[dict[str, Any]]:
    """One row per strategy: its fastest round's figures, the step time over rounds, ratios against DDP."""
    rows = []
    for key, rounds in tries:
        row = dict(min(rounds, key=lambda r: r["step_ms"]))
        row.update(key=key, label=STRATEGIES[key][0], step_ms_rounds=RoundSummary.of([r["step_ms"] for r in rounds]))
        rows.append(row)
    base = next((r for r in rows if r["key"] == "ddp"), rows[0])
    for row in rows:
        rounds, base_rounds = row["step_ms_rounds"], base["step_ms_rounds"]
        row["step_vs_ddp"] = ratio(rounds.best, base_rounds.best)
        row["median_vs_ddp"] = ratio(rounds.median, base_rounds.median)
        row["bytes_vs_ddp"] = ratio(row["sent_mb_per_step"], base["sent_mb_per_step"])
        row["pss_vs_ddp"] = ratio(row["pss_sum_mb"], base["pss_sum_mb"])
        row["max_param_diff_vs_ddp"] = float((row["params"] - base["params"]).abs().max())
        same = row["max_param_diff_vs_ddp"] <= tol and row["rank_divergence"] <= tol
        row["matches_ddp"] = None if row["key"] in REFERENCE else same
    for row in rows:
        row["step_ms_rounds"] = row["step_ms_rounds"].as_dict()
        row.pop("params")
    return rows


def scaling(by_size: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per strategy and world size: step time, memory and bytes, each also as a ratio against DDP at that size."""
    fields = ("step_ms", "step_vs_ddp", "median_vs_ddp", "state_mb", "pss_sum_mb", "pss_vs_ddp")
    fields += ("sent_mb_per_step", "bytes_vs_ddp")
    return [
        {"world_size": int(size), "key": r["key"], **{f: r[f] for f in fields}}
        for size, rows in by_size.items()
        for r in rows
    ]


def verdict(by_size: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """The goal at each world size: OSS + SDP at or below 0.60x DDP's step time and 0.90x fairscale's."""
    out = {}
    for size, rows in by_size.items():
        by_key = {r["key"]: r["step_ms_rounds"] for r in rows}
        parts = []
        for name, key, goal in (("DDP", "ddp", GOAL_VS_DDP), ("fairscale", "fairscale", GOAL_VS_FAIRSCALE)):
            if "oss_sdp" not in by_key or key not in by_key:
                parts.append(f"OSS + SDP against {name}: not measured")
                continue
            ours, other = by_key["oss_sdp"], by_key[key]
            best, median = ours["best"] / other["best"], ours["median"] / other["median"]
            met = "met" if max(best, median) <= goal else "NOT met"
            parts.append(f"OSS + SDP {best:.2f}x {name} (best rounds), {median:.2f}x (median): goal <= {goal} {met}")
        out[size] = "; ".join(parts)
    return out


# -- the tables and the plot -----------------------------------------------------------------------------------------


HEADER = ["strategy", "step ms (best)", "x DDP", "x DDP (median)", "opt state MB", "peak RSS MB", "PSS sum MB"]
HEADER += ["sent MB/step", "x DDP", "shm MB/step", "max abs dp", "same as DDP"]


PHASES = ("forward", "backward", "optimizer", "local_update", "optimizer_other")  # optimizer = the last two


def _row(r: dict[str, Any]) -> list[str]:
    same = {None: "n/a", True: "yes", False: "NO"}[r["matches_ddp"]]
    ratios = [num(r["step_vs_ddp"]), num(r["median_vs_ddp"])]
    memory = [f"{r['state_mb']:.1f}", f"{r['peak_rss_mb']:.0f}", f"{r['pss_sum_mb']:.0f}"]
    traffic = [f"{r['sent_mb_per_step']:.1f}", num(r["bytes_vs_ddp"]), f"{r['shared_mb_per_step']:.1f}"]
    return [r["label"], f"{r['step_ms']:.1f}", *ratios, *memory, *traffic, f"{r['max_param_diff_vs_ddp']:.1e}", same]


def table(report: dict[str, Any]) -> str:
    figures = report["figures"]
    out = [f"{figures['workload']}; Adam lr {LR}; batch {report['config']['batch']}/rank; gloo, 1 thread per rank"]
    for size, rows in figures["by_world_size"].items():
        out += ["", f"world size {size}", markdown(HEADER, [_row(r) for r in rows])]
        out.append(f"verdict at world size {size}: {figures['verdict'][size]}")
        phases = [[r["key"], *(num(r["phases_ms"].get(p), ".1f") for p in PHASES)] for r in rows]
        out += ["", f"median ms per phase at world size {size}", markdown(["strategy", *PHASES], phases)]
    if len(figures["by_world_size"]) > 1:
        out += [
            "",
            "scaling: step time / PSS sum / bytes sent, each x DDP at the same world size",
            scaling_table(figures),
        ]
    out += [f"skipped {k}: {why}" for k, why in figures["skipped"].items()]
    if report["config"].get("reuse_processes"):
        out.append("--reuse-processes: the strategies shared rank processes, so peak RSS and PSS are not per strategy")
    return "\n".join(out)


def scaling_table(figures: dict[str, Any]) -> str:
    """Strategies down, world sizes across."""
    sizes = figures["world_sizes"]
    at = {(p["key"], p["world_size"]): p for p in figures["scaling"]}
    keys = dict.fromkeys(p["key"] for p in figures["scaling"])
    fields = ("step_vs_ddp", "pss_vs_ddp", "bytes_vs_ddp")
    cells = [[k] + [" / ".join(num(at[k, s][f]) for f in fields) if (k, s) in at else "-" for s in sizes] for k in keys]
    return markdown(["strategy"] + [f"{s} ranks" for s in sizes], cells)


def plot(report: dict[str, Any], out_dir: Path) -> None:
    """Step time, PSS and bytes per step against DDP's, per strategy, one line per world size."""
    plt = plotting.pyplot()
    figures = report["figures"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    panels = (
        ("step_vs_ddp", "step time x DDP"),
        ("pss_vs_ddp", "memory (PSS sum) x DDP"),
        ("bytes_vs_ddp", "bytes sent x DDP"),
    )
    for size, rows in figures["by_world_size"].items():
        labels = [r["key"] for r in rows]
        for ax, (field, name) in zip(axes, panels, strict=True):
            ax.plot([r[field] or 0 for r in rows], labels, "o", label=f"{size} ranks")
            ax.axvline(1.0, color="black", lw=0.8)
            ax.set_xlabel(name)
    axes[0].legend()
    sizes = ",".join(str(s) for s in figures["world_sizes"])
    fig.suptitle(plotting.title(figures["workload"], sizes, report))
    plotting.save(fig, "sharding", out_dir)


# -- options ---------------------------------------------------------------------------------------------------------


def parse_sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s.strip().isdigit()]
    if not sizes or len(sizes) != len(text.split(",")) or any(s < 2 for s in sizes):
        raise UsageError(f"--world-size: expected sizes >= 2 separated by commas, e.g. 2,4,8; got {text!r}")
    return sizes


def parse_strategies(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in STRATEGIES]
    if unknown or not keys:
        raise UsageError(f"--strategies: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(STRATEGIES)}")
    return keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", default="2", help="ranks, or sizes to compare separated by commas: 2,4,8")
    parser.add_argument("--workload", default="mlp", choices=list(workloads.WORKLOADS), help="what to train")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every strategy, interleaved round-robin")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data")
    parser.add_argument("--tol", type=float, default=1e-4, help="max abs parameter difference from DDP counted as same")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run")
    parser.add_argument(
        "--reuse-processes",
        action="store_true",
        help="one pool of rank processes for all strategies but oss_sdp_sockets (quicker; memory not per strategy)",
    )
