"""One training job of the memory benchmark, run as its own command so that a memory cgroup holds it whole.

``python -m benchmarks.lib.memory_job '<json spec>'`` spawns the spec's ranks (fresh gloo CPU processes, one thread
each), each builds the workload's model and the strategy (the sharding benchmark's builders: the code users run),
trains `steps` steps and reports its own figures; the command prints them as one JSON line. The spec: strategy,
world_size, workload ("mlp" with `depth` layers of `width`, or "gpt" with `layers` and `width`), steps, batch, seed,
and `allocator` ("default": glibc as it comes; "mmap": `ddpkit.distributed.allocator.return_freed_memory`;
"mapped": what ``ddpkit train --allocator mapped`` does, huge pages in the ranks' environment and blocks of 8 MiB or
more mapped alone); with
`memray` (a folder) each rank records its allocations there (`benchmarks.profile_memory`). With
`host` (index, per_host, init, ifname) the command is one host of a job on namespace hosts: it runs that host's
ranks, which join the job's process group at `init` (bench_memory's ``--hosts``).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.lib import memory, workloads
from ddpkit.distributed.allocator import huge_pages_environment, map_large_blocks, return_freed_memory
from ddpkit.measure.timing import optimizer_state_bytes
from ddpkit.testing import run_distributed


def build_workload(spec: dict[str, Any]) -> workloads.Workload:
    """The spec's model: an MLP of `depth` square layers of `width`, or the byte GPT of `layers` x `width`."""
    if spec["workload"] == "mlp":
        return workloads.Regression((spec["width"],) * (spec["depth"] + 1))
    heads = max(1, spec["width"] // 64)
    return workloads.GPTText(spec["layers"], spec["width"], heads, spec.get("context", 128))


def _tracked(spec: dict[str, Any], rank: int) -> Any:
    """With ``spec["memray"]`` (a folder), memray records this rank's allocations from the model's creation to the
    last step into ``rank<r>.bin`` there (`benchmarks.profile_memory` reads them); otherwise nothing. torch's
    modules that a first optimizer imports are imported before, so that their memory is not charged to a strategy."""
    if not spec.get("memray"):
        return contextlib.nullcontext()
    import memray

    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # the first optimizer imports torch._dynamo: not charged

    return memray.Tracker(os.path.join(spec["memray"], f"rank{rank}.bin"), native_traces=False)


def rank_main(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.bench_sharding import STRATEGIES, _step  # (its builders; imported in the rank)
    from ddpkit.measure.timing import PhaseTimer

    torch.set_num_threads(1)
    if spec.get("allocator") == "mmap":  # freed large blocks go back to the system (ddpkit.distributed.allocator)
        return_freed_memory()
    if spec.get("allocator") == "mapped":  # (the ranks started with huge pages: main)
        map_large_blocks()
    work = build_workload(spec)
    batches = work.batches(spec["seed"], rank, spec["steps"], spec["batch"])
    dist.barrier()
    start = memory.rss_mb()  # the process before the model exists: imports, data, the process group
    with _tracked(spec, rank):
        model = work.model(spec["seed"])
        parameters = sum(p.numel() for p in model.parameters())  # (before a wrapper may shard them)
        setup = STRATEGIES[spec["strategy"]][1](model)
        timer = PhaseTimer()
        for batch in batches:
            _step(setup, work, batch, timer)
        dist.barrier()
    return {
        "start_rss_mb": start,
        "peak_rss_mb": memory.peak_rss_mb(),
        "own_peak_mb": memory.peak_rss_mb() - start,
        "state_bytes": optimizer_state_bytes(setup.local_optimizer),
        "parameters": parameters,
    }


def _host_rank(local: int, spec: dict[str, Any], queue: Any) -> None:
    """One rank of a job on namespace hosts: joins the job's process group over the host's interface, then
    `rank_main`."""
    host = spec["host"]
    os.environ["GLOO_SOCKET_IFNAME"] = host["ifname"]
    rank = host["index"] * host["per_host"] + local
    dist.init_process_group(
        "gloo", init_method=host["init"], rank=rank, world_size=spec["world_size"], timeout=timedelta(seconds=300)
    )
    try:
        queue.put((local, rank_main(rank, spec["world_size"], spec)))
    finally:
        dist.destroy_process_group()


def _on_this_host(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """This host's ranks of a job across namespace hosts (``spec["host"]``: index, per_host, init, ifname)."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_host_rank, args=(local, spec, queue)) for local in range(spec["host"]["per_host"])]
    for proc in procs:
        proc.start()
    reports = dict(queue.get(timeout=spec.get("timeout", 900.0)) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return [reports[local] for local in sorted(reports)]


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    if spec.get("allocator") == "mapped":  # the ranks start with this environment, as `ddpkit train`'s do
        os.environ.update(huge_pages_environment(os.environ))
    if "host" in spec:
        ranks = _on_this_host(spec)
    else:
        ranks = run_distributed(
            rank_main, spec["world_size"], spec, fresh=True, timeout=spec.get("timeout", 900.0), pg_timeout=300
        )
    print(json.dumps({"ranks": ranks}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
