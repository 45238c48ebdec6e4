"""DiLoCo and its streaming, quantised variants over slow links: bytes, speed and held-out loss against DDP.

Two hosts (network namespaces, `benchmarks.lib.netns`) joined by links shaped to each of ``--rates`` (100 and
10 Mbit/s) both ways; one process per host, gloo over the link, one thread per process. Every run trains the same
small byte-level GPT (`benchmarks.lib.workloads.GPTText`, ``--gpt`` layers,width,heads,context) from the same
weights on the same per-rank windows of the standard library's source, AdamW (lr on a cosine schedule, the same
for every method) as the inner optimizer, ``--steps`` steps of ``--batch`` windows per rank:

* ``local``: no communication at all, the speed reference (each rank trains its own replica);
* ``ddp``: torch DDP, fp32 gradients all-reduced every step; quantised: the same DDP with a communication hook
  that averages each gradient bucket with `ddpkit.algorithms.compressed_mean.compressed_mean`;
* ``slowmo3``: SlowMo, parameters averaged every 3 steps (slow momentum 0.5 every 48, the defaults);
* ``dilocoH``: DiLoCo, H inner steps, then the outer Nesterov step on the averaged progress (SlowMo with
  ``localsgd_frequency = slowmo_frequency = H``, ``slowmo_momentum=0.9, slowmo_lr=0.7, slowmo_nesterov=True``,
  the paper's; ``--outer-momentum`` and ``--outer-lr`` change them);
* ``streaming``: streaming DiLoCo, the same with ``slowmo_fragments=4, slowmo_sync_delay=1`` at the longest H;
each (but ``local``) in fp32 (``none``), bf16, int8 and int4 (``slowmo_compression``; for SlowMo and DiLoCo the
averaged quantity is the pseudo-gradient). All runs of one link rate run in one job, one after the other.

Reported per run: samples/s after the warm-up steps (clock paused while held-out losses are computed), the
held-out loss after the last step (mean over the two replicas, which are equal after a whole period), wire bytes
per step and rank, modelled (`comm_stats`) and measured (the interface's ``tx_bytes``: TCP/IP headers, gloo's
framing and ACKs included). Plots: held-out loss against bytes sent and against wall-clock time. Needs root.
"""

from __future__ import annotations

import argparse
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
from benchmarks.lib.linkrank import held_out_loss, lr_at, tx_bytes
from benchmarks.lib.results import ROOT
from ddpkit.distributed.launch import exit_without_teardown, leave

QUESTION = "diloco: DDP, SlowMo, DiLoCo, streaming DiLoCo in fp32/bf16/int8/int4 over 100 and 10 Mbit/s (root)"
QUICK = {
    "steps": 16,
    "warmup": 2,
    "eval_every": 8,
    "periods": "4,8",
    "rates": "100mbit",
    "compressions": "none,int4",
    "gpt": "1,32,2,32",
}
PORT = 29530
HELD_OUT = 128
METHODS = ("local", "ddp", "slowmo3", "diloco", "streaming")
COMPRESSIONS = ("none", "bf16", "int8", "int4")
GOAL_BYTES, GOAL_LOSS, GOAL_SPEED = 100.0, 0.02, 0.9


def runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Every (run name, compression) of one link rate: ``local`` once, the others in each compression."""
    periods = [int(p) for p in args.periods.split(",")]
    out = []
    for method in args.methods.split(","):
        names = [f"diloco{h}" for h in periods] if method == "diloco" else [method]
        for name in names:
            out += [(name, "none")] if name == "local" else [(name, c) for c in args.compressions.split(",")]
    return out


def label(name: str, compression: str, periods: str = "") -> str:
    precision = "fp32" if compression == "none" else compression
    if name == "local":
        return "no communication"
    if name == "streaming":
        return f"streaming DiLoCo H={max(int(p) for p in periods.split(','))} K=4 tau=1, {precision}"
    if name.startswith("diloco"):
        return f"DiLoCo H={name[6:]}, {precision}"
    return {"ddp": "DDP", "slowmo3": "SlowMo freq 3"}[name] + f", {precision}"


# -- one rank: build and train one run ----------------------------------------------------------------------------


def _compressed_hook(compression: str, block: int) -> Any:
    from ddpkit.algorithms.compressed_mean import compressed_mean

    def hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(compressed_mean(bucket.buffer(), group, compression, block))
        return future

    # DDP checks these two annotations, which postponed evaluation would leave as strings
    hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
    return hook


def build(name: str, compression: str, model: nn.Module, job: dict[str, Any]) -> tuple[nn.Module, Any]:
    """The module to call and what to call after ``optimizer.step()`` (its optimizer is made by the caller)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpkit.distributed import counting_allreduce_hook
    from ddpkit.nn import SlowMoDistributedDataParallel

    if name == "local":
        return model, None
    if name == "ddp":
        ddp = DDP(model)
        hook = counting_allreduce_hook if compression == "none" else _compressed_hook(compression, job["block"])
        ddp.register_comm_hook(None, hook)
        return ddp, None
    periods = [int(p) for p in job["periods"].split(",")]
    kwargs: dict[str, Any] = {"slowmo_compression": compression, "slowmo_compression_block": job["block"]}
    kwargs["slowmo_error_feedback"] = job["error_feedback"] and compression not in ("none", "bf16")
    if name == "slowmo3":
        kwargs.update(localsgd_frequency=3, slowmo_momentum=0.5, slowmo_frequency=48)
    else:
        h = max(periods) if name == "streaming" else int(name[6:])
        kwargs.update(localsgd_frequency=h, slowmo_frequency=h)
        kwargs.update(slowmo_momentum=job["outer_momentum"], slowmo_lr=job["outer_lr"])
        kwargs["slowmo_nesterov"] = True
        if name == "streaming":
            kwargs.update(slowmo_fragments=4, slowmo_sync_delay=1)
    slowmo = SlowMoDistributedDataParallel(model, nprocs_per_node=1, **kwargs)
    return slowmo, slowmo


def _sent() -> tuple[float, int | None]:
    from ddpkit.distributed import comm_stats

    return comm_stats.total().sent_bytes, tx_bytes()


def train_run(job: dict[str, Any], workload: workloads.GPTText, name: str, compression: str) -> dict[str, Any]:
    """Trains one run on this rank; returns its timings, bytes and held-out losses."""
    model = workload.model(job["seed"])
    wrapped, slowmo = build(name, compression, model, job)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=job["lr"])
    steps = job["steps"]
    held_out = workload.held_out(job["seed"], HELD_OUT)
    batches = workload.batches(job["seed"], job["rank"], steps, job["batch"])
    dist.barrier()
    sent0, tx0 = _sent()
    evals = [(0, 0.0, held_out_loss(model, workload, held_out), 0.0, 0)]  # step, clock, loss, counted, measured
    start, paused = time.perf_counter(), 0.0
    for step, (x, y) in enumerate(batches, 1):
        if step == job["warmup"] + 1:
            t0, paused0, (sent1, tx1) = time.perf_counter(), paused, _sent()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, job["lr"])
        optimizer.zero_grad(set_to_none=True)
        workload.loss(wrapped(x), y).backward()
        optimizer.step()
        if slowmo is not None:
            slowmo.zero_grad(set_to_none=True)
            slowmo.perform_slowmo(optimizer)
        if step % job["eval_every"] == 0 or step == steps:
            pause = time.perf_counter()
            sent, tx = _sent()
            loss = held_out_loss(model, workload, held_out)
            evals.append((step, pause - start - paused, loss, sent - sent0, None if tx is None else tx - tx0))
            paused += time.perf_counter() - pause
    elapsed = time.perf_counter() - t0 - (paused - paused0)
    sent2, tx2 = _sent()
    dist.barrier()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(replicas, flat)
    timed = steps - job["warmup"]
    return {
        "run": name,
        "compression": compression,
        "samples_per_s": 2 * job["batch"] * timed / elapsed,
        "modelled_bytes_per_step": (sent2 - sent1) / timed,
        "measured_bytes_per_step": None if tx2 is None else (tx2 - tx1) / timed,
        "evals": evals,
        "replica_max_diff": (replicas[1] - replicas[0]).abs().max().item(),
        "parameters": flat.numel(),
    }


