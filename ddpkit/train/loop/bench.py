"""`ddpkit bench`: every strategy on the same workload, side by side, with ratios against DDP, and advice.

The workload is an MLP on synthetic data unless ``--model``/``--data`` name another (``gpt``/``text``, or your
factories). Each strategy runs in fresh processes for ``--warmup`` + ``--steps`` steps on one fixed batch per
rank; the link between the processes is measured first. ``ddpkit.measure.advisor`` turns the figures into a
predicted step time per strategy on a given link and a recommendation."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddpkit.distributed import comm, comm_stats
from ddpkit.distributed.launch import Placement, exit_without_teardown, free_port, join, leave, pick_backend
from ddpkit.distributed.local_processes import spawn
from ddpkit.distributed.objects import gather_objects
from ddpkit.measure import advisor
from ddpkit.measure.timing import optimizer_state_bytes as state_bytes
from ddpkit.measure.timing import relative_spread, step_time, timed_steps, window_means
from ddpkit.optim import OSS
from ddpkit.train.loop.report import gather_per_rank, peak_memory_mb
from ddpkit.train.loop.strategies import OPTIMIZER_CLASSES, build_strategy, optimizer_arguments
from ddpkit.train.loop.trainer import Trainer
from ddpkit.train.settings.config import SLOW_LINK_FLAGS, STRATEGIES, TrainConfig, validate
from ddpkit.train.workloads.workload import Workload, build_workload

FEATURES, CLASSES = 1024, 10
BENCH_STRATEGIES = (*STRATEGIES, "sgp")  # sgp: --strategy slowmo --slowmo-base sgp, with its other settings


def strategy_config(cfg: TrainConfig, name: str) -> TrainConfig:
    """The run of bench strategy `name` (one of BENCH_STRATEGIES) on `cfg`."""
    if name == "sgp":  # gossip sends parameters: the slow-link settings are local SGD's
        exact = {n: getattr(TrainConfig, n) for n in SLOW_LINK_FLAGS}
        return dataclasses.replace(cfg, strategy="slowmo", slowmo_base="sgp", **exact)
    return dataclasses.replace(cfg, strategy=name, slowmo_base="localsgd")


def strategy_label(cfg: TrainConfig) -> str:
    return "sgp" if cfg.strategy == "slowmo" and cfg.slowmo_base == "sgp" else cfg.strategy


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in this rank's optimizer state (OSS: its shard only)."""
    return state_bytes(optimizer.optim if isinstance(optimizer, OSS) else optimizer)


def _first_batch(dataset: Any, cfg: TrainConfig, placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
    sampler = DistributedSampler(dataset, placement.world_size, placement.rank, shuffle=True, seed=cfg.seed)
    return next(iter(DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler)))


PERIOD = 3  # SlowMo's averaging period in the bench: steps are timed in windows of this many


