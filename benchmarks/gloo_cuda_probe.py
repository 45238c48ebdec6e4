"""Which of gloo's collectives accept CUDA tensors in this torch: ``python -m benchmarks.gloo_cuda_probe OUT.json``
(``--cpu`` runs the same on CPU tensors, to check the probe itself).

Each collective runs in its own 2-rank gloo job on ``cuda:0`` (a failing one can leave a group unusable), all jobs
at once, each within 2 minutes (most of it starting the processes); the result per collective is "ok", "WRONG
VALUE" or the error. ddpkit does not depend on the answer: it stages CUDA tensors through host memory itself for
every gloo collective (`ddpkit.distributed.comm`). The answer says what gloo alone would do.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ddpkit.testing import rank_device, run_distributed


def _full(value: float, device: torch.device, n: int = 4) -> torch.Tensor:
    return torch.full((n,), float(value), device=device)


def _values(tensors: list[torch.Tensor]) -> list[float]:
    return [t[0].item() for t in tensors]


def _p2p(rank: int, dev: torch.device, blocking: bool) -> bool:
    x = _full(rank + 3, dev)
    if rank == 0:
        dist.send(x, 1) if blocking else dist.isend(x, 1).wait()
        return True
    dist.recv(x, 0) if blocking else dist.irecv(x, 0).wait()
    return x.tolist() == [3.0] * 4


def _cases(rank: int, n: int, dev: torch.device) -> dict[str, Callable[[], bool]]:
    total = float(n * (n + 1) // 2)
    return {
        "all_reduce": lambda: (dist.all_reduce(x := _full(rank + 1, dev)), x.tolist() == [total] * 4)[1],
        "broadcast": lambda: (dist.broadcast(x := _full(rank + 7, dev), 1), x.tolist() == [8.0] * 4)[1],
        "reduce": lambda: (dist.reduce(x := _full(rank + 1, dev), 0), rank != 0 or x.tolist() == [total] * 4)[1],
        "all_gather": lambda: (
            dist.all_gather(out := [_full(0, dev) for _ in range(n)], _full(rank, dev)),
            _values(out) == list(map(float, range(n))),
        )[1],
        "all_gather_into_tensor": lambda: (
            dist.all_gather_into_tensor(out := torch.zeros(4 * n, device=dev), _full(rank, dev)),
            out.view(n, 4)[:, 0].tolist() == list(map(float, range(n))),
        )[1],
        "reduce_scatter": lambda: (
            dist.reduce_scatter(out := _full(0, dev), [_full(r + 1, dev) for r in range(n)]),
            out.tolist() == [float(n * (rank + 1))] * 4,
        )[1],
        "reduce_scatter_tensor": lambda: (
            dist.reduce_scatter_tensor(out := _full(0, dev), torch.ones(4 * n, device=dev)),
            out.tolist() == [float(n)] * 4,
        )[1],
        "gather": lambda: (
            dist.gather(_full(rank, dev), out := [_full(0, dev) for _ in range(n)] if rank == 0 else None, dst=0),
            rank != 0 or _values(out) == list(map(float, range(n))),
        )[1],
        "all_to_all": lambda: (
            dist.all_to_all(out := [_full(0, dev) for _ in range(n)], [_full(rank * 10 + r, dev) for r in range(n)]),
            _values(out) == [float(r * 10 + rank) for r in range(n)],
        )[1],
        "send/recv": lambda: _p2p(rank, dev, blocking=True),
        "isend/irecv": lambda: _p2p(rank, dev, blocking=False),
        "barrier": lambda: (dist.barrier(), True)[1],
    }


def _one(rank: int, world: int, name: str) -> str:
    dev = rank_device()
    try:
        ok = _cases(rank, world, dev)[name]()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return "ok" if ok else "WRONG VALUE"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"


def _job(name: str, device: str) -> str:
    try:
        answers = run_distributed(_one, 2, name, device=device, fresh=True, timeout=120, pg_timeout=30)
    except Exception as exc:  # a crash or a hang of the job itself
        return f"job failed: {type(exc).__name__}: {str(exc).strip()[:200]}"
    return answers[0] if len(set(answers)) == 1 else " | ".join(f"rank {r}: {a}" for r, a in enumerate(answers))


def main(out: str, device: str) -> None:
    names = list(_cases(0, 2, torch.device("cpu")))
    with ThreadPoolExecutor(len(names)) as pool:
        answers = dict(zip(names, pool.map(_job, names, [device] * len(names)), strict=True))
    report = {"torch": torch.__version__, "cuda": torch.version.cuda, f"gloo_{device}_2_ranks": answers}
    print(json.dumps(report, indent=1))
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    from benchmarks import gloo_cuda_probe  # the ranks unpickle functions by module name, which __main__ is not

    args = [a for a in sys.argv[1:] if a != "--cpu"]
    gloo_cuda_probe.main(args[0] if args else "gloo_cuda.json", "cpu" if "--cpu" in sys.argv else "cuda")