def worker(job: dict[str, Any]) -> None:
    """Runs every run of ``job["runs"]`` on rank ``job["rank"]``, writing the results after each one."""
    torch.set_num_threads(1)
    init = f"tcp://{job['master']}:{PORT}"
    timeout = timedelta(seconds=job["pg_timeout"])
    dist.init_process_group("gloo", init_method=init, rank=job["rank"], world_size=2, timeout=timeout)
    workload = workloads.GPTText(*job["gpt"])
    done = []
    for name, compression in job["runs"]:
        if job["rank"] == 0:
            print(f"  {job['rate']}: {name} {compression}", file=sys.stderr, flush=True)
        done.append(train_run(job, workload, name, compression))
        Path(job["out"]).write_text(json.dumps(done))
    dist.barrier()
    leave()  # collects what still references the group (a DDP reducer) first


# -- the driver: every run on the two hosts, at each link rate ----------------------------------------------------


def run_rate(rate: str, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Every run at link rate `rate`, as one 2-process job over two shaped hosts."""
    keys = ("steps", "warmup", "eval_every", "batch", "lr", "seed", "pg_timeout", "periods", "block", "outer_lr")
    keys += ("outer_momentum",)
    with netns.Hosts(2, rate, args.burst, args.latency) as hosts:
        commands, envs, outs = [], [], []
        for rank in range(2):
            out = os.path.join(workdir, f"{rate}.{rank}.json")
            job = {k: getattr(args, k) for k in keys}
            job.update(rank=rank, rate=rate, out=out, runs=runs(args), master=hosts.addresses[0])
            job.update(gpt=[int(v) for v in args.gpt.split(",")], error_feedback=args.error_feedback)
            commands.append([*hosts.prefix(rank), sys.executable, "-m", "benchmarks.bench_diloco", json.dumps(job)])
            path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
            envs.append(dict(os.environ, GLOO_SOCKET_IFNAME=hosts.ifnames[rank], PYTHONPATH=path))
            outs.append(out)
        load = os.getloadavg()
        netns.run_job(commands, envs, args.run_timeout, f"diloco at {rate}")
        link = hosts.describe()
    ranks = [json.loads(Path(out).read_text()) for out in outs]
    rows = [summarise(pair, args.periods) for pair in zip(*ranks, strict=True)]
    return {"link": link, "load_average_before": list(load), "load_average_after": list(os.getloadavg()), "rows": rows}


def _merge_evals(e0: list, e1: list) -> tuple:
    """Both ranks' evaluations at one step: the slower clock, the mean loss, the larger byte counts."""
    measured = None if e0[4] is None or e1[4] is None else max(e0[4], e1[4])
    return e0[0], max(e0[1], e1[1]), (e0[2] + e1[2]) / 2, max(e0[3], e1[3]), measured


def summarise(pair: tuple[dict[str, Any], ...], periods: str) -> dict[str, Any]:
    measured = [r["measured_bytes_per_step"] for r in pair]
    evals = [_merge_evals(e0, e1) for e0, e1 in zip(pair[0]["evals"], pair[1]["evals"], strict=True)]
    return {
        "run": pair[0]["run"],
        "compression": pair[0]["compression"],
        "label": label(pair[0]["run"], pair[0]["compression"], periods),
        "samples_per_s": min(r["samples_per_s"] for r in pair),
        "held_out": evals[-1][2],
        "modelled_bytes_per_step": max(r["modelled_bytes_per_step"] for r in pair),
        "measured_bytes_per_step": None if None in measured else max(measured),
        "replica_max_diff": pair[0]["replica_max_diff"],
        "evals": evals,
        "parameters": pair[0]["parameters"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    for method in args.methods.split(","):
        if method not in METHODS:
            raise UsageError(f"--methods: unknown {method!r}; choose from {', '.join(METHODS)}")
    for compression in args.compressions.split(","):
        if compression not in COMPRESSIONS:
            raise UsageError(f"--compressions: unknown {compression!r}; choose from {', '.join(COMPRESSIONS)}")
    if args.steps <= args.warmup:
        raise UsageError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if why := netns.unavailable():
        raise Skip(why)
    by_rate = {}
    with tempfile.TemporaryDirectory(prefix="ddpkit-diloco-") as workdir:
        for rate in progress(args.rates.split(","), desc="diloco"):
            by_rate[rate] = run_rate(rate, args, workdir)
    workload = workloads.GPTText(*[int(v) for v in args.gpt.split(",")]).describe()
    return {"workload": workload, "by_rate": by_rate}


# -- the table, the goals and the plots ---------------------------------------------------------------------------


def _reference(rows: list[dict[str, Any]], run_name: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["run"] == run_name and r["compression"] == "none"), None)


def table(report: dict[str, Any]) -> str:
    figures, cfg = report["figures"], report["config"]
    lines = [f"{figures['workload']}; {cfg['steps']} steps x {cfg['batch']} windows x 2 ranks"]
    for rate, block in figures["by_rate"].items():
        rows, load = block["rows"], block["load_average_before"]
        ddp, local = _reference(rows, "ddp"), _reference(rows, "local")
        lines += [
            "",
            f"{block['link']} (load average {load[0]:.1f} before this rate's runs)",
            "| run | samples/s | x no-comm | held-out loss | vs DDP fp32 | MB/step measured | MB/step modelled "
            "| DDP fp32's bytes / these |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            speed = f"{r['samples_per_s'] / local['samples_per_s']:.2f}" if local else "-"
            loss = f"{100 * (r['held_out'] / ddp['held_out'] - 1):+.1f}%" if ddp else "-"
            measured = r["measured_bytes_per_step"]
            fewer = _fewer(ddp, r)
            lines.append(
                f"| {r['label']} | {r['samples_per_s']:.1f} | {speed} | {r['held_out']:.4f} | {loss} "
                f"| {'-' if measured is None else f'{measured / 1e6:.4f}'} "
                f"| {r['modelled_bytes_per_step'] / 1e6:.4f} | {fewer} |"
            )
        lines += verdict(rate, rows, ddp, local)
    return "\n".join(lines)


def _fewer(ddp: dict[str, Any] | None, row: dict[str, Any]) -> str:
    ratio = _ratio(ddp, row)
    return "-" if ratio is None else ("no bytes" if ratio == float("inf") else f"{ratio:.0f}x")


def _ratio(ddp: dict[str, Any] | None, row: dict[str, Any]) -> float | None:
    """DDP fp32's measured bytes per step over this row's (modelled where not measured)."""
    if ddp is None:
        return None
    key = "measured_bytes_per_step" if row["measured_bytes_per_step"] is not None else "modelled_bytes_per_step"
    return ddp[key] / row[key] if row[key] else float("inf")


def verdict(rate: str, rows: list[dict[str, Any]], ddp: dict | None, local: dict | None) -> list[str]:
    """Goals: >= 100x fewer bytes than DDP with a held-out loss within 2% of DDP's; at 10 Mbit/s >= 0.9x the
    samples/s of the run without communication."""
    if ddp is None:
        return ["verdict: DDP fp32 was not run"]
    out = []
    for r in rows:
        if r["run"] in ("local", "ddp"):
            continue
        fewer, loss = _ratio(ddp, r), r["held_out"] / ddp["held_out"] - 1
        bytes_met = fewer is not None and fewer >= GOAL_BYTES and abs(loss) <= GOAL_LOSS
        line = f"{r['label']}: {fewer:.0f}x fewer bytes, loss {100 * loss:+.1f}%: {'met' if bytes_met else 'NOT met'}"
        if rate == "10mbit" and local is not None:
            speed = r["samples_per_s"] / local["samples_per_s"]
            line += f"; {speed:.2f}x no-comm samples/s: {'met' if speed >= GOAL_SPEED else 'NOT met'}"
        out.append(line)
    return ["goals (>= 100x fewer bytes and loss within 2%; at 10mbit >= 0.9x no-comm samples/s):", *out]


STYLE = {"none": "-", "bf16": "--", "int8": "-.", "int4": ":"}


def plot(report: dict[str, Any], out_dir: Path) -> None:
    """Per link rate: held-out loss against bytes sent per rank and against wall-clock time."""
    plt = plotting.pyplot()
    by_rate = report["figures"]["by_rate"]
    fig, axes = plt.subplots(len(by_rate), 2, figsize=(13, 4.6 * len(by_rate)), squeeze=False)
    colours = {m: f"C{i}" for i, m in enumerate(sorted({r["run"] for b in by_rate.values() for r in b["rows"]}))}
    for (rate, block), (ax1, ax2) in zip(by_rate.items(), axes, strict=True):
        for r in block["rows"]:
            _, clock, loss, counted, measured = zip(*r["evals"], strict=True)
            sent = [c if m is None else m for c, m in zip(counted, measured, strict=True)]
            style = {"color": colours[r["run"]], "linestyle": STYLE[r["compression"]], "label": r["label"]}
            points = [(s, v) for s, v in zip(sent, loss, strict=True) if s > 0]  # a log axis: the start is off it
            if r["run"] != "local" and points:  # the reference sends nothing
                ax1.plot(*zip(*points, strict=True), marker=".", **style)
            ax2.plot(clock, loss, marker=".", **style)
        ax1.set(xscale="log", xlabel="bytes sent per rank (measured on the interface)", ylabel="held-out loss")
        ax2.set(xlabel="wall-clock seconds (evaluation excluded)", ylabel="held-out loss")
        ax1.set_title(f"{rate}: held-out loss against bytes")
        ax2.set_title(f"{rate}: held-out loss against time")
        ax2.legend(fontsize=6, ncol=2)
    fig.suptitle(plotting.title(report["figures"]["workload"], 2, report))
    plotting.save(fig, report["benchmark"], out_dir)


def result_name(args: argparse.Namespace) -> str:
    """diloco, or diloco_<rates>_<steps>steps for runs at other rates or lengths (the quick run keeps diloco)."""
    outer = "" if (args.outer_lr, args.outer_momentum) == (0.7, 0.9) else f"_outer{args.outer_lr}_{args.outer_momentum}"
    if args.quick or (args.rates == "100mbit,10mbit" and args.steps == 400 and not outer):
        return "diloco"
    return f"diloco_{args.rates.replace(',', '_')}_{args.steps}steps{outer}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    parser.add_argument("--compressions", default=",".join(COMPRESSIONS), help="comma-separated subset")
    parser.add_argument("--periods", default="50,100", help="DiLoCo's H values; streaming DiLoCo takes the largest")
    parser.add_argument("--rates", default="100mbit,10mbit", help="tbf rate of each link, both ways, one job each")
    parser.add_argument("--gpt", default="2,64,2,64", help="GPT layers,width,heads,context")
    parser.add_argument("--steps", type=int, default=400, help="a multiple of every period keeps them whole")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the clock starts")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out losses")
    parser.add_argument("--batch", type=int, default=16, help="windows per rank and step")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's base lr of the cosine schedule")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer lr (slowmo_lr)")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo's outer Nesterov momentum")
    parser.add_argument("--block", type=int, default=64, help="slowmo_compression_block")
    parser.add_argument("--error-feedback", action="store_true", help="slowmo_error_feedback for int8/int4")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data streams")
    netns.add_link_arguments(parser, 1500.0, "link rate")


if __name__ == "__main__":  # a rank: python -m benchmarks.bench_diloco '<job as JSON>'
    worker(json.loads(sys.argv[1]))
    exit_without_teardown()  # torch's teardown of a gloo job aborts now and then, after the results are written
