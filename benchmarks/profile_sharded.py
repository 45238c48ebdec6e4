"""Where ShardedDataParallel's and OSS's step time goes on the byte GPT, next to torch DDP in the same job.

``python -m benchmarks.profile_sharded [--world 2] [--rounds 3] [--steps 5] [--out FILE.json]``

Not a registered benchmark (no ``QUESTION``): a profiler for the developer. Two ranks (one thread each) train
`ddpkit.train.workloads.gpt` (4 layers, width 256, 4 heads: 3.3M parameters) on random bytes with Adam under these
strategies, interleaved round after round so a busy spell of the machine hits all of them alike:

* ``ddp``: torch DDP; ``oss``: torch DDP + OSS; ``sharded``: ShardedDataParallel + OSS;
* ``oss-socket`` and ``sharded-socket``: the same with ``DDPKIT_SHARED_MEMORY=0`` (gloo sockets on loopback,
  the path used across hosts).

The library is instrumented from here, by wrapping its methods (nothing in ddpkit changes): forward, backward and
step wall time; inside backward ShardedDataParallel's gradient hooks (count and time: Python time per tensor),
the copies into bucket messages (`flatten`), the start of each reduce, and at the end of backward the wait for
every reduce and the owners' unpacking; the shared-memory path's mailbox posts (copy + 1-byte signal), the
owner's adds and acknowledgements; OSS's local optimizer step, its parameter broadcast and that broadcast's
barriers. Per bucket (last timed step, each rank): its size, owner, when it was launched and how long its
wait took. Times are per step, medians over rounds of the per-round mean; the report gives the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

STRATEGIES = ("ddp", "oss", "sharded", "oss-socket", "sharded-socket")


class Clock:
    """Accumulated seconds and calls per label, labels prefixed by the phase the step is in."""

    def __init__(self) -> None:
        self.phase = "idle"
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.buckets: list[dict[str, Any]] = []
        self.backward_start = 0.0

    def add(self, label: str, seconds: float) -> None:
        key = f"{self.phase}:{label}"
        self.seconds[key] += seconds
        self.calls[key] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.buckets = []


CLOCK = Clock()


def _wrap(owner: Any, name: str, label: str, after: Callable[..., None] | None = None) -> None:
    """Replaces ``owner.name`` by a version that adds its wall time to `label` (and calls `after` with its
    arguments, start and duration)."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            CLOCK.add(label, took)
            if after is not None:
                after(args, start, took)

    setattr(owner, name, timed)


def _note_launch(args: tuple, start: float, took: float) -> None:
    bucket = args[0]
    CLOCK.buckets.append(
        {
            "key": bucket.key,
            "owner": bucket.owner,
            "numel": bucket.numel,
            "params": len(bucket.params),
            "launch_ms": (start - CLOCK.backward_start) * 1e3,
            "launch_cost_ms": took * 1e3,
        }
    )


def _note_finish(args: tuple, start: float, took: float) -> None:
    bucket = args[0]
    for row in CLOCK.buckets:
        if row["key"] == bucket.key and "finish_ms" not in row:
            row["finish_ms"] = took * 1e3
            row["finish_at_ms"] = (start - CLOCK.backward_start) * 1e3
            break


def instrument() -> None:
    """Wraps the library's per-step work with timers (once per process)."""
    from ddpkit.distributed import comm, grad_buckets, mailboxes
    from ddpkit.nn import sharded_ddp
    from ddpkit.optim import oss, param_messages

    _wrap(sharded_ddp.ShardedDataParallel, "_on_grad_ready", "sdp.grad_hook")
    _wrap(sharded_ddp.ShardedDataParallel, "_finish_backward", "sdp.finish_backward")
    _wrap(grad_buckets.GradBucket, "launch", "bucket.launch", _note_launch)
    _wrap(grad_buckets.GradBucket, "finish", "bucket.finish", _note_finish)
    _wrap(grad_buckets, "flatten", "bucket.copy_in")
    _wrap(comm, "reduce", "comm.reduce_start")
    _wrap(comm, "wait_all", "comm.wait_all")
    _wrap(comm, "barrier", "comm.barrier")
    _wrap(comm, "broadcast", "comm.broadcast_start")
    _wrap(mailboxes.MailboxReduce, "reduce", "mailbox.reduce_start")
    _wrap(mailboxes.MailboxReduce, "_post", "mailbox.post_copy_signal")
    _wrap(mailboxes.MailboxReduce, "add_and_acknowledge", "mailbox.add_ack")
    _wrap(mailboxes._Posted, "wait", "mailbox.sender_wait_ack")
    _wrap(mailboxes._Collected, "wait", "mailbox.owner_wait_add")
    _wrap(oss.OSS, "_broadcast_params", "oss.broadcast")
    _wrap(param_messages.ParamMessage, "unpack", "oss.unpack")
    _wrap(param_messages.ParamMessage, "stage", "oss.stage")


