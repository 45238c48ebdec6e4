"""SGP (gossip) against DDP, local SGD and SlowMo on four hosts joined by 100 Mbit/s links, then with a straggler.

Four hosts (network namespaces, `benchmarks.lib.netns`), one process each, gloo over the links, one thread per
process; every link shaped to ``--rate`` (100 Mbit/s) both ways, then (setting "straggler") the same with host
``--straggler-host``'s link at ``--straggler-rate`` (20 Mbit/s) both ways. Each configuration trains the same byte
GPT from the same initial weights on the same per-rank windows of the standard library's source, SGD with momentum
0.9 and a cosine lr schedule. Reported per configuration and setting: samples/s after the warm-up steps (a gossip
round still in flight at the end is waited for inside the clock), bytes sent per step and rank (``comm_stats``,
and the interface's ``tx_bytes`` with TCP/IP headers and gloo's own messages), the held-out loss after the last
step of the model every replica ends with (`average_parameters()` for the SlowMo wrappers, outside the clock) and
how far the replicas were apart before it. The settings change only the links: every configuration computes the
same losses in both (checked). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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
from benchmarks.lib.tables import markdown, num
from ddpkit.distributed.launch import exit_without_teardown, leave

QUESTION = "sgp: SGP and overlap SGP against DDP, local SGD and SlowMo on 4 hosts at 100 Mbit/s, and a straggler (root)"
QUICK = {
    "steps": 12,
    "warmup": 3,
    "configs": "ddp,overlap_sgp3",
    "settings": "uniform,straggler",
    "reuse_processes": True,
}
PORT = 29500
WORLD = 4
SETTINGS = ("uniform", "straggler")
GOAL_SGP_VS_DDP, GOAL_LOSS, GOAL_OVERLAP_VS_LOCALSGD = 2.0, 0.03, 1.5
Run = tuple[int, str, str]  # (round, setting, configuration)

# -- the configurations: SlowMoDistributedDataParallel's settings (beta 0 and lr 1 turn slow momentum off) -------

CONFIGS: dict[str, dict[str, Any]] = {
    "ddp": {"label": "torch DDP"},
    "localsgd": {"label": "local SGD, freq 3", "base": "localsgd", "beta": 0.0},
    "slowmo_localsgd": {"label": "SlowMo + local SGD, freq 3", "base": "localsgd", "beta": 0.5},
    "sgp": {"label": "SGP", "base": "sgp", "beta": 0.0},
    "slowmo_sgp": {"label": "SlowMo + SGP", "base": "sgp", "beta": 0.5},
    "overlap_sgp": {"label": "overlap SGP, synch_freq 0 (1 step late)", "base": "sgp", "beta": 0.0, "delay": 0},
    "overlap_sgp3": {"label": "overlap SGP, synch_freq 3 (3 steps late)", "base": "sgp", "beta": 0.0, "delay": 3},
}


def build(name: str, model: nn.Module, lr: float, slow_every: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The module to call, the optimizer to step and what to call after ``optimizer.step()``."""
    from ddpkit.nn import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
    from ddpkit.train.loop.strategies import build_strategy
    from ddpkit.train.settings.config import TrainConfig

    cfg = CONFIGS[name]
    if name == "ddp":
        built = build_strategy(TrainConfig(strategy="ddp", optimizer="sgd", lr=lr), model, torch.device("cpu"))
        return built.model, built.optimizer, None
    wrapped = SlowMoDistributedDataParallel(
        model,
        nprocs_per_node=1,
        slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP if cfg["base"] == "sgp" else SlowMoBaseAlgorithm.LOCALSGD,
        localsgd_frequency=3,
        slowmo_momentum=cfg["beta"],
        slowmo_frequency=slow_every,
        overlap="delay" in cfg,
        synch_freq=cfg.get("delay", 0),
    )
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)

    def after_step() -> None:
        wrapped.zero_grad(set_to_none=True)
        wrapped.perform_slowmo(optimizer)

    return wrapped, optimizer, after_step


def wait_in_flight(wrapped: nn.Module) -> None:
    """Completes a gossip round still travelling (overlap SGP) without mixing it, so its transfer is timed.

    The wrapper offers no public call that waits without also averaging exactly, so this reads its engine."""
    engine = getattr(wrapped, "_sgp", None)
    pending = getattr(engine, "_round", None)
    if pending is not None:
        pending.received()


