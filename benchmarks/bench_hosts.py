"""Sharding across hosts of several ranks: step time and the bytes that leave each host, against torch DDP.

Two network-namespace hosts, each with ``--per-host`` ranks (2 by default), joined by links shaped to each rate
(tbf, both ways). One job per rate runs every strategy in interleaved rounds on the same process group:

* ``ddp``: torch DDP + ``torch.optim.Adam`` (the baseline); ``ddp_fused``: the same with ``Adam(fused=True)``;
* ``oss_ddp``: ddpkit OSS(Adam) + torch DDP (ZeRO-1; its parameter broadcast is hierarchical); ``oss_hook``: the
  same with `reduce_to_owners_hook` (each gradient reduced to its owner instead of all-reduced: DDP's bytes);
* ``sharded_flat``: OSS(hierarchical=False) + ShardedDataParallel: every rank reduces to and receives from every
  owner over the sockets, as before hierarchical sharding;
* ``sharded``: OSS + ShardedDataParallel with the defaults: hierarchical (within each host through shared
  memory, one copy per host across, `ddpkit.distributed.hosts`); ``sharded_int8``: the same with
  ``cross_host_compression="int8"`` (gradients cross quantised, with error feedback).

Per step (after ``--warmup``): the slowest rank's wall time (fenced by barriers) and the bytes each host's
interface sent (its ``/proc/net/dev`` transmit counter, which also counts TCP/IP headers and the fencing
barriers). Step times are medians over steps and then over rounds; bytes are means. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.lib import netns, plotting, tables
from benchmarks.lib.cli import Skip, progress

if TYPE_CHECKING:
    from benchmarks.lib.workloads import Workload

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "hosts: ZeRO-1/2 on 2 namespace hosts x 2 ranks, step time and bytes leaving each host vs DDP (root)"
QUICK = {"rates": "1gbit", "rounds": 1, "steps": 2, "warmup": 1, "workload": "gpt-quick"}
STRATEGIES = ("ddp", "ddp_fused", "oss_ddp", "oss_hook", "sharded_flat", "sharded", "sharded_int8")
GOAL_STEP = 0.9  # sharded's step at most this times DDP's; bytes leaving a host at most DDP's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="100mbit,1gbit", help="tbf rates of the host links, comma-separated")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--per-host", type=int, default=2, help="ranks on each of the 2 hosts")
    parser.add_argument(
        "--workload", default="gpt-advisor", choices=["gpt-advisor", "gpt", "mlp", "gpt-quick"], help="what to train"
    )
    parser.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every strategy, interleaved")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    netns.add_link_arguments(parser, 1500.0, "rate")


def _workload(name: str) -> Workload:
    from benchmarks.lib import workloads  # here: each host's launcher, which only spawns its ranks, needs no torch

    if name == "gpt-advisor":  # the advisor benchmark's GPT: 4 layers x 256, 3.3M parameters
        return workloads.GPTText(4, 256, 4, 128)
    if name == "gpt-quick":
        return workloads.workload("gpt", quick=True)
    return workloads.workload(name)


# -- inside each host: its ranks --------------------------------------------------------------------------------


def _tx(ifname: str) -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])
    raise RuntimeError(f"bench_hosts: no interface {ifname!r} in /proc/net/dev")


def _setup(strategy: str, model: Any) -> tuple[Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpkit.nn import ShardedDataParallel
    from ddpkit.optim import OSS, reduce_to_owners_hook

    if strategy in ("ddp", "ddp_fused"):
        return DDP(model), torch.optim.Adam(model.parameters(), lr=1e-3, fused=strategy == "ddp_fused")
    if strategy in ("oss_ddp", "oss_hook"):
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
        ddp = DDP(model)
        if strategy == "oss_hook":
            ddp.register_comm_hook(opt, reduce_to_owners_hook)
        return ddp, opt
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3, hierarchical=strategy != "sharded_flat")
    compression = "int8" if strategy == "sharded_int8" else "none"
    return ShardedDataParallel(model, opt, cross_host_compression=compression), opt


def _rank_main(local: int, cfg: dict[str, Any], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = cfg["ifname"]
    rank, world = cfg["host"] * cfg["per_host"] + local, 2 * cfg["per_host"]
    from datetime import timedelta

    dist.init_process_group(
        "gloo", init_method=cfg["init"], rank=rank, world_size=world, timeout=timedelta(seconds=cfg["pg_timeout"])
    )
    torch.set_num_threads(1)
    work = _workload(cfg["workload"])
    batches = work.batches(0, rank, cfg["warmup"] + cfg["steps"], cfg["batch"])
    out: dict[str, Any] = {}
    for _ in range(cfg["rounds"]):
        for strategy in cfg["strategies"]:
            model, opt = _setup(strategy, work.model(0))
            times, sent = [], []
            for step, (x, y) in enumerate(batches):
                dist.barrier()
                before = _tx(cfg["ifname"])
                start = time.perf_counter()
                opt.zero_grad()
                work.loss(model(x), y).backward()
                opt.step()
                took = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's step
                dist.barrier()
                if step >= cfg["warmup"]:
                    times.append(float(took) * 1e3)
                    sent.append(_tx(cfg["ifname"]) - before)
            entry = out.setdefault(strategy, {"step_ms": [], "host_bytes": []})
            entry["step_ms"].append(statistics.median(times))
            entry["host_bytes"].append(statistics.mean(sent))
            del model, opt
    if local == 0:
        queue.put(out)
    dist.destroy_process_group()


def host_main(argv: list[str]) -> None:
    """``python -m benchmarks.bench_hosts HOST CONFIG.json OUT.json``: this host's ranks (run in its namespace)."""
    host, cfg = int(argv[0]), json.loads(Path(argv[1]).read_text())
    cfg["host"] = host
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(local, cfg, queue)) for local in range(cfg["per_host"])]
    for p in procs:
        p.start()
    result = queue.get(timeout=cfg["run_timeout"])
    for p in procs:
        p.join(timeout=120)
    Path(argv[2]).write_text(json.dumps(result))


