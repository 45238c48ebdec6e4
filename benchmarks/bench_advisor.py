"""How close is `ddpkit bench`'s predicted step time to the step time measured on a slow link?

The question: a user runs ``ddpkit bench --model ... --link-mbit N`` on one machine and reads a predicted step
time per strategy for a link they do not have here. Is it right? The workload: ddpkit's byte-level GPT on the
standard library's source (`ddpkit.train.workloads.gpt`, 4 layers of width 256 by default). The procedure, per
link rate:

1. ``ddpkit bench --link-mbit RATE`` on this machine, 2 processes (shared memory off, so the bytes counted are
   the socket bytes that would cross the link): each strategy's mean step, wire bytes and collectives per step.
2. ``ddpkit bench --hosts H0,H1`` on two network-namespace hosts whose links are shaped to RATE (tbf, both ways),
   one process per host: the step time each strategy really takes there, and the link the bench measures.
3. The prediction of step 1's figures for the link step 2 measured (the ``--hosts`` advisor path), and for the
   nominal RATE with ``--link-latency-ms`` (the ``--link-mbit`` path), against step 2's measured step.

Each strategy is measured in ``--rounds`` interleaved rounds (here, then on each link, strategy after strategy),
so a busy spell of the machine hits prediction and measurement alike; the table gives medians over rounds. The
goal: within 25% for ddp, sharded and slowmo at both rates. Needs root for the namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lib import netns, plotting, tables
from benchmarks.lib.cli import Skip, progress
from ddpkit.measure.advisor import Link, link_from_mbit, predict_seconds

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "advisor: ddpkit bench's predicted step time on a shaped link against the measured one (root)"
QUICK = {"rates": "200mbit", "strategies": "ddp", "rounds": 1, "steps": 3, "warmup": 0}
QUICK.update(gpt_layers=1, gpt_width=64, gpt_heads=2)
GOAL = 0.25  # relative error allowed for ddp, sharded and slowmo
JUDGED = ("ddp", "sharded", "slowmo")


def _mbit(rate: str) -> float:
    units = {"gbit": 1000.0, "mbit": 1.0, "kbit": 1e-3}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"--rates: {rate!r} must end in gbit, mbit or kbit (tc's units)")


def _bench_argv(args: argparse.Namespace, strategy: str) -> list[str]:
    argv = [
        "--model",
        "gpt",
        "--data",
        "text",
        "--gpt-layers",
        str(args.gpt_layers),
        "--gpt-width",
        str(args.gpt_width),
    ]
    argv += ["--gpt-heads", str(args.gpt_heads), "--context", str(args.context), "--batch-size", str(args.batch)]
    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--strategies", strategy]
    return [*argv, "--optimizer", "adam", "--timeout", str(args.pg_timeout)]


def _env(ifname: str | None = None) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


def run_local(args: argparse.Namespace, workdir: str, strategy: str, tag: str) -> dict[str, Any]:
    """Step 1: the bench of one strategy on this machine (predicting for the first rate)."""
    out = os.path.join(workdir, f"local-{tag}.json")
    rate = _mbit(args.rates.split(",")[0])
    argv = [*_bench_argv(args, strategy), "--link-mbit", str(rate), "--link-latency-ms", str(args.link_latency_ms)]
    argv += ["--json", out, "--plot", os.path.join(workdir, "local.png"), "--nproc-per-node", "2"]
    subprocess.run([sys.executable, "-m", "ddpkit", "bench", *argv], env=_env(), check=True, timeout=args.run_timeout)
    return json.loads(Path(out).read_text())[0]


def run_hosts(args: argparse.Namespace, workdir: str, rate: str, strategy: str, tag: str) -> dict[str, Any]:
    """Step 2: the bench of one strategy across two namespace hosts joined by links shaped to `rate`."""
    out = os.path.join(workdir, f"hosts-{tag}.json")
    with netns.Hosts(2, rate, args.burst, args.latency) as hosts:
        commands, envs = [], []
        for k in range(2):
            argv = [*_bench_argv(args, strategy), "--hosts", ",".join(hosts.addresses), "--node-rank", str(k)]
            argv += ["--master-port", "29611", "--json", out, "--plot", os.path.join(workdir, "hosts.png")]
            commands.append([*hosts.prefix(k), sys.executable, "-m", "ddpkit", "bench", *argv])
            envs.append(_env(hosts.ifnames[k]))
        netns.run_job(commands, envs, args.run_timeout, f"bench of {strategy} on {rate}")
    return json.loads(Path(out).read_text())[0]


def compare(local: dict[str, Any], there: dict[str, Any], rate: str, latency_ms: float) -> list[dict[str, Any]]:
    """Step 3: one round's prediction against the measurement, for the measured and the nominal link."""
    rows = []
    here = Link(**local["link"])
    nominal = link_from_mbit(_mbit(rate), latency_ms)
    for target, how in ((Link(**there["link"]), "measured link"), (nominal, "nominal")):
        predicted = predict_seconds(local, here, target) * 1e3
        rows.append(
            {
                "rate": rate,
                "strategy": local["strategy"],
                "link": how,
                "link_mbit": target.mbit,
                "link_latency_ms": target.latency * 1e3,
                "measured_ms": there["step_ms"],
                "predicted_ms": predicted,
                "error": predicted / there["step_ms"] - 1,
                "local_ms": local["step_ms"],
                "wire_mb": local["wire_bytes_per_step"] / 1e6,
                "messages": local["messages_per_step"],
            }
        )
    return rows


