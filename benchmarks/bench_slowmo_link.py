"""SlowMo over a slow link: how much faster than DDP, at what loss, against torch's PostLocalSGD?

Two hosts (network namespaces, `benchmarks.lib.netns`) joined by links shaped to ``--rate`` (100 Mbit/s) both
ways; one process per host, gloo over the link, one thread per process. Each configuration trains the same
~2.4M-parameter MLP from the same initial weights with SGD (momentum 0.9, lr 0.05 on a cosine schedule down to 5%
of it at the last step) on the same per-rank streams of random-teacher classification data, batch 16 per rank,
240 steps. Reported per configuration: samples/s after the warm-up steps (the clock paused while the held-out
loss is computed), the held-out cross-entropy after the last step (a multiple of every averaging period, so both
replicas are equal, which is checked), the mean training loss of the last 48 steps, and bytes sent per step and
rank, modelled (`comm_stats`, bandwidth-optimal wire model; torch's Python all-reduce counted by a shim) and
measured (the interface's ``tx_bytes``, with TCP/IP headers and gloo's own messages). Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.lib import netns, plotting, workloads
from benchmarks.lib.cli import Skip, UsageError, progress
from benchmarks.lib.linkrank import held_out_loss, lr_at, train_step, tx_bytes
from benchmarks.lib.results import ROOT
from ddpkit.distributed.launch import exit_without_teardown, leave

QUESTION = "slowmo_link: SlowMo against DDP and torch PostLocalSGD on two hosts joined by a 100 Mbit/s link (root)"
QUICK = {"steps": 24, "warmup": 4, "eval_every": 8, "configs": "ddp,postlocalsgd3,slowmo3", "reuse_processes": True}
PORT = 29500
HELD_OUT = 2048
HeldOutWorkload = workloads.Teacher | workloads.GPTText  # workloads with a held-out set
GOAL_SPEED, GOAL_LOSS = 2.5, 0.03

# -- the configurations ----------------------------------------------------------------------------------------------

CONFIGS: dict[str, dict[str, Any]] = {
    "ddp": {"label": "torch DDP"},
    "postlocalsgd3": {"label": "torch PostLocalSGD, period 3", "period": 3},
    "slowmo3": {"label": "ddpkit SlowMo, freq 3, beta 0.5 (slow step every 48)", "slowmo": (3, 0.5, 48)},
    "slowmo12": {"label": "ddpkit SlowMo, freq 12, beta 0.7 (slow step every 12)", "slowmo": (12, 0.7, 12)},
    "slowmo12_unsharded": {"label": "same, slowmo_memory_efficient=False", "slowmo": (12, 0.7, 12), "full": 1},
}


def build(name: str, model: nn.Module, lr: float) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The module to call, the optimizer to step and what to call after ``optimizer.step()``."""
    from ddpkit.nn import SlowMoDistributedDataParallel
    from ddpkit.train.loop.strategies import build_strategy
    from ddpkit.train.settings.config import TrainConfig

    cfg = CONFIGS[name]
    if name == "ddp":
        built = build_strategy(TrainConfig(strategy="ddp", optimizer="sgd", lr=lr), model, torch.device("cpu"))
        return built.model, built.optimizer, None
    if "period" in cfg:
        return _post_local_sgd(model, lr, cfg["period"])
    frequency, beta, slow_every = cfg["slowmo"]
    slowmo = SlowMoDistributedDataParallel(
        model,
        nprocs_per_node=1,
        localsgd_frequency=frequency,
        slowmo_momentum=beta,
        slowmo_frequency=slow_every,
        slowmo_memory_efficient="full" not in cfg,
    )
    optimizer = torch.optim.SGD(slowmo.parameters(), lr=lr, momentum=0.9)

    def after_step() -> None:
        slowmo.zero_grad(set_to_none=True)
        slowmo.perform_slowmo(optimizer)

    return slowmo, optimizer, after_step