# -- the benchmark --------------------------------------------------------------------------------------------


def _run_rate(args: argparse.Namespace, rate: str, strategies: list[str], workdir: str) -> list[dict[str, Any]]:
    with netns.Hosts(2, rate, args.burst, args.latency) as hosts:
        config = {
            "init": f"tcp://{hosts.addresses[0]}:29671",
            "per_host": args.per_host,
            "workload": args.workload,
            "batch": args.batch,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "strategies": strategies,
            "pg_timeout": args.pg_timeout,
            "run_timeout": args.run_timeout,
        }
        commands, envs, outs = [], [], []
        for k in range(2):
            path = os.path.join(workdir, f"config-{rate}-{k}.json")
            Path(path).write_text(json.dumps({**config, "ifname": hosts.ifnames[k]}))
            outs.append(os.path.join(workdir, f"out-{rate}-{k}.json"))
            commands.append([*hosts.prefix(k), sys.executable, "-m", "benchmarks.bench_hosts", str(k), path, outs[-1]])
            envs.append(
                dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
            )
        netns.run_job(commands, envs, args.run_timeout, f"hosts benchmark at {rate}")
        per_host = [json.loads(Path(p).read_text()) for p in outs]
    rows = []
    for strategy in strategies:
        step_ms = statistics.median(per_host[0][strategy]["step_ms"])  # every host saw the same slowest step
        host_bytes = max(statistics.mean(h[strategy]["host_bytes"]) for h in per_host)
        rows.append(
            {
                "rate": rate,
                "strategy": strategy,
                "step_ms": step_ms,
                "host_mb": host_bytes / 1e6,
                "round_step_ms": per_host[0][strategy]["step_ms"],
            }
        )
    base = next((r for r in rows if r["strategy"] == "ddp"), None)
    for row in rows:
        row["x_ddp"] = row["step_ms"] / base["step_ms"] if base else None
        row["bytes_x_ddp"] = row["host_mb"] / base["host_mb"] if base else None
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    if why := netns.unavailable():
        raise Skip(why)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        raise ValueError(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    rows, load = [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="ddpkit-hosts-") as workdir:
        for rate in progress(rates, desc="hosts"):
            rows += _run_rate(args, rate, strategies, workdir)
            load.append(os.getloadavg()[0])
    sharded = [r for r in rows if r["strategy"] == "sharded" and r["x_ddp"] is not None]
    return {
        "workload": _workload(args.workload).describe(),
        "rows": rows,
        "goal_met": bool(sharded) and all(r["x_ddp"] <= GOAL_STEP and r["bytes_x_ddp"] <= 1.0 for r in sharded),
        "load_average_during": [min(load), max(load)],
    }


def table(report: dict[str, Any]) -> str:
    figures, cfg = report["figures"], report["config"]
    low, high = figures["load_average_during"]
    head = (
        f"{figures['workload']}; 2 hosts x {cfg['per_host']} ranks, batch {cfg['batch']}/rank, {cfg['steps']} "
        f"timed steps, medians of {cfg['rounds']} interleaved rounds; tbf links (burst {cfg['burst']}, latency "
        f"{cfg['latency']}); load average {low:.1f}-{high:.1f} on {report['machine']['cores']} cores"
    )
    rows = [
        (
            r["rate"],
            r["strategy"],
            tables.num(r["step_ms"], ".0f"),
            tables.num(r["x_ddp"]),
            tables.num(r["host_mb"], ".2f"),
            tables.num(r["bytes_x_ddp"]),
        )
        for r in figures["rows"]
    ]
    header = ("rate", "strategy", "step ms", "x DDP", "MB leaving a host per step", "x DDP")
    verdict = f"goal (sharded step <= {GOAL_STEP}x DDP's and bytes leaving a host <= DDP's at every rate): "
    verdict += "met" if figures["goal_met"] else "NOT met"
    return "\n".join([head, tables.markdown(header, rows), verdict])


def plot(report: dict[str, Any], out_dir: Path) -> None:
    plt = plotting.pyplot()
    figures = report["figures"]
    rates = list(dict.fromkeys(r["rate"] for r in figures["rows"]))
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        rows = [r for r in figures["rows"] if r["rate"] == rate]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["x_ddp"] or 0 for r in rows], width=0.4, label="step time / DDP's")
        ax.bar(
            [i + 0.2 for i in x], [r["bytes_x_ddp"] or 0 for r in rows], width=0.4, label="bytes leaving a host / DDP's"
        )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(list(x), [r["strategy"] for r in rows], rotation=20)
        ax.set(title=f"{rate} links, 2 hosts x {report['config']['per_host']} ranks", ylabel="ratio to torch DDP")
        ax.legend()
    fig.suptitle(plotting.title(figures["workload"], 2 * report["config"]["per_host"], report))
    plotting.save(fig, "hosts", out_dir)


if __name__ == "__main__":
    host_main(sys.argv[1:])
