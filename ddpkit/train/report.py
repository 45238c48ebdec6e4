"""The end-of-run summary: a table, a cross-rank check that the replicas are equal, metrics files and a plot."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import resource
import socket
from typing import Any

import torch
from torch import nn

import ddpkit
from ddpkit.distributed import comm
from ddpkit.distributed.env import group_size
from ddpkit.distributed.objects import gather_objects
from ddpkit.train.config import SLOW_LINK_FLAGS, TrainConfig
from ddpkit.train.strategies import optimizer_arguments, slowmo_node_size


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


def run_settings(cfg: TrainConfig, world_size: int, backend: str) -> dict[str, Any]:
    """What the run was: the resolved settings, where it ran (each rank's host: a collective) and the versions."""
    hosts = gather_objects(socket.gethostname(), dst=-1)
    settings: dict[str, Any] = {
        "strategy": cfg.strategy,
        "optimizer": cfg.optimizer,
        "optimizer_arguments": optimizer_arguments(cfg),
        "lr": cfg.learning_rate,
        "batch_size_per_process": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "samples_per_step": cfg.batch_size * cfg.grad_accum * world_size,
        "amp": cfg.amp,
        "adascale": cfg.adascale,
        "slowmo": None,
        "model": cfg.model,
        "model_size": f"{cfg.depth} hidden layers of {cfg.hidden}" if cfg.model == "mlp" else "default",
        "data": cfg.data,
        "epochs": cfg.epochs,
        "seed": cfg.seed,
        "world_size": world_size,
        "backend": backend,
        "hosts": hosts,
        "torch_version": torch.__version__,
        "ddpkit_version": ddpkit.__version__,
    }
    if cfg.strategy == "slowmo":
        names = ("slowmo_momentum", "slowmo_lr", "slowmo_frequency", "localsgd_frequency", "slowmo_base")
        names += ("slowmo_nesterov", *SLOW_LINK_FLAGS)
        if cfg.slowmo_base == "sgp":
            names += ("graph", "peers_per_itr", "push_sum", "overlap", "synch_freq", "slowmo_sgp_average_params")
        settings["slowmo"] = {name: getattr(cfg, name) for name in names} | {"nprocs_per_node": slowmo_node_size(cfg)}
    settings["config"] = dataclasses.asdict(cfg) | {"lr": cfg.learning_rate, "weight_decay": cfg.resolved_weight_decay}
    return settings


def last_epoch_train_loss(history: list[dict[str, Any]]) -> float:
    """The last epoch's training loss, averaged over every rank's samples (a collective); NaN without epochs."""
    last = history[-1] if history else {"train_loss": math.nan, "samples": 0}
    samples = last.get("samples", 1)
    totals = gather_per_rank(last["train_loss"] * samples)
    counts = gather_per_rank(samples)
    return sum(totals) / sum(counts) if sum(counts) else math.nan


def _slow_links(sm: dict[str, Any]) -> str:
    """How SlowMo's nodes exchange pseudo-gradients, when they do (empty for the exact parameter average)."""
    exact = sm.get("slowmo_compression", "none") == "none" and sm.get("slowmo_fragments", 1) == 1
    if exact and not sm.get("slowmo_sync_delay"):
        return ""
    text = f"; {sm['slowmo_compression']} pseudo-gradients in {sm['slowmo_fragments']} fragment(s)"
    if sm["slowmo_sync_delay"]:
        text += f", merged {sm['slowmo_sync_delay']} step(s) late (alpha {sm['slowmo_merge_alpha']:g})"
    return text + (", error feedback" if sm["slowmo_error_feedback"] else "")


def _settings_rows(settings: dict[str, Any], summary: dict[str, Any]) -> list[tuple[str, str]]:
    args = " ".join(f"{k}={v:g}" for k, v in settings["optimizer_arguments"].items())
    batch = f"{settings['batch_size_per_process']} per process x {settings['world_size']} x {settings['grad_accum']}"
    amp = settings["amp"]
    if amp == "fp16":
        amp += f", {summary.get('fp16_skipped_steps', 0)} step(s) skipped (inf/nan gradients)"
    rows = [
        ("optimizer", f"{settings['optimizer']} {args}"),
        ("batch", f"{batch} accumulated = {settings['samples_per_step']} samples per step"),
        ("precision", amp),
    ]
    if settings["adascale"]:
        gains = summary.get("adascale_gain_per_epoch") or [math.nan]
        rows.append(("adascale", f"gain {gains[-1]:.3f} in the last epoch (per epoch: {_list(gains)})"))
    if settings["slowmo"]:
        sm = settings["slowmo"]
        base = f"average every {sm['localsgd_frequency']} steps"
        if sm.get("slowmo_base") == "sgp":
            base = f"gossip ({'PushSum' if sm['push_sum'] else 'PushPull'}) on {sm['graph']} graph"
            base += ", overlapped" if sm["overlap"] else ""
        rows.append(
            (
                "slowmo",
                f"{base}, {'Nesterov ' if sm.get('slowmo_nesterov') else ''}slow momentum {sm['slowmo_momentum']:g} "
                f"(lr {sm['slowmo_lr']:g}) every {sm['slowmo_frequency']}, nodes of {sm['nprocs_per_node']}"
                + _slow_links(sm),
            )
        )
    hosts = sorted(set(settings["hosts"]))
    rows += [
        (
            "model and data",
            f"{settings['model']} ({settings.get('model_size', 'default')}) on {settings['data']}, "
            f"{settings['epochs']} epoch(s), seed {settings['seed']}",
        ),
        ("hosts", f"{len(hosts)}: {', '.join(hosts)}"),
        ("versions", f"torch {settings['torch_version']}, ddpkit {settings['ddpkit_version']}"),
    ]
    return rows


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def format_summary(summary: dict[str, Any]) -> str:
    """The table printed at the end of `ddpkit train`."""
    memory = ", ".join(f"{m:.0f}" for m in summary["peak_memory_mb"])
    rows = [
        ("strategy", f"{summary['strategy']} on {summary['world_size']} process(es), {summary['backend']}"),
        *(_settings_rows(summary["settings"], summary) if "settings" in summary else []),
        ("test accuracy", f"{summary['test_accuracy']:.4f}"),
        ("final train loss", f"{summary['train_loss']:.4f} (the last epoch's mean over every rank's samples)"),
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
