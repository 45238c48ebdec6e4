"""`ddpkit bench`: every strategy on the same synthetic workload, side by side, with ratios against DDP."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from ddpkit.distributed import comm, comm_stats
from ddpkit.distributed.launch import Placement, free_port, join, leave, pick_backend, spawn
from ddpkit.optim import OSS
from ddpkit.train.config import STRATEGIES, TrainConfig
from ddpkit.train.models import mlp
from ddpkit.train.report import gather_per_rank, peak_memory_mb
from ddpkit.train.strategies import build_strategy
from ddpkit.train.timing import optimizer_state_bytes as state_bytes
from ddpkit.train.timing import timed_steps
from ddpkit.train.trainer import Trainer

FEATURES, CLASSES = 1024, 10


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in this rank's optimizer state (OSS: its shard only)."""
    return state_bytes(optimizer.optim if isinstance(optimizer, OSS) else optimizer)


def _measure(cfg: TrainConfig, steps: int, warmup: int, placement: Placement) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    module = mlp(FEATURES, CLASSES, cfg.hidden, cfg.depth)
    strategy = build_strategy(cfg, module, torch.device("cpu"))
    g = torch.Generator().manual_seed(placement.rank)
    batches = [
        (torch.randn(cfg.batch_size, FEATURES, generator=g), torch.randint(0, CLASSES, (cfg.batch_size,), generator=g))
    ]
    trainer = Trainer(strategy.model, strategy.optimizer, batches)  # type: ignore[arg-type]

    def step() -> float:
        with comm_stats.measure() as delta:
            trainer.train_step(batches)
        return delta.sent_bytes()

    times, sent = timed_steps(step, steps, warmup)
    return {
        "strategy": cfg.strategy,
        "parameters": sum(p.numel() for p in module.parameters()),
        "step_ms_median": max(gather_per_rank(statistics.median(times) * 1e3)),
        "samples_per_second": cfg.batch_size * placement.world_size / max(gather_per_rank(statistics.median(times))),
        "sent_bytes_per_step": statistics.fmean(gather_per_rank(statistics.fmean(sent))),
        "optimizer_state_bytes_per_rank": max(gather_per_rank(optimizer_state_bytes(strategy.optimizer))),
        "peak_memory_mb": max(gather_per_rank(peak_memory_mb())),
    }


def _bench_process(local_rank: int, cfg: TrainConfig, port: int, steps: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    placement = Placement(local_rank, cfg.world_size, local_rank, "127.0.0.1", port)
    join(placement, pick_backend(cfg.backend, device="cpu"), cfg.timeout)
    try:
        result = _measure(cfg, steps, warmup, placement)
        if local_rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        comm.barrier()
    except BaseException:
        leave()
        raise
    # Tearing the gloo group down while a peer is still finishing the barrier, or destroying it at the same
    # moment as the peer, makes torch 2.13 abort in C++ now and then ("terminate called without an active
    # exception"). The results are written and every rank reached the barrier: give the peers a moment to leave
    # it, then end the process without the teardown; the operating system closes the connections.
    time.sleep(0.5)
    sys.stdout.flush()
    os._exit(0)


def format_table(results: list[dict[str, Any]]) -> str:
    base = next((r for r in results if r["strategy"] == "ddp"), results[0])
    head = f"{'strategy':<9}{'step ms':>9}{'x ddp':>7}{'samples/s':>11}{'MB sent/step':>14}{'x ddp':>7}"
    head += f"{'optim state MB':>16}{'x ddp':>7}{'peak MB':>9}"
    rows = [head]
    for r in results:
        rows.append(
            f"{r['strategy']:<9}{r['step_ms_median']:>9.1f}{r['step_ms_median'] / base['step_ms_median']:>7.2f}"
            f"{r['samples_per_second']:>11.0f}{r['sent_bytes_per_step'] / 1e6:>14.2f}"
            f"{r['sent_bytes_per_step'] / max(base['sent_bytes_per_step'], 1):>7.2f}"
            f"{r['optimizer_state_bytes_per_rank'] / 1e6:>16.1f}"
            f"{r['optimizer_state_bytes_per_rank'] / max(base['optimizer_state_bytes_per_rank'], 1):>7.2f}"
            f"{r['peak_memory_mb']:>9.0f}"
        )
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Three bar charts: step time, bytes sent per step and optimizer state per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["strategy"] for r in results]
    panels = [
        ("step_ms_median", "median step time (ms)", 1.0),
        ("sent_bytes_per_step", "sent per step and rank (MB)", 1e6),
        ("optimizer_state_bytes_per_rank", "optimizer state per rank (MB)", 1e6),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (key, title, unit) in zip(axes, panels, strict=True):
        ax.bar(names, [r[key] / unit for r in results], color="tab:blue")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs each strategy in its own fresh processes (so peak memory is per strategy) and prints the table."""
    given = vars(args)
    names = given.get("strategies", ",".join(STRATEGIES)).split(",")
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ValueError(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    cfg = TrainConfig(
        nproc_per_node=given.get("nproc_per_node", 2),
        batch_size=given.get("batch_size", 32),
        hidden=given.get("hidden", 1024),
        depth=given.get("depth", 4),
        optimizer=given.get("optimizer", "adam"),
        backend=given.get("backend", "auto"),
        timeout=given.get("timeout", 60.0),
        slowmo_momentum=0.0,  # plain local SGD every 3 steps: the cheapest SlowMo traffic pattern
        nprocs_per_node_slowmo=1,
    )
    steps, warmup = given.get("steps", 20), given.get("warmup", 3)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(f"bench: {name} on {cfg.nproc_per_node} processes ...", flush=True)
            out = os.path.join(tmp, f"{name}.json")
            spawn(
                _bench_process,
                cfg.nproc_per_node,
                (dataclasses.replace(cfg, strategy=name), free_port(), steps, warmup, out),
            )
            with open(out) as f:
                results.append(json.load(f))
    print(f"MLP with {results[0]['parameters'] / 1e6:.1f}M parameters, batch {cfg.batch_size} per process, "
          f"{cfg.optimizer}, {steps} timed steps")  # fmt: skip
    print(format_table(results))
    plot_path = given.get("plot", "bench.png")
    plot(results, plot_path)
    print(f"wrote {plot_path}")
    if "json_path" in given:
        with open(given["json_path"], "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {given['json_path']}")
    return results