def _build(strategy: str, module: Any) -> tuple[Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from ddpkit.nn import ShardedDataParallel
    from ddpkit.optim import OSS

    os.environ["DDPKIT_SHARED_MEMORY"] = "0" if strategy.endswith("-socket") else "1"
    kind = strategy.removesuffix("-socket")
    if kind == "ddp":
        return DistributedDataParallel(module), torch.optim.Adam(module.parameters(), lr=1e-4)
    if kind == "oss":
        return DistributedDataParallel(module), OSS(module.parameters(), optim=torch.optim.Adam, lr=1e-4)
    optimizer = OSS(module.parameters(), optim=torch.optim.Adam, lr=1e-4)
    return ShardedDataParallel(module, optimizer), optimizer


def _time_strategy(strategy: str, cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from ddpkit.train.workloads.gpt import GPTConfig, gpt

    torch.manual_seed(0)
    module = gpt(GPTConfig(layers=cfg["layers"], width=cfg["width"], heads=cfg["heads"], context=cfg["context"]))
    model, optimizer = _build(strategy, module)
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, 256, (cfg["batch"], cfg["context"] + 1), generator=generator)
    x, y = batch[:, :-1], batch[:, 1:]
    walls: defaultdict[str, float] = defaultdict(float)
    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"]:
            CLOCK.reset()
            walls.clear()
        CLOCK.buckets = []
        marks = [time.perf_counter()]
        CLOCK.phase = "forward"
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        marks.append(time.perf_counter())
        CLOCK.phase = "backward"
        CLOCK.backward_start = marks[-1]
        loss.backward()
        marks.append(time.perf_counter())
        CLOCK.phase = "step"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        CLOCK.phase = "idle"
        for name, a, b in zip(("forward", "backward", "step"), marks, marks[1:], strict=False):
            walls[name] += b - a
        walls["total"] += marks[-1] - marks[0]
    n = cfg["steps"]
    per_step = {f"wall:{k}": v / n * 1e3 for k, v in walls.items()}
    per_step.update({k: v / n * 1e3 for k, v in CLOCK.seconds.items()})
    calls = {k: v / n for k, v in CLOCK.calls.items()}
    return {"strategy": strategy, "ms": per_step, "calls": calls, "buckets": list(CLOCK.buckets)}


def run_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Every round, every strategy, on this rank; returns one record per (round, strategy)."""
    import torch

    torch.set_num_threads(1)
    instrument()
    records = []
    for round_index in range(cfg["rounds"]):
        for strategy in cfg["strategies"]:
            record = _time_strategy(strategy, cfg, rank)
            record["round"] = round_index
            records.append(record)
    return records


def summarise(per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per strategy and label: the median over rounds of the slower rank's ms per step; ratios of totals to DDP."""
    table: dict[str, dict[str, float]] = {}
    calls: dict[str, dict[str, float]] = {}
    strategies = sorted({r["strategy"] for r in per_rank[0]}, key=STRATEGIES.index)
    for strategy in strategies:
        rounds = [[r for r in records if r["strategy"] == strategy] for records in per_rank]
        labels = sorted({k for records in rounds for r in records for k in r["ms"]})
        table[strategy] = {
            label: statistics.median(
                max(records[i]["ms"].get(label, 0.0) for records in rounds) for i in range(len(rounds[0]))
            )
            for label in labels
        }
        calls[strategy] = dict(rounds[0][-1]["calls"])
    ddp = table.get("ddp", {}).get("wall:total")
    ratios = {s: t["wall:total"] / ddp for s, t in table.items()} if ddp else {}
    last_buckets = {
        s: [next(r for r in reversed(records) if r["strategy"] == s)["buckets"] for records in per_rank]
        for s in strategies
        if s.startswith("sharded")
    }
    return {"ms_per_step": table, "calls_per_step": calls, "ratio_to_ddp": ratios, "buckets": last_buckets}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_sharded", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every strategy")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    parser.add_argument("--context", type=int, default=128, help="bytes per window")
    parser.add_argument("--layers", type=int, default=4, help="GPT blocks (6 for the benchmarks' 10.8M GPT)")
    parser.add_argument("--width", type=int, default=256, help="GPT width (384 for the 10.8M GPT)")
    parser.add_argument("--heads", type=int, default=4, help="GPT heads (6 for the 10.8M GPT)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    return parser


def main(argv: list[str] | None = None) -> None:
    from ddpkit.testing.spawn import run_distributed

    args = build_parser().parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            raise SystemExit(f"--strategies: unknown {s!r}; choose from {', '.join(STRATEGIES)}")
    cfg = {**vars(args), "strategies": strategies}
    load_before = os.getloadavg()
    per_rank = run_distributed(run_rank, args.world, cfg, timeout=3600.0, fresh=True, pg_timeout=300.0)
    report = summarise(per_rank)
    report["load_average"] = {"before": load_before, "after": os.getloadavg()}
    report["config"] = cfg
    for strategy, row in report["ms_per_step"].items():
        ratio = report["ratio_to_ddp"].get(strategy, float("nan"))
        print(f"== {strategy}: {row['wall:total']:.1f} ms/step ({ratio:.2f}x ddp)")
        for label, ms in sorted(row.items(), key=lambda kv: -kv[1]):
            if ms >= 0.05:
                print(f"   {label:<42} {ms:9.2f} ms  {report['calls_per_step'][strategy].get(label, 0):6.1f} calls")
    print(f"load average before {load_before}, after {report['load_average']['after']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
