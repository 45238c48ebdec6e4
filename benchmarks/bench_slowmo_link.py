"""SlowMo over a slow link: torch DDP, torch PostLocalSGD and ddpkit SlowMo on two "nodes" joined by 100 Mbit/s.

Run as root (network namespaces need CAP_SYS_ADMIN + CAP_NET_ADMIN)::

    python benchmarks/bench_slowmo_link.py                      # all five configurations, ~8 minutes
    python benchmarks/bench_slowmo_link.py --configs ddp slowmo3 --steps 96
    python benchmarks/bench_slowmo_link.py --loopback --seed 1  # no namespaces, no shaping: losses only
    python benchmarks/bench_slowmo_link.py --from-json out.json # table and plot again from saved results

What it does:

1. Link: two network namespaces (``ddpk<pid>a``, ``ddpk<pid>b``) joined by a veth pair with the addresses
   10.77.0.1/24 and 10.77.0.2/24, each end shaped with ``tc qdisc add dev ... root tbf rate 100mbit burst 64kb
   latency 50ms`` (so each direction carries at most 100 Mbit/s). Nothing outside the two namespaces is touched.
   If ``ip netns add`` is not permitted the script says so and exits with status 2 without doing anything else.
2. Every configuration is a 2-node job, one process per namespace (``ip netns exec``), gloo over the veth
   (``GLOO_SOCKET_IFNAME``), rendezvous at ``tcp://10.77.0.1:29500``, ``torch.set_num_threads(1)`` per process.
   Configurations:

   * ``ddp``: torch DistributedDataParallel (its all-reduce routed through ddpkit's `counting_allreduce_hook`
     so that its bytes are counted);
   * ``postlocalsgd3``: torch's PostLocalSGD: ``post_localSGD_hook`` (the per-node subgroup holds the one
     process of a node) + ``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager(period=3)``;
     ``start_localSGD_iter = warmup_steps = 2``, so the first two steps all-reduce gradients and the parameters
     are then averaged after steps 3, 6, 9, ... exactly like SlowMo's;
   * ``slowmo3``: ddpkit SlowMo, localsgd_frequency=3, slowmo_momentum=0.5, slowmo_frequency=48 (the defaults);
   * ``slowmo12``: ddpkit SlowMo, localsgd_frequency=12, slowmo_momentum=0.7, slowmo_frequency=12 (the paper's
     setting: the slow step comes with every averaging);
   * ``slowmo12_unsharded`` (extra): the same with ``slowmo_memory_efficient=False`` (every rank keeps the whole
     slow buffers; the slow step is an all-reduce plus a local update instead of a reduce + broadcast).

   All train the same ~2.4M-parameter MLP (256 -> 1024 -> 1024 -> 1024 -> 10, ReLU) from the same initial
   weights with SGD (momentum 0.9, lr 0.05 on a cosine schedule down to 5% of it at the last step; the slow step
   uses the current lr) on the same per-rank streams of synthetic classification data (a fixed random teacher
   network labels Gaussian inputs), batch 16 per rank, 240 steps (7680 samples in all).
3. Reported per configuration: samples/s over steps 13..240 (the first 12 are warm-up; the clock is paused
   while the held-out loss is computed, every 24 steps), the held-out cross-entropy after the last step (a
   multiple of every averaging period, so both replicas are equal, which is checked), the mean training loss of
   the last 48 steps, and bytes sent per step and rank: modelled (`ddpkit.distributed.comm_stats`, bandwidth-
   optimal wire model; torch's Python all-reduce in PostLocalSGD counted by a shim) and measured (the veth's
   ``tx_bytes``, including TCP/IP headers and gloo's own messages).
4. Teardown: the namespaces (and with them the veth pair) are deleted in a ``finally`` block that also runs on
   errors, Ctrl-C and SIGTERM; every run has a timeout (``--run-timeout``) after which its processes are killed.

Outputs: a table on stdout, ``--plot`` (default benchmarks/figures/slowmo_link.png: held-out loss against
samples and against wall-clock time) and, with ``--json``, the raw results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WORLD_SIZE = 2
ADDRESSES = ("10.77.0.1", "10.77.0.2")
PORT = 29500
DIM_IN, DIM_HIDDEN, CLASSES = 256, 1024, 10
HELD_OUT = 2048
EVAL_EVERY = 24
WARMUP = 12

CONFIGS: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp", "label": "torch DDP"},
    "postlocalsgd3": {"kind": "postlocalsgd", "period": 3, "label": "torch PostLocalSGD, period 3"},
    "slowmo3": {
        "kind": "slowmo",
        "localsgd_frequency": 3,
        "slowmo_momentum": 0.5,
        "slowmo_frequency": 48,
        "label": "ddpkit SlowMo, freq 3, beta 0.5 (slow step every 48)",
    },
    "slowmo12": {
        "kind": "slowmo",
        "localsgd_frequency": 12,
        "slowmo_momentum": 0.7,
        "slowmo_frequency": 12,
        "label": "ddpkit SlowMo, freq 12, beta 0.7 (slow step every 12)",
    },
    "slowmo12_unsharded": {
        "kind": "slowmo",
        "localsgd_frequency": 12,
        "slowmo_momentum": 0.7,
        "slowmo_frequency": 12,
        "slowmo_memory_efficient": False,
        "label": "same, slowmo_memory_efficient=False",
    },
}


# -- the model and the data ------------------------------------------------------------------------------------------


def make_model(seed: int) -> nn.Module:
    """The student MLP (~2.4M parameters), initialised identically on every rank and for every configuration."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(DIM_IN, DIM_HIDDEN),
        nn.ReLU(),
        nn.Linear(DIM_HIDDEN, DIM_HIDDEN),
        nn.ReLU(),
        nn.Linear(DIM_HIDDEN, DIM_HIDDEN),
        nn.ReLU(),
        nn.Linear(DIM_HIDDEN, CLASSES),
    )


