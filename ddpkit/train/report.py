"""The end-of-run summary: a table, a cross-rank check that the replicas are equal, metrics files and a plot."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import resource
from typing import Any

import torch
from torch import nn

from ddpkit.distributed import comm
from ddpkit.distributed.env import group_size


def parameter_digest(module: nn.Module) -> int:
    """A 63-bit digest (SHA-256) of every parameter's bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "big") >> 1


def peak_memory_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def gather_per_rank(value: float) -> list[float]:
    """`value` from every rank, in rank order (one small all-gather)."""
    world = group_size()
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    comm.all_gather(out, torch.tensor([float(value)], dtype=torch.float64))
    return [t.item() for t in out]


def gather_digests(module: nn.Module) -> list[int]:
    world = group_size()
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    comm.all_gather(out, torch.tensor([parameter_digest(module)], dtype=torch.int64))
    return [int(t.item()) for t in out]


def format_summary(summary: dict[str, Any]) -> str:
    """The table printed at the end of `ddpkit train`."""
    memory = ", ".join(f"{m:.0f}" for m in summary["peak_memory_mb"])
    rows = [
        ("strategy", f"{summary['strategy']} on {summary['world_size']} process(es), {summary['backend']}"),
        ("test accuracy", f"{summary['test_accuracy']:.4f}"),
        ("final train loss", f"{summary['train_loss']:.4f}"),
        ("wall time", f"{summary['wall_seconds']:.1f} s"),
        ("samples/s", f"{summary['samples_per_second']:.0f}"),
        ("sent per step", f"{summary['sent_bytes_per_step'] / 1e6:.4f} MB (mean over ranks, modelled wire bytes)"),
        ("sent in total", f"{summary['sent_bytes_total'] / 1e6:.2f} MB (all ranks)"),
        (
            "shared memory",
            f"{summary.get('shared_memory_bytes_per_step', 0.0) / 1e6:.4f} MB per step (mean over ranks, "
            "same host: not on the wire)",
        ),
        ("peak memory", f"{memory} MB per rank"),
        ("replicas equal", "yes" if summary["replicas_equal"] else "NO: parameters differ between ranks"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_metrics(out: str, summary: dict[str, Any], history: list[dict[str, Any]], steps: list[dict]) -> list[str]:
    """metrics.json (summary + per-epoch history), steps.csv (per step, rank 0) and metrics.png; returns paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in ("metrics.json", "steps.csv", "metrics.png")]
    with open(paths[0], "w") as f:
        json.dump({"summary": summary, "epochs": history}, f, indent=2)
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(steps[0]) if steps else ["step"])
        writer.writeheader()
        writer.writerows(steps)
    plot_metrics(paths[2], history, steps, summary)
    return paths


def plot_metrics(
    path: str, history: list[dict[str, Any]], steps: list[dict], summary: dict[str, Any] | None = None
) -> None:
    """metrics.png: smoothed training loss with epoch ticks, held-out accuracy (or bits per byte) per epoch and
    bytes sent per step, titled with the run's settings (`ddpkit.train.plots.plot_run`)."""
    from ddpkit.train.plots import plot_run

    plot_run(path, summary or {}, history, steps)
