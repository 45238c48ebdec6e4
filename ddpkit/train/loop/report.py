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
from ddpkit.distributed import allocator, comm
from ddpkit.distributed.env import comm_device, group_size
from ddpkit.distributed.objects import gather_objects
from ddpkit.train.loop.strategies import optimizer_arguments, slowmo_node_size
from ddpkit.train.settings.config import SLOW_LINK_FLAGS, TrainConfig


def parameter_digest(module: nn.Module) -> str:
    """The SHA-256, in hex, of every parameter's shape, dtype and bytes in ``module.parameters()`` order: equal
    digests mean bit-identical parameters (across ranks: replicas; across runs: the same model)."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(f"{tuple(p.shape)}|{p.dtype}|".encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def peak_memory_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the tensors this process's optimizer holds as state (with OSS: its own shard)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def gather_per_rank(value: float) -> list[float]:
    """`value` from every rank, in rank order (one small all-gather)."""
    world, device = group_size(), comm_device()
    out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
    comm.all_gather(out, torch.tensor([float(value)], dtype=torch.float64, device=device))
    return [t.item() for t in out]


def gather_digests(module: nn.Module) -> list[str]:
    """Every rank's `parameter_digest`, in rank order (a collective)."""
    digests = gather_objects(parameter_digest(module), dst=-1)
    assert digests is not None
    return digests


def model_size(cfg: TrainConfig, parameters: int) -> str:
    """The model's shape as its flags give it (built-in models) and its parameter count, e.g. "2 layers, width 64,
    2 heads, context 64; 120,576 parameters" for ``--model gpt``."""
    count = _counted(parameters, "parameter")
    if cfg.model == "mlp":
        return f"{_counted(cfg.depth, 'hidden layer')} of {cfg.hidden}; {count}"
    if cfg.model == "gpt":
        shape = f"{_counted(cfg.gpt_layers, 'layer')}, width {cfg.gpt_width}, {_counted(cfg.gpt_heads, 'head')}"
        return f"{shape}, context {cfg.context}; {count}"
    return count  # the CNN's shape follows the data; a factory's is its own


def _counted(number: int, noun: str) -> str:
    """``"1 layer"``, ``"2 layers"``, ``"1,024 parameters"``."""
    return f"{number:,} {noun}" + ("" if number == 1 else "s")


def run_settings(cfg: TrainConfig, world_size: int, backend: str, parameters: int) -> dict[str, Any]:
    """What the run was: the resolved settings, where it ran (each rank's host: a collective) and the versions.
    `parameters`: the model's parameter count."""
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
        "model_size": model_size(cfg, parameters),
        "parameters": parameters,
        "data": cfg.data,
        "epochs": cfg.epochs,
        "seed": cfg.seed,
        "world_size": world_size,
        "backend": backend,
        "hosts": hosts,
        "threads_per_rank": torch.get_num_threads(),
        "allocator": allocator.in_effect(),
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
    if cfg.fault_tolerant:
        settings |= {"fault_tolerant": True, "min_replicas": cfg.min_replicas, "quorum_timeout": cfg.quorum_timeout}
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
    size = f" ({settings['model_size']})" if settings.get("model_size") else ""
    rows += [
        ("model and data", f"{settings['model']}{size} on {settings['data']}, seed {settings['seed']}"),
        ("length", run_length(summary)),
        ("hosts", f"{len(hosts)}: {', '.join(hosts)}"),
        ("versions", f"torch {settings['torch_version']}, ddpkit {settings['ddpkit_version']}"),
    ]
    return rows


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def run_length(summary: dict[str, Any]) -> str:
    """How far the run went: every epoch --epochs asked for, or where --max-steps stopped it (1-based epochs)."""
    steps, epochs = summary["steps"], summary["epochs"]
    if summary.get("epochs_completed", epochs) >= epochs:
        return f"{epochs} epoch(s), {steps} steps"
    per_epoch = f"{summary['steps_per_epoch']} steps per epoch" if summary.get("steps_per_epoch") else ""
    last = summary["last_epoch"] + 1
    where = f"at the end of epoch {last}" if summary["epochs_completed"] == last else f"in epoch {last}"
    return f"stopped by --max-steps at step {steps}, {where} of {epochs}" + (f" ({per_epoch})" if per_epoch else "")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not math.isnan(value)