class Teacher:
    """A fixed random two-layer network whose argmax labels Gaussian inputs: a learnable 10-class problem."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(10_000 + seed)
        self.w1 = torch.randn(DIM_IN, 128, generator=g) / DIM_IN**0.5
        self.w2 = torch.randn(128, CLASSES, generator=g) / 128**0.5

    def batch(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, DIM_IN, generator=g)
        return x, (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=1)


# -- the configurations ----------------------------------------------------------------------------------------------


def build(cfg: dict[str, Any], model: nn.Module, lr: float) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The module to call, the optimizer to step and what to do after ``optimizer.step()``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpkit.distributed import counting_allreduce_hook

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    kind = cfg["kind"]
    if kind == "ddp":
        ddp = DDP(model)
        ddp.register_comm_hook(None, counting_allreduce_hook)
        return ddp, sgd(ddp.parameters()), None
    if kind == "postlocalsgd":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        install_allreduce_shim()
        start = 2  # the averager then averages after steps 3, 6, 9, ... (it counts its calls from 0)
        subgroup, _ = dist.new_subgroups(group_size=1)  # a node's processes: here one per node
        ddp = DDP(model)
        ddp.register_comm_hook(PostLocalSGDState(None, subgroup, start_localSGD_iter=start), post_localSGD_hook)
        averager = PeriodicModelAverager(period=cfg["period"], warmup_steps=start)
        return ddp, PostLocalSGDOptimizer(sgd(ddp.parameters()), averager), None
    if kind == "slowmo":
        from ddpkit.nn import SlowMoDistributedDataParallel

        slowmo = SlowMoDistributedDataParallel(
            model,
            nprocs_per_node=1,
            localsgd_frequency=cfg["localsgd_frequency"],
            slowmo_momentum=cfg["slowmo_momentum"],
            slowmo_frequency=cfg["slowmo_frequency"],
            slowmo_memory_efficient=cfg.get("slowmo_memory_efficient", True),
        )
        optimizer = sgd(slowmo.parameters())

        def after_step() -> None:
            slowmo.zero_grad(set_to_none=True)
            slowmo.perform_slowmo(optimizer)

        return slowmo, optimizer, after_step
    raise ValueError(f"unknown configuration kind {kind!r}")


def install_allreduce_shim() -> None:
    """Counts torch.distributed.all_reduce calls (PostLocalSGD's averager and hook) in ddpkit's comm_stats."""
    from ddpkit.distributed import comm_stats
    from ddpkit.distributed.stats import wire_bytes

    original = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        payload = tensor.numel() * tensor.element_size()
        size = dist.get_world_size(group)
        comm_stats.record("all_reduce", f"torch[{size}]", payload, wire_bytes("all_reduce", payload, size))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce


# -- one rank of one configuration -----------------------------------------------------------------------------------


def tx_bytes(ifname: str | None) -> int | None:
    """Bytes sent so far by `ifname` in this network namespace (None on loopback, where both ranks share it)."""
    if not ifname or ifname == "lo":
        return None
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def lr_at(step: int, steps: int, base: float) -> float:
    """Cosine decay from `base` at step 1 to 5% of it at step `steps`."""
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - 1) / max(1, steps - 1))))


@torch.no_grad()
def held_out_loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    model.eval()
    loss = F.cross_entropy(model(data[0]), data[1]).item()
    model.train()
    return loss


def worker(args: argparse.Namespace) -> None:
    """Trains one configuration on this rank and writes its measurements to ``args.result`` as JSON."""
    from ddpkit.distributed import comm_stats

    torch.set_num_threads(1)
    cfg = CONFIGS[args.config]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{PORT}",
        rank=args.rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=args.pg_timeout),
    )
    rank = args.rank
    model = make_model(args.seed)
    teacher = Teacher(args.seed)
    held_out = teacher.batch(HELD_OUT, torch.Generator().manual_seed(999))
    stream = torch.Generator().manual_seed(args.seed * 1000 + rank)
    batches = [teacher.batch(args.batch, stream) for _ in range(args.steps)]  # made before timing
    wrapped, optimizer, after_step = build(cfg, model, args.lr)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")

    losses: list[float] = []
    evals = [(0, 0.0, held_out_loss(model, held_out))]  # (step, clock seconds, held-out loss)
    dist.barrier()
    start = time.perf_counter()
    paused = 0.0
    for step in range(1, args.steps + 1):
        if step == WARMUP + 1:
            dist.barrier()
            t0, paused0, tx0, stats0 = time.perf_counter(), paused, tx_bytes(ifname), comm_stats.snapshot()
        x, y = batches[step - 1]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step()
        losses.append(loss.item())
        if step % EVAL_EVERY == 0 or step == args.steps:
            pause = time.perf_counter()
            evals.append((step, pause - start - paused, held_out_loss(model, held_out)))
            paused += time.perf_counter() - pause
            if rank == 0:
                print(
                    f"  [{args.config}] step {step:4d}/{args.steps}  held-out loss {evals[-1][2]:.4f}  "
                    f"{evals[-1][1]:6.1f} s",
                    flush=True,
                )
    dist.barrier()
    elapsed = time.perf_counter() - t0 - (paused - paused0)
    tx1 = tx_bytes(ifname)
    timed_steps = args.steps - WARMUP
    sent = 0.0
    for key, count in comm_stats.snapshot().items():
        sent += count.sent_bytes - (stats0[key].sent_bytes if key in stats0 else 0.0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.zeros_like(flat) for _ in range(WORLD_SIZE)]
    dist.all_gather(replicas, flat)
    result = {
        "config": args.config,
        "rank": rank,
        "elapsed": elapsed,
        "timed_steps": timed_steps,
        "samples_per_s": WORLD_SIZE * args.batch * timed_steps / elapsed,
        "modelled_bytes_per_step": sent / timed_steps,
        "measured_bytes_per_step": None if tx1 is None or tx0 is None else (tx1 - tx0) / timed_steps,
        "losses": losses,
        "evals": evals,
        "replica_max_diff": max((r - replicas[0]).abs().max().item() for r in replicas),
        "parameters": flat.numel(),
    }
    Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()


# -- the link: two namespaces and a shaped veth pair -----------------------------------------------------------------


class LinkError(RuntimeError):
    pass


def sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise LinkError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")


class SlowLink:
    """Two namespaces joined by a veth pair shaped with tbf on both ends; removed again by `close`."""

    def __init__(self, rate: str, burst: str, latency: str) -> None:
        tag = os.getpid()
        self.namespaces = (f"ddpk{tag}a", f"ddpk{tag}b")
        self.ifnames = (f"dkv{tag}a", f"dkv{tag}b")
        self.rate, self.burst, self.latency = rate, burst, latency
        self.created: list[str] = []

    def open(self) -> None:
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LinkError(f"`{tool}` (iproute2) is not installed")
        try:
            sh("ip", "netns", "add", self.namespaces[0])
        except LinkError as exc:
            raise LinkError(
                f"network namespaces are not permitted here ({exc}); this benchmark needs root with CAP_SYS_ADMIN "
                "and CAP_NET_ADMIN (e.g. a VM, or a container started with --privileged)"
            ) from None
        self.created.append(self.namespaces[0])
        sh("ip", "netns", "add", self.namespaces[1])
        self.created.append(self.namespaces[1])
        sh("ip", "link", "add", self.ifnames[0], "type", "veth", "peer", "name", self.ifnames[1])
        for ns, ifname, address in zip(self.namespaces, self.ifnames, ADDRESSES, strict=True):
            sh("ip", "link", "set", ifname, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", ifname)
            sh("ip", "-n", ns, "link", "set", ifname, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh(
                "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ifname, "root", "tbf",
                "rate", self.rate, "burst", self.burst, "latency", self.latency,
            )  # fmt: skip

    def close(self) -> bool:
        """Deletes what `open` created (the veth pair goes with its namespaces); never raises. False: nothing to do."""
        existed = bool(self.created)
        for ifname in self.ifnames:  # only left in the root namespace if `open` failed before moving it
            if Path(f"/sys/class/net/{ifname}").exists():
                subprocess.run(["ip", "link", "del", ifname], capture_output=True, timeout=30)
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()
        return existed

    def command(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[rank]]


# -- the driver ------------------------------------------------------------------------------------------------------


def run_config(name: str, args: argparse.Namespace, link: SlowLink | None, workdir: str) -> list[dict[str, Any]]:
    """Runs one configuration as a 2-process job; kills both processes if one fails or the timeout passes."""
    procs: list[subprocess.Popen] = []
    results = [os.path.join(workdir, f"{name}.{rank}.json") for rank in range(WORLD_SIZE)]
    try:
        for rank in range(WORLD_SIZE):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=link.ifnames[rank] if link else "lo")
            prefix = link.command(rank) if link else []
            cmd = [
                *prefix, sys.executable, os.path.abspath(__file__), "--worker", "--config", name,
                "--rank", str(rank), "--master", ADDRESSES[0] if link else "127.0.0.1", "--result", results[rank],
                "--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr),
                "--seed", str(args.seed), "--pg-timeout", str(args.pg_timeout),
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        deadline = time.monotonic() + args.run_timeout
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                raise RuntimeError(f"{name}: a rank failed (exit codes {[p.returncode for p in procs]})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: did not finish within {args.run_timeout:.0f} s")
            time.sleep(0.2)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{name}: a rank failed (exit codes {[p.returncode for p in procs]})")
        return [json.loads(Path(r).read_text()) for r in results]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the rank's own session: the process we started
                p.wait(timeout=10)


def summarise(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = ranks[0]
    tail = min(48, len(r0["losses"]))
    train_tail = sum(sum(r["losses"][-tail:]) / tail for r in ranks) / len(ranks)
    measured = [r["measured_bytes_per_step"] for r in ranks]
    return {
        "config": name,
        "label": CONFIGS[name]["label"],
        "samples_per_s": min(r["samples_per_s"] for r in ranks),
        "held_out": r0["evals"][-1][2],
        "train_tail": train_tail,
        "modelled_mb": max(r["modelled_bytes_per_step"] for r in ranks) / 1e6,
        "measured_mb": None if None in measured else max(measured) / 1e6,
        "replica_max_diff": r0["replica_max_diff"],
        "evals": r0["evals"],
        "parameters": r0["parameters"],
    }


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    base = next((r for r in rows if r["config"] == "ddp"), None)
    lines = [
        "| configuration | samples/s | vs DDP | held-out loss | vs DDP | train loss (last 48 steps) "
        "| MB sent/step, modelled | MB sent/step, measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speed = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        loss = f"{100 * (r['held_out'] / base['held_out'] - 1):+.1f}%" if base else "-"
        measured = "-" if r["measured_mb"] is None else f"{r['measured_mb']:.2f}"
        lines.append(
            f"| {r['label']} | {r['samples_per_s']:.1f} | {speed} | {r['held_out']:.4f} | {loss} "
            f"| {r['train_tail']:.4f} | {r['modelled_mb']:.2f} | {measured} |"
        )
    print()
    print("\n".join(lines))
    print(
        f"\n{rows[0]['parameters']:,} parameters, {args.steps} steps x {args.batch} samples x {WORLD_SIZE} ranks "
        f"= {args.steps * args.batch * WORLD_SIZE} samples per configuration; "
        f"max |replica difference| after the last step: {max(r['replica_max_diff'] for r in rows):.1e}"
    )


def plot(rows: list[dict[str, Any]], path: str, args: argparse.Namespace, link: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        steps, clock, loss = zip(*r["evals"], strict=True)
        samples = [s * args.batch * WORLD_SIZE for s in steps]
        style = {"linestyle": "--", "marker": "x"} if "unsharded" in r["config"] else {"marker": "o"}
        ax1.plot(samples, loss, label=r["label"], **style)
        ax2.plot(clock, loss, label=r["label"], **style)
    ax1.set_xlabel("samples (both ranks)")
    ax2.set_xlabel("wall-clock seconds (evaluation excluded)")
    for ax in (ax1, ax2):
        ax.set_ylabel("held-out cross-entropy")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"2 nodes x 1 process, {rows[0]['parameters'] / 1e6:.1f}M-parameter MLP, {link}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=240, help="a multiple of 48 keeps every period whole")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.05, help="base lr of the cosine schedule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--burst", default="64kb")
    parser.add_argument("--latency", default="50ms")
    parser.add_argument("--loopback", action="store_true", help="no namespaces or shaping (checks losses only)")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument("--pg-timeout", type=float, default=300.0, help="seconds per collective")
    parser.add_argument("--plot", default="benchmarks/figures/slowmo_link.png")
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--from-json", default=None, help="print the table and plot from saved results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        for key in ("steps", "batch", "rate", "loopback"):
            setattr(args, key, saved["args"][key])
        report(saved["rows"], args)
        return 0

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks below

    signal.signal(signal.SIGTERM, on_sigterm)
    link = None
    if not args.loopback:
        if os.geteuid() != 0:
            print("bench_slowmo_link: needs root to create network namespaces (or use --loopback)", file=sys.stderr)
            return 2
        link = SlowLink(args.rate, args.burst, args.latency)
    workdir = tempfile.mkdtemp(prefix="ddpkit-slowmo-link-")
    rows = []
    try:
        if link is not None:
            try:
                link.open()
            except LinkError as exc:
                print(f"bench_slowmo_link: cannot set up the slow link: {exc}", file=sys.stderr)
                return 2
            print(
                f"link: {link.namespaces[0]} ({ADDRESSES[0]}) <-> {link.namespaces[1]} ({ADDRESSES[1]}), "
                f"tbf rate {args.rate} burst {args.burst} latency {args.latency} on both ends",
                flush=True,
            )
        for name in args.configs:
            print(f"== {name}: {CONFIGS[name]['label']}", flush=True)
            began = time.monotonic()
            rows.append(summarise(name, run_config(name, args, link, workdir)))
            print(
                f"   {rows[-1]['samples_per_s']:.1f} samples/s, held-out loss {rows[-1]['held_out']:.4f} "
                f"({time.monotonic() - began:.0f} s)",
                flush=True,
            )
    except (RuntimeError, TimeoutError, OSError, json.JSONDecodeError) as exc:
        print(f"bench_slowmo_link: {exc}; stopped (its processes were killed)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_slowmo_link: interrupted; stopping", file=sys.stderr)
        return 130
    finally:
        if link is not None and link.close():
            print("link removed", flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    report(rows, args)
    return 0


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print_table(rows, args)
    if args.plot:
        plot(rows, args.plot, args, "loopback, no shaping" if args.loopback else f"veth shaped to {args.rate}")


if __name__ == "__main__":
    sys.exit(main())
