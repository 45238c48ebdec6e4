"""Where a strategy's memory is at its peak, by the code that allocated it: memray inside each rank of a memory job.

``python -m benchmarks.profile_memory [--strategies ddp,oss_sdp] [--world-size 2] [--hosts 1] [--allocator default]
[--depth 12] [--width 2048] [--steps 3] [--out DIR]``

Not a registered benchmark (no ``QUESTION``): a profiler for the developer. Each strategy runs the memory
benchmark's job (`benchmarks.lib.memory_job`: the same model, data and strategy builders as ``python -m benchmarks
memory``) with memray recording every allocation of each rank from the model's creation to its last step. At the
rank's high-water mark, the bytes still held are grouped by the innermost frame in ddpkit, the benchmark or
torch's optimizers and modules (else the innermost frame) and printed in units of P (the model's fp32 bytes), so
that what holds each P above a strategy's limit is named. memray's own flame graph of a rank's peak:
``memray flamegraph DIR/<strategy>/rank0.bin``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from typing import Any

OURS = ("/ddpkit/", "/benchmarks/", "/torch/optim/", "/torch/nn/modules/", "/torch/autograd/")


def where(stack: list[tuple[str, str, int]]) -> str:
    """The frame an allocation is charged to: the innermost one in `OURS`, else the innermost one."""
    for function, filename, line in stack:
        if any(part in filename for part in OURS):
            tail = filename.split("/site-packages/")[-1].split("/main/")[-1]
            return f"{tail}:{line} {function}"
    if not stack:
        return "(no Python frame: the interpreter or a C++ thread)"
    function, filename, line = stack[0]
    return f"{os.path.basename(filename)}:{line} {function}"


def peak_by_site(path: str) -> tuple[int, dict[str, int]]:
    """The rank's high-water mark (bytes held) and those bytes by allocation site (`where`)."""
    import memray

    reader = memray.FileReader(path)
    sites: defaultdict[str, int] = defaultdict(int)
    for record in reader.get_high_watermark_allocation_records(merge_threads=True):
        sites[where(record.stack_trace())] += record.size
    return reader.metadata.peak_memory, dict(sites)


def profile(strategy: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs one memory job with memray in its ranks; returns each rank's peak and sites in units of P."""
    folder = os.path.join(args.out, strategy)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    spec = {
        "strategy": strategy,
        "world_size": args.world_size,
        "workload": "mlp",
        "depth": args.depth,
        "width": args.width,
        "steps": args.steps,
        "batch": args.batch,
        "seed": 0,
        "timeout": 900.0,
        "allocator": args.allocator,
        "memray": folder,
        "hosts": args.hosts,
    }
    if args.hosts == 1:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.lib.memory_job", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{strategy}: the memory job failed: {done.stderr[-800:]}")
        ranks = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])["ranks"]
    else:  # the memory benchmark's namespace hosts (as root)
        from benchmarks.bench_memory import _job

        outcome, reports = _job(spec)
        if reports is None:
            raise RuntimeError(f"{strategy}: the memory job failed: {outcome.stderr[-800:]}")
        ranks = reports["ranks"]
    p_bytes = 4 * ranks[0]["parameters"]
    result: dict[str, Any] = {"strategy": strategy, "p_mb": p_bytes / 2**20, "ranks": []}
    for rank in range(args.world_size):
        peak, sites = peak_by_site(os.path.join(folder, f"rank{rank}.bin"))
        top = sorted(sites.items(), key=lambda item: -item[1])[: args.top]
        result["ranks"].append({"peak_p": peak / p_bytes, "sites_p": {site: size / p_bytes for site, size in top}})
    return result


def show(result: dict[str, Any]) -> None:
    print(f"\n{result['strategy']}: P = {result['p_mb']:.0f} MiB")
    for rank, report in enumerate(result["ranks"]):
        print(f"  rank {rank}: {report['peak_p']:.2f} P held at its peak (allocations since the model's creation)")
        for site, p in report["sites_p"].items():
            print(f"    {p:5.2f} P  {site}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,oss_sdp", help="keys of benchmarks.bench_sharding.STRATEGIES")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--depth", type=int, default=12, help="the MLP's square layers")
    parser.add_argument("--width", type=int, default=2048, help="their width")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hosts", type=int, default=1, help="network-namespace hosts the ranks are spread over (root)")
    parser.add_argument("--allocator", default="default", help="the memory job's allocator: default, mmap, mapped")
    parser.add_argument("--top", type=int, default=8, help="sites shown per rank")
    parser.add_argument("--out", default="benchmarks/scratch/memray", help="folder for the ranks' memray files")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = [profile(strategy, args) for strategy in args.strategies.split(",")]
    for result in results:
        show(result)
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump({"settings": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