def _post_local_sgd(model: nn.Module, lr: float, period: int) -> tuple[nn.Module, torch.optim.Optimizer, None]:
    """torch's post_localSGD_hook + PostLocalSGDOptimizer: gradients all-reduced for 2 steps, then the
    parameters averaged after steps 3, 6, 9, ... exactly like SlowMo's; its Python all-reduce is counted."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.lib.counting import install_counting_shim
    from ddpkit.distributed import comm_stats

    install_counting_shim(comm_stats, ("all_reduce",))
    start = 2  # the averager counts its calls from 0
    subgroup, _ = dist.new_subgroups(group_size=1)  # a node's processes: here one per node
    ddp = DDP(model)
    ddp.register_comm_hook(PostLocalSGDState(None, subgroup, start_localSGD_iter=start), post_localSGD_hook)
    averager = PeriodicModelAverager(period=period, warmup_steps=start)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    return ddp, PostLocalSGDOptimizer(optimizer, averager), None


# -- one rank of one configuration (a process on one host) ----------------------------------------------------------


def train(job: dict[str, Any], workload: HeldOutWorkload, model: nn.Module, built: tuple) -> dict[str, Any]:
    """The training loop: the clock starts after the warm-up steps and pauses for the held-out losses."""
    from ddpkit.distributed import comm_stats

    steps = job["steps"]
    held_out = workload.held_out(job["seed"], HELD_OUT)
    batches = workload.batches(job["seed"], job["rank"], steps, job["batch"])  # made before timing
    losses: list[float] = []
    evals = [(0, 0.0, held_out_loss(model, workload, held_out))]  # (step, clock seconds, held-out loss)
    dist.barrier()
    start, paused = time.perf_counter(), 0.0
    for step, (x, y) in enumerate(batches, 1):
        if step == job["warmup"] + 1:
            dist.barrier()
            t0, paused0, tx0, sent0 = time.perf_counter(), paused, tx_bytes(), comm_stats.total().sent_bytes
        losses.append(train_step(built, workload, (x, y), lr_at(step, steps, job["lr"])))
        if step % job["eval_every"] == 0 or step == steps:
            pause = time.perf_counter()
            evals.append((step, pause - start - paused, held_out_loss(model, workload, held_out)))
            paused += time.perf_counter() - pause
    dist.barrier()
    elapsed, tx1 = time.perf_counter() - t0 - (paused - paused0), tx_bytes()
    tx = None if tx1 is None or tx0 is None else tx1 - tx0
    return {
        "elapsed": elapsed,
        "tx": tx,
        "sent": comm_stats.total().sent_bytes - sent0,
        "losses": losses,
        "evals": evals,
    }


def worker(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Trains each configuration of ``job["configs"]`` in turn on rank ``job["rank"]``, from the same initial
    weights and batches; returns their measurements."""
    torch.set_num_threads(1)
    init = f"tcp://{job['master']}:{PORT}"
    timeout = timedelta(seconds=job["pg_timeout"])
    dist.init_process_group("gloo", init_method=init, rank=job["rank"], world_size=2, timeout=timeout)
    workload = workloads.workload(job["workload"], job["quick"])
    timed = job["steps"] - job["warmup"]
    runs = []
    for name in job["configs"]:
        model = workload.model(job["seed"])
        done = train(job, workload, model, build(name, model, job["lr"]))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        replicas = [torch.zeros_like(flat) for _ in range(2)]
        dist.all_gather(replicas, flat)
        runs.append(
            {
                "samples_per_s": 2 * job["batch"] * timed / done["elapsed"],
                "modelled_bytes_per_step": done["sent"] / timed,
                "measured_bytes_per_step": None if done["tx"] is None else done["tx"] / timed,
                "losses": done["losses"],
                "evals": done["evals"],
                "replica_max_diff": (replicas[1] - replicas[0]).abs().max().item(),
                "parameters": flat.numel(),
            }
        )
    leave()  # collects what still references the group (a DDP reducer) first
    return runs


