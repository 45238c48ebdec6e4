"""Memory: what each strategy's job holds at its peak, and the largest model it trains under a memory limit.

(a) Each strategy trains `--steps` steps of a large model (Adam, batch `--batch` per rank) in fresh spawned gloo
CPU processes, the whole job (launcher and ranks) inside a memory cgroup of its own (`benchmarks.lib.cgroup`):
every page counted once, shared memory included. The same job on a tiny model (same strategy, same processes) is
subtracted, so the figure is what the model costs: the job's peak per rank in units of P, the model's parameter
bytes. Beside it, each rank's own peak (its resident set's high-water mark above its size before the model was
built; a shared page counts in every rank that maps it). The reference is the formula for ZeRO-2 with Adam:
parameters P, plus gradients P and Adam's two moments 2P split over N ranks: P + 3P/N per rank.

(b) With ``--search``: under a cgroup limit of ``--limit-gb``, the deepest MLP (``--width`` square layers) that
trains 3 steps, per strategy, found by probing depths near the one (a) predicts (a job that runs out of the limit
is ended by the kernel).

With ``--hosts 2`` every job's ranks are spread over two network-namespace hosts (``benchmarks.lib.netns``), each
host's processes in a cgroup of their own: the job's peak is the sum of the hosts' peaks (no page is shared between
hosts), so ddpkit takes its paths between hosts (sockets, hierarchical sharding) as on separate machines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.bench_sharding import PEERS, STRATEGIES, parse_sizes, parse_strategies
from benchmarks.lib import cgroup, netns, peers, plotting
from benchmarks.lib.cli import Skip, UsageError, progress
from benchmarks.lib.tables import markdown, num

QUESTION = "memory: the whole job's peak per rank (a memory cgroup) and the largest model under a limit, per strategy"
DEFAULT_STRATEGIES = "ddp,zero,fairscale,fsdp2,fsdp2_reshard,oss_ddp,oss_sdp"
QUICK = {
    "world_size": "2",
    "workloads": "mlp",
    "width": 512,
    "depth": 4,
    "strategies": "ddp,oss_sdp",
    "steps": 2,
    "allocators": "default",
    "cold": True,
}
TINY = {"mlp": {"depth": 1, "width": 64}, "gpt": {"layers": 1, "width": 64}}
MAX_PROBES = 6  # depths tried per strategy in the search
HOST_LINK = ("10gbit", "8mb")  # the namespace hosts' links (rate, burst): memory, not speed, is measured here


def _job(spec: dict[str, Any], limit_bytes: int | None = None) -> tuple[cgroup.Outcome, dict[str, Any] | None]:
    """One job in its own cgroup (one per host on namespace hosts: the peak is then their sum, each host's pages
    counted once): its outcome and the ranks' reports (None when it failed)."""
    count = spec.get("hosts", 1)
    command = [sys.executable, "-m", "benchmarks.lib.memory_job"]
    if count == 1:
        outcomes = [cgroup.run([*command, json.dumps(spec)], limit_bytes, timeout=spec.get("timeout", 900.0))]
    else:
        per_host = spec["world_size"] // count
        with netns.Hosts(count, rate=HOST_LINK[0], burst=HOST_LINK[1]) as hosts:
            init = f"tcp://{hosts.addresses[0]}:29683"
            places = [
                {"index": k, "per_host": per_host, "init": init, "ifname": name} for k, name in enumerate(hosts.ifnames)
            ]
            commands = [[*hosts.prefix(k), *command, json.dumps({**spec, "host": places[k]})] for k in range(count)]
            outcomes = cgroup.run_together(commands, limit_bytes, timeout=spec.get("timeout", 900.0))
    outcome = cgroup.Outcome(
        max((o.returncode for o in outcomes), key=abs),
        "\n".join(o.stdout for o in outcomes),
        "\n".join(o.stderr for o in outcomes),
        sum(o.peak_bytes for o in outcomes),
        any(o.out_of_memory for o in outcomes),
    )
    if outcome.returncode != 0:
        return outcome, None
    ranks = []
    for part in outcomes:  # host by host, in rank order
        lines = [line for line in part.stdout.splitlines() if line.startswith("{")]
        ranks += json.loads(lines[-1])["ranks"]
    return outcome, {"ranks": ranks}