def _heldout_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Held-out accuracy when the targets are classes, else the held-out loss; bits per byte for --data text."""
    rows = []
    if _is_number(summary.get("test_accuracy")):
        rows.append(("test accuracy", f"{summary['test_accuracy']:.4f}"))
    else:
        rows.append(("held-out loss", f"{summary['test_loss']:.4f} (no accuracy: the targets are not class indices)"))
    if "heldout_bits_per_byte" in summary:
        rows.append(("held-out bits per byte", f"{summary['heldout_bits_per_byte']:.4f}"))
    return rows


def _time_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """This command's wall time and, apart, the training loop's (which a resumed run adds up across its runs)."""
    wall = ("wall time", f"{summary['wall_seconds']:.1f} s (this command, from its start to this summary)")
    if "training_seconds" not in summary:
        return [wall, ("samples/s", f"{summary['samples_per_second']:.0f}")]
    across = ", across resumed runs" if summary.get("resumed") else ""
    evaluations = f"; held-out evaluations another {summary.get('evaluation_seconds', 0.0):.1f} s"
    return [
        wall,
        ("training time", f"{summary['training_seconds']:.1f} s (the training loop{across}{evaluations})"),
        ("samples/s", f"{summary['samples_per_second']:.0f} (over the training time)"),
    ]


def format_summary(summary: dict[str, Any]) -> str:
    """The table printed at the end of `ddpkit train`."""
    memory = ", ".join(f"{m:.0f}" for m in summary["peak_memory_mb"])
    rows = [
        ("strategy", f"{summary['strategy']} on {summary['world_size']} process(es), {summary['backend']}"),
        *(_settings_rows(summary["settings"], summary) if "settings" in summary else []),
        *_heldout_rows(summary),
        ("final train loss", f"{summary['train_loss']:.4f} (the last epoch's mean over every rank's samples)"),
        *_time_rows(summary),
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
    if "trained_ranks" in summary:  # a fault-tolerant job: who actually trained
        missing = summary.get("never_joined") or []
        note = f" ({', '.join(map(str, missing))} never joined)" if missing else ""
        rows.insert(1, ("members", f"ranks {', '.join(map(str, summary['trained_ranks']))} trained{note}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def json_safe(value: Any) -> Any:
    """`value` with every NaN float replaced by None: JSON has no NaN (Python's json writes a bare ``NaN`` other
    readers refuse), and NaN here means "does not apply", e.g. the accuracy of a regression."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_metrics(
    out: str,
    summary: dict[str, Any],
    history: list[dict[str, Any]],
    steps: list[dict],
    heldout: list[dict[str, Any]] | None = None,
) -> list[str]:
    """metrics.json (summary, per-epoch history and the held-out evaluations during training), steps.csv (per
    step, rank 0) and metrics.png; returns their paths. NaN is written as null."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in ("metrics.json", "steps.csv", "metrics.png")]
    with open(paths[0], "w") as f:
        json.dump(json_safe({"summary": summary, "epochs": history, "heldout": heldout or []}), f, indent=2)
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(steps[0]) if steps else ["step"])
        writer.writeheader()
        writer.writerows(steps)
    plot_metrics(paths[2], history, steps, summary, heldout)
    return paths


def plot_metrics(
    path: str,
    history: list[dict[str, Any]],
    steps: list[dict],
    summary: dict[str, Any] | None = None,
    heldout: list[dict[str, Any]] | None = None,
) -> None:
    """metrics.png: smoothed training loss with epoch ticks, held-out accuracy (or bits per byte, or loss) at
    every evaluation and bytes sent per step, titled with the run's settings (`ddpkit.measure.plots.plot_run`)."""
    from ddpkit.measure.plots import plot_run

    plot_run(path, summary or {}, history, steps, heldout)
