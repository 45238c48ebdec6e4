"""AdaScale: does a batch S times larger keep the single-worker schedule and its final loss, unlike linear scaling?

Every run trains the same MLP (64 -> 64 -> 10, ReLU; the same initialisation) on scikit-learn's bundled 8x8
digits (standardised, 80/20 split with a fixed seed; nothing is downloaded) with plain SGD and a step-decay
schedule, the learning rate divided by 10 at 50% and again at 75% of the run (``MultiStepLR``):

* ``baseline`` (S = 1): `--base-batch` samples per step, T = `--steps` steps, learning rate `--lr`;
* ``adascale`` at S = 2, 4, 8, 16: each update averages S micro-batches of `--base-batch` samples;
  ``AdaScale(SGD(lr))`` multiplies the learning rate by its gain, the *same* MultiStepLR (milestones in S = 1
  iterations) is driven by scale-invariant progress (``optimizer.step_scheduler(scheduler)``), and training stops
  when that progress reaches T. Smoothing ``max(1 - S / W, 0)`` with a window of W = `--smoothing-window` S = 1
  iterations (default T / 20);
* ``adascale-default``: the same with AdaScale's default smoothing ``max(1 - S / 1000, 0)`` (W = 1000);
* ``linear``: the linear scaling rule at the same S: learning rate x S, milestones and budget divided by S
  (T / S updates of S micro-batches).

S workers are simulated in one process by accumulating S micro-batches per update (``num_gradients_to_accumulate
= S``, each loss divided by S): the averaged gradient and every per-micro-batch gradient norm AdaScale sees are
exactly those of S data-parallel workers with one micro-batch each (tests/test_adascale.py checks that DDP on two
ranks and one process accumulating the same micro-batches agree within 1e-6).

Reported per method and scale, as the mean over `--seeds` seeds (each seed its own data order): updates taken
and their ratio to T / S, the final training loss (cross-entropy over the whole training set) and its gap to the
baseline's (and the range of the gaps per seed, each against the baseline of the same seed), how many seeds
diverged (the loss rose above twice its initial value at some point), test accuracy and the mean gain. A PNG
plots training loss and AdaScale's gain against scale-invariant iterations.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from benchmarks.lib import plotting
from benchmarks.lib.cli import UsageError
from ddpkit.optim import AdaScale

QUESTION = "adascale: does AdaScale at S = 2..16 reach the S = 1 loss in T/S steps where linear scaling does not?"
QUICK = {"seeds": 1, "steps": 32, "points": 4}
SCALES = (2, 4, 8, 16)
METHODS = ("adascale", "adascale-default", "linear")


@dataclass
class Data:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits_data() -> Data:
    """The 1,797 digits, standardised with the training split's statistics, split 80/20 with a fixed seed."""
    from ddpkit.train.workloads.data import digits_arrays  # load_digits' values, without importing scikit-learn

    images, labels = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    split = int(0.8 * len(x))
    train, test = order[:split], order[split:]
    mean, std = x[train].mean(0), x[train].std(0) + 1e-6
    x = (x - mean) / std
    return Data(x[train], y[train], x[test], y[test])


class Sampler:
    """Micro-batches of `batch` samples drawn without replacement from reshuffled epochs."""

    def __init__(self, n: int, batch: int, seed: int) -> None:
        self.n, self.batch = n, batch
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(n, generator=self.generator)
        self.position = 0

    def next(self) -> torch.Tensor:
        if self.position + self.batch > self.n:
            self.order = torch.randperm(self.n, generator=self.generator)
            self.position = 0
        idx = self.order[self.position : self.position + self.batch]
        self.position += self.batch
        return idx


def build_model(hidden: int) -> nn.Module:
    torch.manual_seed(1234)  # the same initialisation for every run
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@torch.no_grad()
def evaluate(model: nn.Module, data: Data) -> tuple[float, float]:
    """(cross-entropy over the whole training set, test accuracy)."""
    loss = nn.functional.cross_entropy(model(data.x_train), data.y_train).item()
    accuracy = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
    return loss, accuracy