def _local_compute_ms(work: Workload, cfg: TrainConfig, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """This rank's step without any wrapper or communication: forward, backward and the torch optimizer on a copy
    of the model, median of a few steps after a warm-up. A floor for what any strategy's step can cost."""
    plain = copy.deepcopy(work.module)
    optimizer = OPTIMIZER_CLASSES[cfg.optimizer](plain.parameters(), **optimizer_arguments(cfg))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        work.loss_fn(plain(batch[0]), batch[1]).backward()
        optimizer.step()

    seconds, _ = timed_steps(step, steps=2 * PERIOD, warmup=PERIOD)  # a cold first step times high
    return statistics.median(seconds) * 1e3


def _slowest_windows_ms(times: list[float]) -> list[float]:
    """Each window's mean step in ms, the slowest rank's (the job goes at its pace; a collective of the group)."""
    mine = window_means(times, PERIOD) or [statistics.fmean(times)]
    every = gather_objects([w * 1e3 for w in mine], dst=-1)
    assert every is not None
    return [max(rank[k] for rank in every) for k in range(len(mine))]


def _measure(cfg: TrainConfig, steps: int, warmup: int, placement: Placement) -> dict[str, Any]:
    link = advisor.measure_link("measured between hosts" if cfg.nnodes > 1 else "measured between local processes")
    work = build_workload(cfg, torch.device("cpu"))
    batches = [_first_batch(work.train, cfg, placement)]
    compute_ms = max(gather_per_rank(_local_compute_ms(work, cfg, batches[0])))
    strategy = build_strategy(cfg, work.module, torch.device("cpu"))
    trainer = Trainer(strategy.model, strategy.optimizer, batches, work.loss_fn)  # type: ignore[arg-type]

    def step() -> tuple[float, int, int]:
        with comm_stats.measure() as delta:
            trainer.train_step(batches)
        shared = delta.total("shared_memory")
        return delta.sent_bytes(), delta.calls() - shared.calls, shared.payload_bytes

    times, values = timed_steps(step, steps, warmup)
    sent, messages, shared = ([v[i] for v in values] for i in range(3))
    windows = _slowest_windows_ms(times)
    step_ms = step_time(windows)
    return {
        "strategy": strategy_label(cfg),
        "workload": work.name,
        "world_size": placement.world_size,
        "timed_steps": steps,
        "warmup_steps": warmup,
        "parameters": sum(p.numel() for p in work.module.parameters()),
        "step_ms": step_ms,
        "step_statistic": STEP_STATISTIC,
        "step_ms_windows": windows,
        "step_spread": relative_spread(windows),
        "local_compute_ms": compute_ms,
        "samples_per_second": cfg.batch_size * placement.world_size / (step_ms / 1e3),
        "sent_bytes_per_step": statistics.fmean(gather_per_rank(statistics.fmean(sent))),
        "wire_bytes_per_step": max(gather_per_rank(statistics.fmean(sent))),
        "messages_per_step": max(gather_per_rank(statistics.fmean(messages))),
        "shared_memory_bytes_per_step": statistics.fmean(gather_per_rank(statistics.fmean(shared))),
        "optimizer_state_bytes_per_rank": max(gather_per_rank(optimizer_state_bytes(strategy.optimizer))),
        "peak_memory_mb": max(gather_per_rank(peak_memory_mb())),
        "link": dataclasses.asdict(link),
    }


STEP_STATISTIC = (
    f"median over windows of {PERIOD} consecutive steps of their mean step time (the slowest rank's), warm-up excluded"
)


def _bench_process(local_rank: int, cfg: TrainConfig, port: int, steps: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    rank = cfg.node_rank * cfg.nproc_per_node + local_rank
    placement = Placement(rank, cfg.world_size, local_rank, cfg.master_addr, port)
    join(placement, pick_backend(cfg.backend, device="cpu"), cfg.timeout, multi_node=cfg.nnodes > 1)
    try:
        result = _measure(cfg, steps, warmup, placement)
        if rank == 0:
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
    exit_without_teardown()


def format_table(results: list[dict[str, Any]]) -> str:
    base = next((r for r in results if r["strategy"] == "ddp"), results[0])
    head = f"{'strategy':<9}{'step ms':>9}{'x ddp':>7}{'samples/s':>11}{'MB sent/step':>14}{'x ddp':>7}"
    head += f"{'optim state MB':>16}{'x ddp':>7}{'peak MB':>9}"
    rows = [head]
    for r in results:
        rows.append(
            f"{r['strategy']:<9}{r['step_ms']:>9.1f}{r['step_ms'] / base['step_ms']:>7.2f}"
            f"{r['samples_per_second']:>11.0f}{r['sent_bytes_per_step'] / 1e6:>14.2f}"
            f"{r['sent_bytes_per_step'] / max(base['sent_bytes_per_step'], 1):>7.2f}"
            f"{r['optimizer_state_bytes_per_rank'] / 1e6:>16.1f}"
            f"{r['optimizer_state_bytes_per_rank'] / max(base['optimizer_state_bytes_per_rank'], 1):>7.2f}"
            f"{r['peak_memory_mb']:>9.0f}"
        )
    return "\n".join(rows)


BENCH_SETTINGS = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "batch_size",
    "hidden",
    "depth",
    "optimizer",
    "backend",
    "timeout",
    "model",
    "data",
    "loss",
    "gpt_layers",
    "gpt_width",
    "gpt_heads",
    "context",
)


def bench_config(given: dict[str, Any]) -> TrainConfig:
    """The TrainConfig a bench runs every strategy with: the flags given, the bench's own defaults otherwise."""
    values = {"nproc_per_node": 2, "hidden": 1024, "depth": 4, "data": "synthetic"}
    if given.get("model") == "gpt" and "data" not in given:
        values["data"] = "text"
    values.update({k: given[k] for k in BENCH_SETTINGS if k in given})
    if "hosts" in given:
        hosts = [h for h in given["hosts"].split(",") if h]
        if len(hosts) < 2 or "node_rank" not in given:
            raise ValueError("--hosts needs 2+ comma-separated addresses (the first runs rank 0) and --node-rank")
        values.update(nnodes=len(hosts), master_addr=hosts[0], nproc_per_node=given.get("nproc_per_node", 1))
    cfg = TrainConfig(
        **values,
        synthetic_features=FEATURES,
        synthetic_classes=CLASSES,
        slowmo_momentum=0.0,  # plain local SGD every 3 steps: the cheapest SlowMo traffic pattern
        nprocs_per_node_slowmo=values["nproc_per_node"] if values.get("nnodes", 1) > 1 else 1,
    )
    validate(cfg)
    slow_links = {k: given[k] for k in SLOW_LINK_FLAGS if k in given}  # for the slowmo run, checked as its flags
    if slow_links:
        cfg = dataclasses.replace(cfg, **slow_links)
        validate(dataclasses.replace(cfg, strategy="slowmo"))
    return cfg


def step_budget(steps: int, warmup: int, max_steps: int | None, period: int) -> tuple[int, int]:
    """(timed, warm-up) steps, both rounded up to a multiple of SlowMo's averaging `period`: its first averaging
    (which allocates) falls in the warm-up and its mean counts averaging steps in proportion. With `max_steps`,
    the total is cut to it, the warm-up first (timed steps stay a multiple of `period` where possible)."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0; got {steps}, {warmup}")
    steps, warmup = -(-steps // period) * period, -(-warmup // period) * period
    if max_steps is not None and warmup + steps > max_steps:
        warmup = min(warmup, max_steps // 4 // period * period)
        steps = max_steps - warmup
        steps = steps // period * period or steps
    return steps, warmup


def _port(cfg: TrainConfig, index: int) -> int:
    """A fresh port per strategy: any free one on one host; the master port + index across hosts."""
    if cfg.nnodes == 1:
        return free_port() if cfg.master_port is None else cfg.master_port + index
    return (cfg.master_port or 29500) + index


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """Sets `name` to `value` (None: leaves it alone) for the block; the spawned processes inherit it."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None and old is None:
            del os.environ[name]
        elif value is not None and old is not None:
            os.environ[name] = old


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs each strategy in its own fresh processes (so peak memory is per strategy), prints the table and the
    advice, and writes the plot (and JSON) on the machine of rank 0."""
    given = vars(args)
    names = given.get("strategies", ",".join(BENCH_STRATEGIES)).split(",")
    unknown = [n for n in names if n not in BENCH_STRATEGIES]
    if unknown:
        raise ValueError(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(BENCH_STRATEGIES)}")
    cfg = bench_config(given)
    target = None
    if "link_mbit" in given:
        target = advisor.link_from_mbit(given["link_mbit"], given.get("link_latency_ms", 0.5))
    elif "link_latency_ms" in given:
        raise ValueError("--link-latency-ms goes with --link-mbit")
    steps, warmup = step_budget(given.get("steps", 20), given.get("warmup", 3), given.get("max_steps"), PERIOD)
    results = []
    # predicting a multi-host job from one host: count what the strategies would send over sockets
    sockets = target is not None and cfg.nnodes == 1
    with tempfile.TemporaryDirectory() as tmp, _environment("DDPKIT_SHARED_MEMORY", "0" if sockets else None):
        for index, name in enumerate(names):
            print(f"bench: {name} on {cfg.world_size} processes ...", flush=True)
            out = os.path.join(tmp, f"{name}.json")
            run_cfg = strategy_config(cfg, name)
            spawn(_bench_process, cfg.nproc_per_node, (run_cfg, _port(cfg, index), steps, warmup, out))
            if cfg.node_rank == 0:
                with open(out) as f:
                    results.append(json.load(f))
    if cfg.node_rank != 0:
        print("bench: done; the figures are printed on the machine of rank 0")
        return []
    _report(results, cfg, steps, target, given)
    return results


def _report(
    results: list[dict[str, Any]], cfg: TrainConfig, steps: int, target: advisor.Link | None, given: dict[str, Any]
) -> None:
    from ddpkit.measure.plots import plot_bench

    print(
        f"{results[0]['workload']}: {results[0]['parameters'] / 1e6:.1f}M parameters, batch {cfg.batch_size} "
        f"per process, {cfg.optimizer}, {steps} timed steps on {cfg.world_size} processes"
    )
    print(format_table(results))
    print(f"step ms: {STEP_STATISTIC}")
    print(advisor.format_advice(results, target))
    folder = given.get("out")
    if folder:
        os.makedirs(folder, exist_ok=True)
    plot_path = given.get("plot", os.path.join(folder, "bench.png") if folder else "bench.png")
    plot_bench(results, plot_path, target)
    print(f"wrote {plot_path}")
    json_path = given.get("json_path", os.path.join(folder, "bench.json") if folder else None)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {json_path}")