def summarise(tries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (rate, strategy, link): the median over rounds of the prediction and of the measurement."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in tries:
        groups.setdefault((row["rate"], row["strategy"], row["link"]), []).append(row)
    rows = []
    for group in groups.values():
        row = dict(group[0])
        for key in ("predicted_ms", "measured_ms", "local_ms", "link_mbit", "link_latency_ms"):
            row[key] = statistics.median(r[key] for r in group)
        row["error"] = row["predicted_ms"] / row["measured_ms"] - 1
        row["round_errors"] = [r["error"] for r in group]
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    if why := netns.unavailable():
        raise Skip(why)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in rates:
        _mbit(rate)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    plan = [(r, s) for r in range(args.rounds) for s in names]  # interleaved: a busy spell hits every figure
    tries, load = [], []
    with tempfile.TemporaryDirectory(prefix="ddpkit-advisor-") as workdir:
        for round_, strategy in progress(plan, desc="advisor"):
            load.append(os.getloadavg()[0])
            local = run_local(args, workdir, strategy, f"{round_}-{strategy}")
            for rate in rates:
                there = run_hosts(args, workdir, rate, strategy, f"{round_}-{strategy}-{rate}")
                tries += compare(local, there, rate, args.link_latency_ms)
    rows = summarise(tries)
    judged = [r for r in rows if r["strategy"] in JUDGED and r["link"] == "measured link"]
    return {
        "workload": f"{local['workload']} ({local['parameters']:,} parameters)",
        "rows": rows,
        "goal_met": all(abs(r["error"]) <= GOAL for r in judged),
        "worst_error": max(abs(r["error"]) for r in judged) if judged else None,
        "load_average_during": [min(load), max(load)],
    }


def table(report: dict[str, Any]) -> str:
    figures, cfg = report["figures"], report["config"]
    low, high = figures["load_average_during"]
    head = (
        f"{figures['workload']}; batch {cfg['batch']}/rank, {cfg['steps']} timed steps, medians of "
        f"{cfg['rounds']} interleaved rounds; 2 hosts, tbf links (burst {cfg['burst']}, latency {cfg['latency']}); "
        f"load average {low:.1f}-{high:.1f} on {report['machine']['cores']} cores"
    )
    rows = [
        (
            r["rate"],
            r["strategy"],
            r["link"],
            tables.num(r["link_mbit"], ".0f"),
            tables.num(r["link_latency_ms"]),
            tables.num(r["local_ms"], ".0f"),
            tables.num(r["predicted_ms"], ".0f"),
            tables.num(r["measured_ms"], ".0f"),
            f"{r['error']:+.0%}",
        )
        for r in figures["rows"]
    ]
    header = (
        "rate",
        "strategy",
        "predicted for",
        "Mbit/s",
        "ms/coll.",
        "here ms",
        "predicted ms",
        "measured ms",
        "error",
    )
    worst = figures["worst_error"]
    verdict = f"goal (|error| <= {GOAL:.0%} for {', '.join(JUDGED)} on the measured link): "
    verdict += ("met" if figures["goal_met"] else "NOT met") + (f", worst {worst:.0%}" if worst is not None else "")
    return "\n".join([head, tables.markdown(header, rows), verdict])


def plot(report: dict[str, Any], out_dir: Path) -> None:
    plt = plotting.pyplot()
    figures = report["figures"]
    rates = list(dict.fromkeys(r["rate"] for r in figures["rows"]))
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        rows = [r for r in figures["rows"] if r["rate"] == rate and r["link"] == "measured link"]
        names = [r["strategy"] for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["predicted_ms"] for r in rows], width=0.4, label="predicted (ddpkit bench)")
        ax.bar([i + 0.2 for i in x], [r["measured_ms"] for r in rows], width=0.4, label="measured on the link")
        ax.set_xticks(list(x), names)
        ax.set(title=f"{rate} link", ylabel="mean step time (ms)")
        ax.legend()
    fig.suptitle(plotting.title(figures["workload"], 2, report))
    plotting.save(fig, "advisor", out_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="100mbit,400mbit", help="tbf rates of the host links, comma-separated")
    parser.add_argument("--strategies", default="ddp,oss,sharded,slowmo", help="comma-separated subset")
    parser.add_argument("--gpt-layers", type=int, default=4, help="GPT blocks")
    parser.add_argument("--gpt-width", type=int, default=256, help="GPT width")
    parser.add_argument("--gpt-heads", type=int, default=4, help="GPT heads")
    parser.add_argument("--context", type=int, default=128, help="bytes per window")
    parser.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every strategy, interleaved; medians")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per strategy (a multiple of 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (a multiple of 3)")
    parser.add_argument("--link-latency-ms", type=float, default=0.5, help="latency per collective for --link-mbit")
    netns.add_link_arguments(parser, 1200.0, "bench command")
