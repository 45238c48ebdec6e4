"""The host staging that carries CUDA tensors over gloo, exercised on CPU tensors (`comm._STAGE_CPU_TENSORS`).

On a GPU the same path runs with CUDA tensors (tests/cuda); here every collective is staged through host copies
anyway, so its results and its `cpu_staging` counts are checked without a GPU: exactly the copies a rank needs.
"""

import pytest
import torch

from ddpkit.distributed import comm, comm_stats
from ddpkit.testing import run_distributed


def _staging(rank, world):
    comm._STAGE_CPU_TENSORS = True
    try:
        return _collectives_through_host_copies(rank, world)
    finally:
        comm._STAGE_CPU_TENSORS = False


def _collectives_through_host_copies(rank, world):
    comm_stats.reset()
    copies, out = {}, {}

    def staged(name):
        copies[name] = comm_stats.payload_bytes("cpu_staging") - sum(copies.values())

    t = torch.full((10,), float(rank + 1))  # 40 bytes
    comm.all_reduce(t)
    out["all_reduce"] = torch.equal(t, torch.full((10,), float(sum(range(1, world + 1)))))
    staged("all_reduce")
    b = torch.arange(12, dtype=torch.float64).view(3, 4).t() * (rank == 1)  # 96 bytes, not contiguous
    comm.broadcast(b, src=1)
    out["broadcast"] = torch.equal(b, torch.arange(12, dtype=torch.float64).view(3, 4).t())
    staged("broadcast")
    r = torch.full((4,), float(rank + 1), dtype=torch.float16)  # 8 bytes
    work = comm.reduce(r, dst=world - 1, async_op=True)
    work.wait()
    out["reduce"] = rank != world - 1 or torch.equal(r, torch.full((4,), world * (world + 1) / 2, dtype=torch.float16))
    out["reduce leaves senders alone"] = rank == world - 1 or torch.equal(r, torch.full((4,), float(rank + 1)).half())
    staged("reduce")
    gathered = [torch.zeros(3) for _ in range(world)]  # 12 bytes each
    comm.all_gather(gathered, torch.full((3,), float(rank)))
    out["all_gather"] = [g[0].item() for g in gathered] == list(range(world))
    staged("all_gather")
    mine = torch.zeros(2)  # 8 bytes
    comm.reduce_scatter(mine, [torch.full((2,), float(r + rank)) for r in range(world)])
    out["reduce_scatter"] = torch.equal(mine, torch.full((2,), float(world * rank + world * (world - 1) / 2)))
    staged("reduce_scatter")
    outputs = [torch.zeros(1) for _ in range(world)] if rank == 0 else None  # 4 bytes each
    comm.gather(torch.full((1,), float(rank)), outputs, dst=0, is_root=rank == 0)
    out["gather"] = outputs is None or [o.item() for o in outputs] == list(range(world))
    staged("gather")
    hooked = torch.ones(10)  # what a DDP communication hook does with the handle: get_future()
    future = comm.all_reduce(hooked, async_op=True).get_future()
    out["get_future"] = future.wait()[0] is hooked and torch.equal(hooked, torch.full((10,), float(world)))
    staged("get_future")
    out["wire bytes of staging"] = comm_stats.sent_bytes("cpu_staging")
    return out, copies


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_through_host_copies_give_the_same_results(world):
    n = world
    for rank, (out, copies) in enumerate(run_distributed(_staging, world)):
        assert all(v is True for k, v in out.items() if k != "wire bytes of staging"), (rank, out)
        assert out["wire bytes of staging"] == 0.0
        root = rank == n - 1
        expected = {
            "all_reduce": 80,  # out and back
            "broadcast": 96,  # the source copies out, the others copy in
            "reduce": 16 if root else 8,  # senders copy out; the root copies out and back
            "all_gather": 12 + 12 * n,
            "reduce_scatter": 8 * n + 8,
            "gather": 4 + (4 * n if rank == 0 else 0),
            "get_future": 80,
        }
        assert copies == expected, (rank, copies)


def _hook_future_is_asynchronous(rank, world):
    import time

    comm._STAGE_CPU_TENSORS = True
    try:
        hooked = torch.full((10,), float(rank + 1))
        if rank == 1:
            time.sleep(3.0)  # the peer's bucket is late: the hook must not wait for it
        start = time.monotonic()
        future = comm.all_reduce(hooked, async_op=True).get_future()
        returned, done_at_return = time.monotonic() - start, future.done()
        value = future.wait()[0]
        return returned, done_at_return, value is hooked and torch.equal(hooked, torch.full((10,), 3.0))
    finally:
        comm._STAGE_CPU_TENSORS = False


def test_a_staged_hook_returns_before_the_bucket_has_travelled():
    """What a DDP communication hook gets on gloo with CUDA tensors: a future that completes later, so backward
    overlaps the transfer (it used to wait for the transfer and the copy back first)."""
    (returned, done, right), _ = run_distributed(_hook_future_is_asynchronous, 2)
    assert right and not done and returned < 2.0, (returned, done, right)