@dataclass
class Run:
    method: str
    scale: int
    seed: int
    updates: int = 0
    final_loss: float = math.nan
    test_accuracy: float = math.nan
    mean_gain: float = 1.0
    curve: list[tuple[float, float]] = field(default_factory=list)  # (S = 1 iterations, training loss)
    gains: list[tuple[float, float]] = field(default_factory=list)  # (S = 1 iterations, gain), AdaScale only


def milestones(total: int) -> list[int]:
    return [total // 2, (3 * total) // 4]


def accumulate(model: nn.Module, data: Data, sampler: Sampler, scale: int) -> None:
    """The backward passes of one update: S micro-batches, each loss divided by S."""
    for _ in range(scale):
        idx = sampler.next()
        loss = nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
        (loss / scale).backward()


def smoothing_for(method: str, scale: int, window: float) -> float | None:
    return None if method == "adascale-default" else max(1.0 - scale / window, 0.0)


def train_adascale(args: argparse.Namespace, data: Data, run: Run, bar: tqdm) -> nn.Module:
    model = build_model(args.hidden)
    sampler = Sampler(len(data.x_train), args.base_batch, run.seed)
    smoothing = smoothing_for(run.method, run.scale, args.smoothing_window)
    opt = AdaScale(
        torch.optim.SGD(model.parameters(), lr=args.lr), num_gradients_to_accumulate=run.scale, smoothing=smoothing
    )
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones(args.steps), gamma=0.1)
    every, next_point, gains = args.steps / args.points, args.steps / args.points, []
    while opt.scale_invariant_steps < args.steps:
        opt.zero_grad()
        accumulate(model, data, sampler, run.scale)
        before = opt.scale_invariant_steps
        opt.step()
        opt.step_scheduler(sched)
        gains.append(opt.gain())
        run.updates += 1
        bar.update(math.floor(min(opt.scale_invariant_steps, args.steps)) - math.floor(before))
        if opt.scale_invariant_steps >= next_point:
            run.curve.append((opt.scale_invariant_steps, evaluate(model, data)[0]))
            run.gains.append((opt.scale_invariant_steps, opt.gain()))
            next_point += every
    run.mean_gain = statistics.fmean(gains)
    return model


