"""The figures `ddpkit bench` and `ddpkit train` write: bench.png (per strategy) and metrics.png (per run)."""

from __future__ import annotations

import math
import os
import platform
from typing import Any

from ddpkit.measure.advisor import Link, advise

MAX_SMOOTHING = 0.98  # the largest weight of the past in the loss curve's exponential moving average


def machine() -> str:
    """The CPU model and core count (or the platform's processor string), e.g. "AMD EPYC 7B13, 2 cores"."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, names: list[str], values: list[float], title: str, color: str = "tab:blue") -> None:
    bars = ax.bar(names, values, color=color)
    ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_title(title, fontsize=10)


def _traffic(ax: Any, results: list[dict[str, Any]]) -> None:
    names = [r["strategy"] for r in results]
    wire = [r["sent_bytes_per_step"] / 1e6 for r in results]
    shared = [r.get("shared_memory_bytes_per_step", 0.0) / 1e6 for r in results]
    ax.bar(names, wire, color="tab:blue", label="network (modelled wire bytes)")
    if any(shared):
        ax.bar(
            names,
            shared,
            bottom=wire,
            color="white",
            edgecolor="tab:orange",
            hatch="//",
            label="shared memory (same host, not on the wire)",
        )
    ax.set_title("sent per step and rank (MB)", fontsize=10)
    ax.margins(y=0.3)
    ax.legend(fontsize=7, loc="upper left")


def _step_times(ax: Any, results: list[dict[str, Any]], target: Link | None) -> None:
    names = [r["strategy"] for r in results]
    measured = [r["step_ms"] for r in results]
    if target is None:
        _bars(ax, names, measured, "step time (ms), measured: median of 3-step windows")
        return
    predicted = advise(results, target).seconds
    positions = range(len(names))
    ax.bar([p - 0.2 for p in positions], measured, width=0.4, color="tab:blue", label="measured here")
    ax.bar(
        [p + 0.2 for p in positions],
        [predicted[n] * 1e3 for n in names],
        width=0.4,
        color="tab:red",
        label=f"predicted, {target.mbit:,.0f} Mbit/s",
    )
    ax.set_xticks(list(positions), names)
    ax.set_title("step time (ms): median of 3-step windows", fontsize=10)
    ax.margins(y=0.25)
    ax.legend(fontsize=7, loc="upper left")


def plot_bench(results: list[dict[str, Any]], path: str, target: Link | None = None) -> None:
    """Step time (and the prediction on `target`), peak memory per rank, optimizer state per rank and traffic
    per step (network and shared memory apart), one bar per strategy, titled with workload, world size and
    machine."""
    plt = _pyplot()
    names = [r["strategy"] for r in results]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    _step_times(axes[0], results, target)
    _bars(axes[1], names, [r["peak_memory_mb"] for r in results], "peak memory per rank (MB)", "tab:green")
    state = [r["optimizer_state_bytes_per_rank"] / 1e6 for r in results]
    _bars(axes[2], names, state, "optimizer state per rank (MB)", "tab:purple")
    _traffic(axes[3], results)
    first = results[0]
    fig.suptitle(
        f"ddpkit bench: {first.get('workload', 'model')} ({first['parameters'] / 1e6:.1f}M parameters), "
        f"{first.get('world_size', '?')} processes, {machine()}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def smoothing_weight(count: int) -> float:
    """The moving average's weight for a curve of `count` points: a memory of about count / 10 points."""
    return min(MAX_SMOOTHING, 1.0 - 10.0 / max(count, 10))