# -- one rank of one configuration (a process on one host) ----------------------------------------------------------


def train(job: dict[str, Any], workload: Any, built: tuple) -> dict[str, Any]:
    """The training loop; the clock runs from the end of the warm-up steps to the end of the last one."""
    from ddpkit.distributed import comm_stats

    wrapped = built[0]
    steps, losses, stamps = job["steps"], [], []
    batches = workload.batches(job["seed"], job["rank"], steps, job["batch"])  # made before timing
    dist.barrier()
    for step, (x, y) in enumerate(batches, 1):
        if step == job["warmup"] + 1:
            dist.barrier()
            t0, tx0, sent0 = time.perf_counter(), tx_bytes(), comm_stats.total().sent_bytes
        losses.append(train_step(built, workload, (x, y), lr_at(step, steps, job["lr"])))
        stamps.append(time.perf_counter())
    wait_in_flight(wrapped)
    dist.barrier()
    elapsed, tx1, timed = time.perf_counter() - t0, tx_bytes(), steps - job["warmup"]
    return {
        "samples_per_s": WORLD * job["batch"] * timed / elapsed,
        "modelled_bytes_per_step": (comm_stats.total().sent_bytes - sent0) / timed,
        "measured_bytes_per_step": None if tx0 is None or tx1 is None else (tx1 - tx0) / timed,
        "losses": losses,
        "clock": [s - t0 for s in stamps],  # seconds since the clock started, at the end of each step
    }


def replica_spread(model: nn.Module) -> float:
    """The largest |parameter - its mean over the replicas| (0 when every rank holds the same model)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.zeros_like(flat) for _ in range(WORLD)]
    dist.all_gather(replicas, flat)
    stacked = torch.stack(replicas)
    return (stacked - stacked.mean(0)).abs().max().item()


def shape_links(commands: list[list[str]], rank: int) -> None:
    """Shapes the links for the next runs: rank 0 runs the driver's commands (`netns.Hosts.rate_commands`) while
    every rank waits, so that no run's traffic crosses the change."""
    dist.barrier()
    if rank == 0:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, timeout=30)
    dist.barrier()