# -- the driver: every configuration on the two hosts -------------------------------------------------------------


def run_configs(
    names: list[str], args: argparse.Namespace, hosts: netns.Hosts | None, workdir: str
) -> list[list[dict]]:
    """Runs configurations `names`, one after the other, as one 2-process job (killed if one fails or the timeout
    passes); per configuration, its ranks' measurements."""
    commands, envs, outs = [], [], []
    for rank in range(2):
        out = os.path.join(workdir, f"{'+'.join(names)}.{rank}.json")
        keys = ("steps", "warmup", "eval_every", "batch", "lr", "seed", "pg_timeout", "workload")
        job = {k: getattr(args, k) for k in keys}
        job.update(configs=names, rank=rank, quick=args.quick, out=out)
        job["master"] = hosts.addresses[0] if hosts else "127.0.0.1"
        prefix = hosts.prefix(rank) if hosts else []
        commands.append([*prefix, sys.executable, "-m", "benchmarks.bench_slowmo_link", json.dumps(job)])
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        envs.append(dict(os.environ, GLOO_SOCKET_IFNAME=hosts.ifnames[rank] if hosts else "lo", PYTHONPATH=path))
        outs.append(out)
    netns.run_job(commands, envs, args.run_timeout * len(names), "+".join(names))
    ranks = [json.loads(Path(out).read_text()) for out in outs]
    return [list(runs) for runs in zip(*ranks, strict=True)]