def train_fixed(args: argparse.Namespace, data: Data, run: Run, bar: tqdm) -> nn.Module:
    """The baseline (S = 1) or the linear scaling rule: learning rate x S, schedule and budget / S."""
    model = build_model(args.hidden)
    sampler = Sampler(len(data.x_train), args.base_batch, run.seed)
    total = args.steps // run.scale
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * run.scale)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones(total), gamma=0.1)
    every = max(args.steps // args.points, 1)
    for step in range(1, total + 1):
        opt.zero_grad()
        accumulate(model, data, sampler, run.scale)
        opt.step()
        sched.step()
        run.updates += 1
        bar.update(run.scale)
        if (step * run.scale) % every < run.scale:
            run.curve.append((float(step * run.scale), evaluate(model, data)[0]))
    run.mean_gain = float(run.scale)
    return model


def train(args: argparse.Namespace, data: Data, method: str, scale: int, seed: int, bar: tqdm) -> Run:
    """One run; `bar` advances by S = 1 iterations (scale-invariant ones for AdaScale)."""
    run = Run(method, scale, seed)
    run.curve.append((0.0, evaluate(build_model(args.hidden), data)[0]))
    trainer = train_adascale if method.startswith("adascale") else train_fixed
    model = trainer(args, data, run, bar)
    run.final_loss, run.test_accuracy = evaluate(model, data)
    if not math.isfinite(run.final_loss):
        run.final_loss = math.inf
    return run


def summarize(runs: list[Run], steps: int) -> list[dict]:
    """One row per (method, S): means over seeds; gaps per seed are against the baseline of the same seed."""
    base_of = {r.seed: r.final_loss for r in runs if r.method == "baseline"}
    base = statistics.fmean(base_of.values())
    rows = []
    order = {"baseline": 0, **{m: i + 1 for i, m in enumerate(METHODS)}}
    for method, scale in sorted({(r.method, r.scale) for r in runs}, key=lambda k: (order[k[0]], k[1])):
        chosen = [r for r in runs if (r.method, r.scale) == (method, scale)]
        loss = statistics.fmean(r.final_loss for r in chosen)
        updates = statistics.fmean(r.updates for r in chosen)
        seed_gaps = [r.final_loss / base_of[r.seed] - 1.0 for r in chosen]
        rows.append(
            {
                "method": method,
                "S": scale,
                "updates": updates,
                "updates_over_T_over_S": updates / (steps / scale),
                "final_loss": loss,
                "gap_to_baseline": loss / base - 1.0,
                "final_loss_per_seed": [r.final_loss for r in chosen],
                "gap_per_seed": seed_gaps,
                "diverged": sum(max(loss for _, loss in r.curve) > 2 * r.curve[0][1] for r in chosen),
                "test_accuracy": statistics.fmean(r.test_accuracy for r in chosen),
                "mean_gain": statistics.fmean(r.mean_gain for r in chosen),
            }
        )
    return rows


def plot(report: dict[str, Any], out_dir: Path) -> None:
    """Top: training loss per method and scale (seed 0); bottom: AdaScale's gain / S, and the end of training."""
    plt = plotting.pyplot()
    args = argparse.Namespace(**report["config"])
    runs = [Run(**r) for r in report["figures"]["runs"]]
    seed = runs[0].seed
    titles = {
        "adascale": f"AdaScale, smoothing window {args.smoothing_window:g}",
        "adascale-default": "AdaScale, default smoothing (window 1000)",
        "linear": "linear scaling rule",
    }
    fig, axes = plt.subplots(2, len(METHODS), figsize=(16, 8.5))
    colors = [plt.get_cmap("viridis")(0.1 + 0.25 * i) for i in range(len(SCALES))]
    base = next(r for r in runs if r.method == "baseline" and r.seed == seed)
    pick = {(r.method, r.scale): r for r in runs if r.seed == seed}
    low = min(loss for r in pick.values() for _, loss in r.curve if loss > 0) * 0.8  # a blown-up run can reach 0
    for ax, method in zip(axes[0], METHODS, strict=True):
        ax.plot(*zip(*base.curve, strict=True), color="black", lw=2.5, label="S = 1 (baseline)")
        for color, scale in zip(colors, SCALES, strict=True):
            ax.plot(*zip(*pick[method, scale].curve, strict=True), color=color, lw=1.3, label=f"S = {scale}")
        ax.set(yscale="log", ylim=(low, 5.0), title=titles[method], xlabel="scale-invariant iterations")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("training loss (whole training set)")
    for ax, method in zip(axes[1][:2], METHODS[:2], strict=True):
        for color, scale in zip(colors, SCALES, strict=True):
            t, g = zip(*pick[method, scale].gains, strict=True)
            ax.plot(t, [x / scale for x in g], color=color, label=f"S = {scale}")
        ax.set(ylim=(0, 1.05), title=f"{titles[method]}: gain / S", xlabel="scale-invariant iterations")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[1][0].set_ylabel("gain / S (1 = linear scaling)")
    _plot_end_of_training(axes[1][2], base, pick, args.steps / 2, colors[-1])
    workload = f"digits MLP, SGD lr {args.lr:g} with step decay, base batch {args.base_batch}, T = {args.steps}"
    fig.suptitle(plotting.title(f"{workload}, seed {seed}", "S = 1..16 simulated", report))
    plotting.save(fig, "adascale_digits", out_dir)


def _plot_end_of_training(ax: Any, base: Run, pick: dict[tuple[str, int], Run], half: float, color: Any) -> None:
    """The second half of training at S = 16, every method against the baseline."""
    ax.plot(*zip(*[p for p in base.curve if p[0] >= half], strict=True), color="black", lw=2.5, label="S = 1")
    top = 1.5 * max(loss for t, loss in base.curve if t >= half)
    for method, style in (("adascale", "-"), ("adascale-default", "--"), ("linear", ":")):
        run = pick[method, 16]
        curve = [p for p in run.curve if p[0] >= half]
        label = f"{method}, S = 16"
        if run.final_loss > top:
            label += f" (off scale: ends at {run.final_loss / base.final_loss:.0f}x)"
        ax.plot(*zip(*curve, strict=True), style, color=color, label=label)
    ax.set(ylim=(0.9 * base.final_loss, top), title="second half of training, S = 16")
    ax.set(xlabel="scale-invariant iterations", ylabel="training loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend()


def table(report: dict[str, Any]) -> str:
    rows = report["figures"]["rows"]
    lines = [
        "| method | S | updates | updates / (T/S) | final train loss | vs S = 1 | per seed | diverged | test acc. "
        "| mean gain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['S']} | {r['updates']:.0f} | {r['updates_over_T_over_S']:.2f} | "
            f"{r['final_loss']:.5f} | {100 * r['gap_to_baseline']:+.1f}% | "
            f"{100 * min(r['gap_per_seed']):+.1f}% .. {100 * max(r['gap_per_seed']):+.1f}% | "
            f"{r['diverged']}/{len(r['gap_per_seed'])} | {r['test_accuracy']:.3f} | "
            f"{r['mean_gain']:.2f} |"
        )
    return "\n".join(lines + report["figures"]["verdict"])


def verdict(rows: list[dict]) -> list[str]:
    """The goal: AdaScale within 1% of the S = 1 final loss using at most 1.5 x T/S updates, at every S."""
    out = []
    for method in ("adascale", "adascale-default"):
        mine = [r for r in rows if r["method"] == method]
        worst_gap = max(r["gap_to_baseline"] for r in mine)
        worst_updates = max(r["updates_over_T_over_S"] for r in mine)
        met = worst_gap <= 0.01 and worst_updates <= 1.5
        out.append(
            f"{method}: final loss at most {100 * worst_gap:+.1f}% from S = 1, at most {worst_updates:.2f} x T/S "
            f"updates -> goal (<= +1%, <= 1.5 x T/S) {'met' if met else 'NOT met'}"
        )
    linear16 = next(r for r in rows if (r["method"], r["S"]) == ("linear", 16))
    return [*out, f"linear scaling at S = 16: final loss {100 * linear16['gap_to_baseline']:+.1f}% vs S = 1"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=3200, help="T: S = 1 iterations (a multiple of 16)")
    parser.add_argument("--base-batch", type=int, default=16, help="samples per micro-batch")
    parser.add_argument("--lr", type=float, default=0.2, help="the S = 1 learning rate")
    parser.add_argument("--hidden", type=int, default=64, help="MLP width")
    parser.add_argument("--smoothing-window", type=float, default=None, help="W for 'adascale' (default: T / 20)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1, each its own data order")
    parser.add_argument("--points", type=int, default=64, help="loss evaluations per run, for the plot")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.steps % 16:
        raise UsageError("--steps must be a multiple of 16 (the budget is divided by S for linear scaling)")
    if args.smoothing_window is None:
        args.smoothing_window = args.steps / 20
    torch.set_num_threads(1)
    data = load_digits_data()
    plan = [("baseline", 1)] + [(m, s) for s in SCALES for m in METHODS]
    runs: list[Run] = []
    with tqdm(total=args.seeds * len(plan) * args.steps, unit="it", unit_scale=True, desc="adascale") as bar:
        for seed in range(args.seeds):
            for method, scale in plan:
                bar.set_postfix_str(f"seed {seed} {method} S={scale}")
                runs.append(train(args, data, method, scale, seed, bar))
    rows = summarize(runs, args.steps)
    return {"rows": rows, "runs": [asdict(r) for r in runs], "verdict": verdict(rows)}