def _spec(args: argparse.Namespace, workload: str, world_size: int, strategy: str, **model: Any) -> dict[str, Any]:
    shape = (
        {"depth": args.depth, "width": args.width}
        if workload == "mlp"
        else {"layers": args.gpt_layers, "width": args.gpt_width}
    )
    shape.update(model)
    return {
        "strategy": strategy,
        "world_size": world_size,
        "workload": workload,
        "steps": args.steps,
        "batch": args.batch,
        "seed": 0,
        "timeout": args.timeout,
        "allocator": "default",
        "hosts": args.hosts,
        **shape,
    }


def _checked(outcome: cgroup.Outcome, reports: dict[str, Any] | None, what: str) -> dict[str, Any]:
    if reports is None:
        raise RuntimeError(f"{what} failed (exit status {outcome.returncode}): {outcome.stderr.strip()[-600:]}")
    return reports


def measure(args: argparse.Namespace, workload: str, world_size: int, strategy: str) -> dict[str, Any]:
    """Part (a) for one strategy: the big job's peak above the tiny one's, per rank, in units of P, for each
    allocator setting of ``--allocators``."""
    if not args.cold:
        _job(_spec(args, workload, world_size, strategy, **TINY[workload]))  # warm-up: files read for the first time
    row: dict[str, Any] = {"key": strategy, "label": STRATEGIES[strategy][0], "world_size": world_size}
    for allocator in args.allocators.split(","):
        tiny = _spec(args, workload, world_size, strategy, allocator=allocator, **TINY[workload])
        base_outcome, base = _job(tiny)
        _checked(base_outcome, base, f"{strategy} on the tiny model")
        outcome, reports = _job(_spec(args, workload, world_size, strategy, allocator=allocator))
        ranks = _checked(outcome, reports, f"{strategy} at {world_size} ranks")["ranks"]
        p_bytes = 4 * ranks[0]["parameters"]
        row["parameters"] = ranks[0]["parameters"]
        row["state_p"] = max(r["state_bytes"] for r in ranks) / p_bytes
        row[allocator] = {
            "job_peak_mb": outcome.peak_bytes / 2**20,
            "tiny_job_peak_mb": base_outcome.peak_bytes / 2**20,
            "job_per_rank_p": (outcome.peak_bytes - base_outcome.peak_bytes) / world_size / p_bytes,
            "own_peak_p": [r["own_peak_mb"] * 2**20 / p_bytes for r in ranks],
        }
    return row


def zero2_limit(world_size: int) -> float:
    """ZeRO-2's memory per rank with Adam, in units of P: the parameters, plus gradients and two moments split."""
    return 1 + 3 / world_size