def summarise(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    tail = min(48, len(ranks[0]["losses"]))
    measured = [r["measured_bytes_per_step"] for r in ranks]
    return {
        "config": name,
        "label": CONFIGS[name]["label"],
        "samples_per_s": min(r["samples_per_s"] for r in ranks),
        "held_out": ranks[0]["evals"][-1][2],
        "train_tail": sum(sum(r["losses"][-tail:]) / tail for r in ranks) / len(ranks),
        "modelled_mb": max(r["modelled_bytes_per_step"] for r in ranks) / 1e6,
        "measured_mb": None if None in measured else max(measured) / 1e6,
        "replica_max_diff": ranks[0]["replica_max_diff"],
        "evals": ranks[0]["evals"],
        "parameters": ranks[0]["parameters"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise UsageError(f"--configs: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(CONFIGS)}")
    if args.steps <= args.warmup:
        raise UsageError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if not args.loopback and (why := netns.unavailable()):
        raise Skip(f"{why} (or use --loopback: no link, losses only)")
    hosts = None if args.loopback else netns.Hosts(2, args.rate, args.burst, args.latency)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-slowmo-link-") as workdir, hosts or contextlib.nullcontext():
        for job in progress([names] if args.reuse_processes else [[n] for n in names], desc="slowmo_link"):
            for name, ranks in zip(job, run_configs(job, args, hosts, workdir), strict=True):
                rows.append(summarise(name, ranks))
    link = "loopback, no shaping" if args.loopback else hosts.describe()  # type: ignore[union-attr]
    return {"workload": workloads.workload(args.workload, args.quick).describe(), "link": link, "rows": rows}


# -- the table and the plot ------------------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    figures, cfg = report["figures"], report["config"]
    rows = figures["rows"]
    base = next((r for r in rows if r["config"] == "ddp"), None)
    lines = [
        f"{figures['workload']}; {figures['link']}; {cfg['steps']} steps x {cfg['batch']} samples x 2 ranks",
        "| configuration | samples/s | x DDP | held-out loss | vs DDP | train loss (last 48) "
        "| MB sent/step, modelled | MB sent/step, measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speed = f"{r['samples_per_s'] / base['samples_per_s']:.2f}" if base else "-"
        loss = f"{100 * (r['held_out'] / base['held_out'] - 1):+.1f}%" if base else "-"
        measured = "-" if r["measured_mb"] is None else f"{r['measured_mb']:.2f}"
        lines.append(
            f"| {r['label']} | {r['samples_per_s']:.1f} | {speed} | {r['held_out']:.4f} | {loss} "
            f"| {r['train_tail']:.4f} | {r['modelled_mb']:.2f} | {measured} |"
        )
    lines.append(f"max |replica difference| after the last step: {max(r['replica_max_diff'] for r in rows):.1e}")
    return "\n".join(lines + verdict(rows, base))


def verdict(rows: list[dict[str, Any]], base: dict[str, Any] | None) -> list[str]:
    """The goal: SlowMo at least 2.5x DDP's samples/s with a held-out loss within 3% of DDP's."""
    if base is None:
        return ["verdict: DDP was not run"]
    out = []
    for r in rows:
        if r["config"] == "slowmo3":  # the goal names SlowMo at its default frequency
            speed, loss = r["samples_per_s"] / base["samples_per_s"], r["held_out"] / base["held_out"] - 1
            met = "met" if speed >= GOAL_SPEED and abs(loss) <= GOAL_LOSS else "NOT met"
            out.append(f"verdict {r['config']}: {speed:.2f}x DDP, loss {100 * loss:+.1f}%: goal (>= 2.5x, 3%) {met}")
    return out


def plot(report: dict[str, Any], out_dir: Path) -> None:
    """Held-out loss against samples and against wall-clock time."""
    plt = plotting.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in report["figures"]["rows"]:
        steps, clock, loss = zip(*r["evals"], strict=True)
        samples = [s * report["config"]["batch"] * 2 for s in steps]
        style = {"linestyle": "--", "marker": "x"} if "unsharded" in r["config"] else {"marker": "o"}
        ax1.plot(samples, loss, label=r["label"], **style)
        ax2.plot(clock, loss, label=r["label"], **style)
    ax1.set(xlabel="samples (both ranks)", ylabel="held-out cross-entropy")
    ax2.set(xlabel="wall-clock seconds (evaluation excluded)", ylabel="held-out cross-entropy")
    ax1.legend()
    figures = report["figures"]
    fig.suptitle(plotting.title(f"{figures['workload']}; {figures['link']}", 2, report))
    plotting.save(fig, report["benchmark"], out_dir)


def result_name(args: argparse.Namespace) -> str:
    """slowmo_link, with _loopback, _seed<N> or _<rate> added for the other variants."""
    name = "slowmo_link" + ("_loopback" if args.loopback else "") + (f"_seed{args.seed}" if args.seed else "")
    return name + (f"_{args.rate}" if args.rate != "100mbit" and not args.loopback else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    parser.add_argument("--workload", default="teacher", choices=["teacher", "gpt"], help="what to train")
    parser.add_argument("--steps", type=int, default=240, help="a multiple of 48 keeps every period whole")
    parser.add_argument("--warmup", type=int, default=12, help="steps before the clock starts")
    parser.add_argument("--eval-every", type=int, default=24, help="steps between held-out losses")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.05, help="base lr of the cosine schedule")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data streams")
    parser.add_argument("--rate", default="100mbit", help="tbf rate of each link, both ways")
    parser.add_argument("--loopback", action="store_true", help="no namespaces or shaping (losses only)")
    netns.add_link_arguments(parser, 900.0, "configuration")
    parser.add_argument(
        "--reuse-processes",
        action="store_true",
        help="one job runs every configuration in turn (quicker; each configuration then starts in "
        "processes that have run others)",
    )


if __name__ == "__main__":  # a rank: python -m benchmarks.bench_slowmo_link '<job as JSON>'
    job = json.loads(sys.argv[1])
    Path(job["out"]).write_text(json.dumps(worker(job)))
    exit_without_teardown()  # torch's teardown of a gloo job aborts now and then, after the result is written