def smooth(values: list[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average of `values` (the first point is not pulled towards 0)."""
    out, average = [], 0.0
    for i, value in enumerate(values):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight ** (i + 1)))
    return out


def _epoch_ticks(ax: Any, history: list[dict[str, Any]], completed: int | None) -> None:
    """Integer epoch ticks on a top axis, at the optimizer step each epoch ended; with `completed` (epochs
    finished), none for the epoch --max-steps cut short."""
    ended = [h for h in history if "steps" in h and (completed is None or h["epoch"] < completed)]
    if ended:
        top = ax.secondary_xaxis("top")
        top.set_xticks([h["steps"] for h in ended], [str(h["epoch"] + 1) for h in ended])
        top.set_xlabel("end of epoch", fontsize=8)


def _loss_panel(
    ax: Any, steps: list[dict[str, Any]], history: list[dict[str, Any]], bits: bool, completed: int | None
) -> None:
    x = [s["step"] for s in steps]
    loss = [s["loss"] / (math.log(2) if bits else 1.0) for s in steps]
    weight = smoothing_weight(len(loss))
    ax.plot(x, loss, lw=0.6, color="tab:blue", alpha=0.3, label="per step (rank 0's batches)")
    ax.plot(x, smooth(loss, weight), lw=1.6, color="tab:blue", label=f"moving average (weight {weight:.2f})")
    unit = "bits per byte" if bits else "loss"
    ax.set(xlabel="optimizer step", ylabel=f"training {unit}", title=f"training {unit}")
    ax.legend(fontsize=8)
    _epoch_ticks(ax, history, completed)


def _has_number(values: list[Any]) -> bool:
    return any(isinstance(v, int | float) and not math.isnan(v) for v in values)


def _number(value: Any) -> float:
    """A figure to plot: NaN for None (metrics.json's null: does not apply)."""
    return math.nan if value is None else float(value)


def _heldout_panel(
    ax: Any, history: list[dict[str, Any]], heldout: list[dict[str, Any]] | None, bits: bool, completed: int | None
) -> None:
    """The held-out score at every evaluation (`heldout`; without it, at each epoch's end) against the optimizer
    step: bits per byte for text, accuracy (with the training accuracy of each epoch) when the targets are
    classes, else the loss."""
    points = heldout or [{**h, "step": h["steps"]} for h in history if "steps" in h]
    x = [p["step"] for p in points]
    marker = "o" if len(points) <= 40 else None
    if bits:
        ax.plot(x, [_number(p["test_loss"]) / math.log(2) for p in points], marker=marker, label="held-out")
        ax.set(ylabel="bits per byte", title="held-out bits per byte")
    elif _has_number([p.get("test_accuracy") for p in points]):
        ends = [h for h in history if "steps" in h]
        train = [_number(h.get("train_accuracy")) for h in ends]
        ax.plot([h["steps"] for h in ends], train, marker="s", ls="--", label="train (epoch's mean)")
        ax.plot(x, [_number(p["test_accuracy"]) for p in points], marker=marker, label="held-out")
        ax.set(ylabel="accuracy", title="accuracy", ylim=(0, 1.02))
    else:  # no classes (e.g. --loss mse): the loss is the score
        ax.plot(x, [_number(p["test_loss"]) for p in points], marker=marker, label="held-out")
        ax.set(ylabel="loss", title="held-out loss")
    ax.set_xlabel("optimizer step")
    if points:
        ax.legend(fontsize=8)
    _epoch_ticks(ax, history, completed)


def _bytes_panel(ax: Any, steps: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """Rank 0's bytes per step (its own rows), and as dotted lines the means over ranks the summary prints (ranks
    send different amounts: an owner receives where the others send)."""
    x = [s["step"] for s in steps]
    line = ax.plot(x, [s.get("sent_bytes", 0.0) / 1e6 for s in steps], lw=1, label="network, rank 0")[0]
    if summary.get("sent_bytes_per_step") is not None:
        mean = summary["sent_bytes_per_step"] / 1e6
        ax.axhline(mean, color=line.get_color(), lw=1, ls=":", label="network, mean over ranks")
    if any(s.get("shared_bytes", 0) for s in steps) or summary.get("shared_memory_bytes_per_step"):
        shared = ax.plot(x, [s.get("shared_bytes", 0.0) / 1e6 for s in steps], lw=1, ls="--")[0]
        shared.set_label("shared memory, rank 0 (not on the wire)")
        if summary.get("shared_memory_bytes_per_step") is not None:
            mean = summary["shared_memory_bytes_per_step"] / 1e6
            ax.axhline(mean, color=shared.get_color(), lw=1, ls=":", label="shared memory, mean over ranks")
    ax.set(xlabel="optimizer step", ylabel="MB per step", title="bytes sent per step (network: modelled wire bytes)")
    ax.legend(fontsize=8, loc="center right")


def run_title(summary: dict[str, Any]) -> str:
    """One line naming the run: strategy, world size, workload and settings."""
    parts = [f"{summary.get('strategy', '?')} on {summary.get('world_size', '?')} processes"]
    for key in ("workload", "title"):
        if summary.get(key):
            parts.append(str(summary[key]))
    parts.append(f"{summary.get('steps', '?')} steps")
    return ", ".join(parts)


def plot_run(
    path: str,
    summary: dict[str, Any],
    history: list[dict[str, Any]],
    steps: list[dict[str, Any]],
    heldout: list[dict[str, Any]] | None = None,
) -> None:
    """metrics.png: the smoothed training loss with epoch ticks, held-out accuracy (or bits per byte, or loss) at
    every evaluation (`heldout`, else each epoch's end) and the bytes sent per step, under a title with the run's
    settings."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    bits = "heldout_bits_per_byte" in summary
    completed = summary.get("epochs_completed")
    _loss_panel(axes[0], steps, history, bits, completed)
    _heldout_panel(axes[1], history, heldout, bits, completed)
    _bytes_panel(axes[2], steps, summary)
    fig.suptitle(run_title(summary), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