def search(args: argparse.Namespace, strategy: str, per_rank_p: float | None, tiny_mb: float) -> dict[str, Any]:
    """Part (b): the deepest MLP of `--width` layers that trains under the limit, probing from (a)'s prediction."""
    limit = int(args.limit_gb * 2**30)
    n, width = args.search_world_size, args.width
    layer_bytes = 4 * (width * width + width)
    factor = per_rank_p if per_rank_p is not None else 6.0
    predicted = max(1, int((limit - tiny_mb * 2**20) / (n * factor * layer_bytes)))
    fits: dict[int, bool] = {}

    def fits_at(depth: int) -> bool:
        if depth not in fits:
            spec = _spec(args, "mlp", n, strategy, depth=depth, width=width, allocator=args.search_allocator)
            outcome, reports = _job(spec, limit)
            if reports is None and not outcome.out_of_memory:
                raise RuntimeError(f"{strategy} at depth {depth} failed, not for memory: {outcome.stderr[-600:]}")
            fits[depth] = reports is not None
        return fits[depth]

    step = max(1, predicted // 12)
    depth = predicted
    going_up = fits_at(depth)
    while len(fits) < MAX_PROBES:
        nxt = depth + step if going_up else depth - step
        if nxt < 1 or fits_at(nxt) != going_up:
            break
        depth = nxt
    largest = max((d for d, ok in fits.items() if ok), default=0)
    closest_failure = min((d for d, ok in fits.items() if not ok and d > largest), default=None)
    return {
        "key": strategy,
        "label": STRATEGIES[strategy][0],
        "predicted_depth": predicted,
        "largest_depth": largest,
        "smallest_failing_depth": closest_failure,
        "largest_parameters": largest * (width * width + width),
        "probes": {str(d): ok for d, ok in sorted(fits.items())},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    why = cgroup.unavailable()
    if why is not None:
        raise Skip(f"memory: {why}; the job's peak needs a memory cgroup")
    sizes = parse_sizes(args.world_size)
    if args.hosts > 1:
        if why := netns.unavailable():
            raise Skip(f"memory --hosts: {why}")
        if args.search or any(size % args.hosts for size in sizes):
            raise UsageError(
                f"--hosts {args.hosts}: every --world-size must be a multiple of it, and --search runs on one host only"
            )
    keys = parse_strategies(args.strategies)
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not chosen or any(w not in TINY for w in chosen):
        raise UsageError(f"--workloads: expected mlp, gpt or both separated by a comma; got {args.workloads!r}")
    skipped = {k: why for k in keys if k in PEERS and (why := peers.unavailable(*PEERS[k]))}
    keys = [k for k in keys if k not in skipped]
    if not args.cold:
        _job(_spec(args, "mlp", 2, "ddp", **TINY["mlp"]))  # warm-up: torch's files into the page cache
    rows: list[dict[str, Any]] = []
    for workload, size, key in progress([(w, s, k) for w in chosen for s in sizes for k in keys], desc="memory"):
        try:
            rows.append({"workload": workload, **measure(args, workload, size, key)})
        except Exception as exc:  # e.g. a peer that does not run on this torch: say so and go on
            skipped[f"{key} ({workload}, {size} ranks)"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
    found = []
    if args.search:
        for key in progress(keys, desc="largest model"):
            row = next(
                (
                    r
                    for r in rows
                    if r["key"] == key and r["workload"] == "mlp" and r["world_size"] == args.search_world_size
                ),
                None,
            )
            measured = row.get(args.search_allocator) if row else None
            tiny = measured["tiny_job_peak_mb"] if measured else 600.0
            try:
                found.append(search(args, key, measured["job_per_rank_p"] if measured else None, tiny))
            except Exception as exc:
                skipped[f"{key} (search)"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
    limits = {str(s): zero2_limit(s) for s in sizes}
    searched = {"limit_gb": args.limit_gb, "world_size": args.search_world_size, "width": args.width}
    return {"rows": rows, "largest": found, "skipped": skipped, "limits": limits, "search": searched}


def _ratio(value: float, base: float | None) -> float | None:
    return None if not base else value / base


def table(report: dict[str, Any]) -> str:
    figures, config = report["figures"], report["config"]
    out = []
    for workload in dict.fromkeys(r["workload"] for r in figures["rows"]):
        rows = [r for r in figures["rows"] if r["workload"] == workload]
        params = rows[0]["parameters"]
        where = f"; on {config['hosts']} namespace hosts" if config.get("hosts", 1) > 1 else ""
        out += [
            "",
            f"{workload}: {params:,} parameters, P = {4 * params / 2**20:.0f} MiB{where}; Adam, batch "
            f"{config['batch']} per rank, {config['steps']} steps; whole-job peak per rank above the same job "
            "on a tiny model, in units of P",
        ]
        allocators = config["allocators"].split(",")
        header = ["strategy", "ranks"]
        for allocator in allocators:
            header += [f"job peak per rank (P), {allocator}", "x ZeRO-2 limit", "own peak per rank (P)"]
        header.append("state (P)")
        cells = []
        for r in rows:
            cell = [r["label"], r["world_size"]]
            for allocator in allocators:
                got = r[allocator]
                limit = figures["limits"][str(r["world_size"])]
                cell += [
                    num(got["job_per_rank_p"]),
                    num(got["job_per_rank_p"] / limit),
                    " / ".join(num(p) for p in got["own_peak_p"]),
                ]
            cells.append([*cell, num(r["state_p"])])
        out.append(markdown(header, cells))
        out.append(
            "allocators: default = glibc as it comes; mmap = ddpkit.distributed.allocator.return_freed_memory "
            "(blocks of 1 MiB or more mapped alone, given back when freed); mapped = ddpkit train's "
            "--allocator mapped (blocks of 8 MiB or more mapped alone, in huge pages)"
        )
    limits = ", ".join(f"{num(v)} P at {s} ranks" for s, v in figures["limits"].items())
    out.append(f"ZeRO-2's limit with Adam (P + 3P/N per rank): {limits}")
    if figures["largest"]:
        search_cfg = figures["search"]
        base = {r["key"]: r["largest_parameters"] for r in figures["largest"]}
        out += [
            "",
            f"largest MLP of {search_cfg['width']}-wide layers that trains 3 steps under "
            f"{search_cfg['limit_gb']:g} GiB (the whole job), {search_cfg['world_size']} ranks",
        ]
        cells = [
            [
                r["label"],
                r["largest_depth"],
                f"{r['largest_parameters'] / 1e6:.0f}M",
                num(_ratio(r["largest_parameters"], base.get("ddp"))),
                num(_ratio(r["largest_parameters"], base.get("fsdp2"))),
                num(_ratio(r["largest_parameters"], base.get("fairscale"))),
                ", ".join(f"{d}{'' if ok else ' no'}" for d, ok in r["probes"].items()),
            ]
            for r in figures["largest"]
        ]
        out.append(
            markdown(["strategy", "layers", "parameters", "x DDP", "x FSDP2", "x fairscale", "depths probed"], cells)
        )
    out += [f"skipped {k}: {why}" for k, why in figures["skipped"].items()]
    return "\n".join(out).strip()


def plot(report: dict[str, Any], out_dir: Path) -> None:
    """Per strategy: the job's peak per rank in P at each world size against ZeRO-2's limit; the largest model."""
    plt = plotting.pyplot()
    figures = report["figures"]
    panels = 2 if figures["largest"] else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    allocators = report["config"]["allocators"].split(",")
    groups = dict.fromkeys((r["workload"], r["world_size"]) for r in figures["rows"])
    for ((workload, size), marker), allocator in itertools.product(zip(groups, "osD^v<>", strict=False), allocators):
        rows = [r for r in figures["rows"] if (r["workload"], r["world_size"]) == (workload, size)]
        fill = "full" if allocator == allocators[0] else "none"
        ax.plot(
            [r[allocator]["job_per_rank_p"] for r in rows],
            [r["key"] for r in rows],
            marker,
            fillstyle=fill,
            label=f"{workload}, {size} ranks, {allocator} allocator",
        )
        ax.axvline(figures["limits"][str(size)], ls=":", color="gray")
    ax.set_xlabel("whole-job peak per rank, units of P (dotted: ZeRO-2's limit P + 3P/N)")
    ax.legend()
    if figures["largest"]:
        ax = axes[0][1]
        ax.barh([r["key"] for r in figures["largest"]], [r["largest_parameters"] / 1e6 for r in figures["largest"]])
        ax.set_xlabel(f"largest MLP under {figures['search']['limit_gb']:g} GiB, millions of parameters")
    where = f", {report['config']['hosts']} namespace hosts" if report["config"].get("hosts", 1) > 1 else ", one host"
    what = f"whole-job memory per strategy (a cgroup per host{where})"
    fig.suptitle(plotting.title(what, report["config"]["world_size"], report), wrap=True)
    plotting.save(fig, "memory" if report["config"].get("hosts", 1) == 1 else "memory_hosts", out_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", default="2,4", help="ranks, or sizes separated by commas")
    parser.add_argument("--workloads", default="mlp,gpt", help="mlp (square layers), gpt (the byte GPT) or both")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated subset")
    parser.add_argument("--width", type=int, default=2048, help="the MLP's layer width")
    parser.add_argument("--depth", type=int, default=12, help="the MLP's layers")
    parser.add_argument("--gpt-layers", type=int, default=6, help="the GPT's blocks")
    parser.add_argument("--gpt-width", type=int, default=512, help="the GPT's width (heads of 64)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per job")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    parser.add_argument("--search", action="store_true", help="also find the largest MLP under --limit-gb (slow)")
    parser.add_argument("--limit-gb", type=float, default=8.0, help="the search's memory limit for the whole job")
    parser.add_argument("--search-world-size", type=int, default=2, help="ranks in the search")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per job")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="no warm-up jobs first (files read for the first time are then charged to the job that "
        "reads them: a smoke test, not a measurement)",
    )
    parser.add_argument(
        "--allocators", default="default,mmap", help="allocator settings to measure: default, mmap, mapped"
    )
    parser.add_argument("--search-allocator", default="mmap", help="the allocator setting of the search")
    parser.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="network-namespace hosts each job's ranks are spread over, evenly (2: every world size "
        "split over two hosts, each host's memory a cgroup of its own; needs root)",
    )


def result_name(args: argparse.Namespace) -> str:
    return "memory" if args.hosts == 1 else "memory_hosts"