def worker(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Trains each run of ``job["runs"]`` (round, setting, configuration) in turn on rank ``job["rank"]``, each from
    the same initial weights on the same batches, the links shaped for its setting; returns their measurements."""
    torch.set_num_threads(1)
    timeout = timedelta(seconds=job["pg_timeout"])
    init = f"tcp://{job['master']}:{PORT}"
    dist.init_process_group("gloo", init_method=init, rank=job["rank"], world_size=WORLD, timeout=timeout)
    workload = workloads.workload("gpt", job["quick"])
    if not job["quick"]:
        workload = workloads.GPTText(job["layers"], job["width"], job["heads"], job["context"])
    held_out = workload.held_out(job["seed"], workloads.HELD_OUT_WINDOWS)
    runs, shaped = [], None
    for _, setting, name in job["runs"]:
        if setting != shaped:
            shape_links(job["shaping"][setting], job["rank"])
            shaped = setting
        model = workload.model(job["seed"])
        built = build(name, model, job["lr"], job["slowmo_frequency"])
        done = train(job, workload, built)
        done["replica_spread"] = replica_spread(model)
        done["replica_held_out"] = held_out_loss(model, workload, held_out)  # this rank's own replica
        if hasattr(built[0], "average_parameters"):
            built[0].average_parameters()
        done["held_out"] = held_out_loss(model, workload, held_out)
        done.update(parameters=sum(p.numel() for p in model.parameters()), workload=workload.describe())
        runs.append(done)
    leave()  # collects what still references the group (a DDP reducer) first
    return runs


# -- the driver: every configuration on the four hosts, in each setting --------------------------------------------


def run_job(runs: list[Run], args: argparse.Namespace, hosts: netns.Hosts, shaping: dict, workdir: str) -> list[list]:
    """Runs `runs` one after the other as one 4-process job, one process per host (all killed if one fails), the
    links shaped by `shaping`'s commands for each setting; per run, its ranks' measurements."""
    keys = ("steps", "warmup", "batch", "lr", "seed", "pg_timeout", "slowmo_frequency")
    keys += ("layers", "width", "heads", "context", "quick")
    commands, envs, outs = [], [], []
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    first = "-".join(map(str, runs[0]))
    for rank in range(WORLD):
        out = os.path.join(workdir, f"{first}.{rank}.json")
        job = {k: getattr(args, k) for k in keys} | {"runs": runs, "shaping": shaping, "rank": rank, "out": out}
        job["master"] = hosts.addresses[0]
        commands.append([*hosts.prefix(rank), sys.executable, "-m", "benchmarks.bench_sgp", json.dumps(job)])
        envs.append(dict(os.environ, GLOO_SOCKET_IFNAME=hosts.ifnames[rank], PYTHONPATH=path))
        outs.append(out)
    netns.run_job(commands, envs, args.run_timeout * len(runs), f"sgp from {first}")
    ranks = [json.loads(Path(out).read_text()) for out in outs]
    return [list(done) for done in zip(*ranks, strict=True)]


def summarise(name: str, setting: str, round_: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    measured = [r["measured_bytes_per_step"] for r in ranks]
    return {
        "config": name,
        "setting": setting,
        "round": round_,
        "label": CONFIGS[name]["label"],
        "samples_per_s": min(r["samples_per_s"] for r in ranks),
        "held_out": ranks[0]["held_out"],
        "replica_held_out": [r["replica_held_out"] for r in ranks],
        "replica_spread": ranks[0]["replica_spread"],
        "modelled_mb": max(r["modelled_bytes_per_step"] for r in ranks) / 1e6,
        "measured_mb": None if None in measured else max(measured) / 1e6,
        "losses": ranks[0]["losses"],
        "clock": ranks[0]["clock"],
        "parameters": ranks[0]["parameters"],
        "workload": ranks[0]["workload"],
    }


def chosen(text: str, known: tuple[str, ...] | dict, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"{flag}: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}")
    return names


def run(args: argparse.Namespace) -> dict[str, Any]:
    names, settings = chosen(args.configs, CONFIGS, "--configs"), chosen(args.settings, SETTINGS, "--settings")
    if args.steps <= args.warmup:
        raise UsageError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if not 0 <= args.straggler_host < WORLD or args.rounds < 1:
        raise UsageError(f"--straggler-host must be in [0, {WORLD}) and --rounds >= 1")
    if why := netns.unavailable():
        raise Skip(why)
    slow = {s: {args.straggler_host: args.straggler_rate if s == "straggler" else args.rate} for s in settings}
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-sgp-") as workdir, netns.Hosts(WORLD, args.rate) as hosts:
        shaping = {s: hosts.rate_commands(*host_rate) for s, rates in slow.items() for host_rate in rates.items()}
        links = {s: hosts.describe(rates) for s, rates in slow.items()}
        work = [(r, s, n) for r in range(args.rounds) for s in settings for n in names]
        for job in progress([work] if args.reuse_processes else [[run] for run in work], desc="sgp"):
            for (round_, setting, name), ranks in zip(job, run_job(job, args, hosts, shaping, workdir), strict=True):
                rows.append(summarise(name, setting, round_, ranks))
                print(f"{setting} {name} round {round_}: {rows[-1]['samples_per_s']:.2f} samples/s", flush=True)
    return {"workload": rows[0]["workload"], "links": links, "rows": rows, "load_average": list(os.getloadavg())}


# -- the table and the plot ------------------------------------------------------------------------------------------


def medians(rows: list[dict[str, Any]], setting: str) -> dict[str, dict[str, Any]]:
    """Per configuration in `setting`: its first round's row with samples/s replaced by the median over rounds."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["setting"] == setting:
            out.setdefault(r["config"], dict(r, speeds=[]))["speeds"].append(r["samples_per_s"])
    for r in out.values():
        r["samples_per_s"] = statistics.median(r["speeds"])
    return out


def ratio(rows: dict[str, dict[str, Any]], name: str, base: str, key: str = "samples_per_s") -> float | None:
    if name not in rows or base not in rows:
        return None
    return rows[name][key] / rows[base][key]


def setting_table(rows: dict[str, dict[str, Any]]) -> str:
    header = ["configuration", "samples/s", "x DDP", "x local SGD", "held-out loss", "vs DDP", "replica spread"]
    header += ["MB sent/step, modelled", "MB sent/step, measured", "samples/s by round"]
    lines = []
    for name, r in rows.items():
        loss = ratio(rows, name, "ddp", "held_out")
        speeds = [num(r["samples_per_s"]), num(ratio(rows, name, "ddp")), num(ratio(rows, name, "localsgd"))]
        held = [f"{r['held_out']:.4f}", "-" if loss is None else f"{100 * (loss - 1):+.1f}%"]
        sent = [num(r["modelled_mb"]), num(r["measured_mb"])]
        rounds = ", ".join(f"{s:.2f}" for s in r["speeds"])
        lines.append([r["label"], *speeds, *held, f"{r['replica_spread']:.1e}", *sent, rounds])
    return markdown(header, lines)


def table(report: dict[str, Any]) -> str:
    figures, cfg = report["figures"], report["config"]
    size = f"{cfg['steps']} steps ({cfg['warmup']} untimed) x {cfg['batch']} samples x 4 ranks"
    load = " / ".join(f"{x:.1f}" for x in figures["load_average"])
    lines = [f"{figures['workload']}; {size}; load average at the end (1 / 5 / 15 min) {load}"]
    for setting, link in figures["links"].items():
        lines += ["", f"{setting}: {link}", "", setting_table(medians(figures["rows"], setting))]
    return "\n".join([*lines, "", *verdicts(figures["rows"])])


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The goals: SGP >= 2x DDP's samples/s with held-out loss within 3% (uniform links); overlap SGP >= 1.5x local
    SGD's samples/s with the straggler. Also: every configuration computes the same losses in both settings."""
    uniform, straggler, out = medians(rows, "uniform"), medians(rows, "straggler"), []
    for name in ("sgp", "slowmo_sgp", "overlap_sgp", "overlap_sgp3"):
        speed, loss = ratio(uniform, name, "ddp"), ratio(uniform, name, "ddp", "held_out")
        if speed is not None and loss is not None:
            met = "met" if speed >= GOAL_SGP_VS_DDP and abs(loss - 1) <= GOAL_LOSS else "NOT met"
            goal = f"goal (>= {GOAL_SGP_VS_DDP}x, 3%) {met}" if name == "sgp" else "(for comparison)"
            out.append(f"uniform, {name}: {speed:.2f}x DDP, held-out loss {100 * (loss - 1):+.1f}%: {goal}")
    for name in ("overlap_sgp", "overlap_sgp3"):
        speed = ratio(straggler, name, "localsgd")
        if speed is not None:
            met = "met" if speed >= GOAL_OVERLAP_VS_LOCALSGD else "NOT met"
            out.append(f"straggler, {name}: {speed:.2f}x local SGD: goal (>= {GOAL_OVERLAP_VS_LOCALSGD}x) {met}")
    same = [abs(uniform[n]["held_out"] - straggler[n]["held_out"]) for n in uniform if n in straggler]
    if same:
        out.append(f"largest held-out loss difference between the settings, per configuration: {max(same):.1e}")
    return out or ["verdict: the configurations the goals name were not run"]


def plot(report: dict[str, Any], out_dir: Path) -> None:
    """Samples/s per setting, held-out loss, bytes per step (bars) and training loss against wall-clock time."""
    plt = plotting.pyplot()
    figures, cfg = report["figures"], report["config"]
    settings = list(figures["links"])
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    first = medians(figures["rows"], settings[0])
    names = list(first)
    _throughput(axes[0, 0], figures["rows"], settings, names)
    _bars(axes[0, 1], names, {"": [first[n]["held_out"] for n in names]})
    low = min(first[n]["held_out"] for n in names)
    axes[0, 1].set(ylabel="held-out cross-entropy (nats)", ylim=(low * 0.97, None), title="held-out loss, same samples")
    modelled, measured = [first[n]["modelled_mb"] for n in names], [first[n]["measured_mb"] or 0 for n in names]
    _bars(axes[1, 0], names, {"modelled (comm_stats)": modelled, "measured (tx_bytes)": measured})
    axes[1, 0].set(ylabel="MB sent per step and rank", title=f"bytes per step ({settings[0]} links)")
    _curves(axes[1, 1], medians(figures["rows"], settings[-1]), settings[-1])
    links = f"every link tbf {cfg['rate']} both ways; with the straggler, host {cfg['straggler_host']} at "
    links += f"{cfg['straggler_rate']}; the same {cfg['steps']} steps in every run"
    machine = plotting.title(f"{WORLD} hosts", WORLD, report)
    fig.suptitle(f"{figures['workload']}, batch {cfg['batch']}/rank\n{links}\n{machine}")
    plotting.save(fig, report["benchmark"], out_dir)


def _bars(ax: Any, names: list[str], series: dict[str, list[float]]) -> None:
    """One group of bars per configuration, one bar per series."""
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        offset = (k - (len(series) - 1) / 2) * width
        ax.bar([x + offset for x in range(len(names))], values, width, label=label or None)
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
    ax.set_xlabel("configuration")
    if len(series) > 1:
        ax.legend()


def _throughput(ax: Any, rows: list[dict[str, Any]], settings: list[str], names: list[str]) -> None:
    series = {}
    for setting in settings:
        by_config = medians(rows, setting)
        series[f"{setting} links"] = [by_config[n]["samples_per_s"] if n in by_config else 0.0 for n in names]
    _bars(ax, names, series)
    ax.set(ylabel="samples/s (median of rounds)", title="throughput by link setting")


def _curves(ax: Any, rows: dict[str, dict[str, Any]], setting: str) -> None:
    """Rank 0's training loss (mean of the last 6 steps) against the clock, from the end of the warm-up."""
    for name, r in rows.items():
        losses = r["losses"]
        smooth = [sum(losses[max(0, i - 5) : i + 1]) / (i + 1 - max(0, i - 5)) for i in range(len(losses))]
        timed = [(c, s) for c, s in zip(r["clock"], smooth, strict=True) if c >= 0]
        ax.plot(*zip(*timed, strict=True), label=name)
    ax.set(xlabel="wall-clock seconds since the warm-up", ylabel="training loss, rank 0 (mean of 6 steps)")
    ax.set_title(f"training loss over time ({setting} links)")
    ax.legend()


def result_name(args: argparse.Namespace) -> str:
    """sgp, or sgp_<variant> for a run given ``--variant``."""
    return "sgp" + (f"_{args.variant}" if args.variant else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="link settings, comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="times every setting and configuration runs")
    parser.add_argument("--layers", type=int, default=2, help="GPT layers")
    parser.add_argument("--width", type=int, default=256, help="GPT width")
    parser.add_argument("--heads", type=int, default=4, help="GPT attention heads")
    parser.add_argument("--context", type=int, default=128, help="GPT context (bytes)")
    parser.add_argument("--steps", type=int, default=36, help="a multiple of 12 keeps every period whole")
    parser.add_argument("--warmup", type=int, default=6, help="steps before the clock starts")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.03, help="base lr of the cosine schedule")
    parser.add_argument("--slowmo-frequency", type=int, default=12, help="steps between slow-momentum steps")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data streams")
    parser.add_argument("--rate", default="100mbit", help="tbf rate of every link, both ways")
    parser.add_argument("--straggler-rate", default="20mbit", help="the straggler's link rate, both ways")
    parser.add_argument("--straggler-host", type=int, default=3, help="which host straggles")
    netns.add_link_arguments(parser, 900.0, "configuration", tbf=False)
    parser.add_argument(
        "--reuse-processes",
        action="store_true",
        help="one job runs every configuration in every setting and round, in turn (quicker; each "
        "run then starts in processes that have run others)",
    )
    parser.add_argument("--variant", default="", help="writes results/sgp_<variant>.json instead of sgp.json")


if __name__ == "__main__":  # a rank: python -m benchmarks.bench_sgp '<job as JSON>'
    job = json.loads(sys.argv[1])
    Path(job["out"]).write_text(json.dumps(worker(job)))
    exit_without_teardown()  # torch's teardown of a gloo job aborts now and then, after the result is written
