"""SlowMo's training quality on 4 workers: does SlowMo end as low as synchronous SGD where local SGD does not?

4 gloo ranks on one machine, each a node of its own (``nprocs_per_node=1``); an MLP 64 -> 128 -> 128 -> 10
(ReLU), the same initial weights on every rank; SGD with momentum 0.9; batch 16 per worker. For every base lr
and seed (initial weights and data order) the configurations share everything but the algorithm:

* ``sync``: synchronous SGD, torch DDP (gradients averaged every step);
* ``slowmo``: ddpkit SlowMo, localsgd_frequency=12, slowmo_momentum=0.7, slowmo_frequency=12, slowmo_lr=1;
* ``localsgd``: the same with slowmo_momentum=0 (SlowMo off): plain local SGD;
* ``slowmo_lr0.3`` (extra): slowmo_lr = 1 - beta, so its long-run step ``slowmo_lr * lr / (1 - beta)`` equals
  the base lr: separates the slow momentum from the larger step.

Data (``--data``; nothing downloaded): ``digits`` (scikit-learn's, 80/20 split, the training part dealt into 4
shards; loss = cross-entropy on the whole training set) or ``teacher`` (fresh samples from a fixed random tanh
network; loss on 8192 held-out samples). ``--split by-label`` gives each worker only 2-3 classes. The loss is
measured every 12 steps, right after averaging. The goal is checked at each lr: SlowMo's mean within 3% of
synchronous SGD's (or at most 3% above it) while local SGD ends worse on every seed; each configuration is also
shown at its own best lr.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.lib import plotting
from benchmarks.lib.cli import UsageError, progress
from benchmarks.lib.workloads import digits_split, mlp
from ddpkit.testing import run_distributed

QUESTION = "slowmo_quality: does SlowMo end as low as synchronous SGD on 4 workers where local SGD does not?"
QUICK = {"lrs": "0.03", "seeds": "0", "steps": 12, "configs": "sync,slowmo,localsgd"}
WORLD_SIZE = 4
FREQUENCY = 12
DIMS = (64, 128, 128, 10)

# -- the configurations ----------------------------------------------------------------------------------------------

CONFIGS: dict[str, dict[str, Any]] = {
    "sync": {"label": "synchronous SGD (torch DDP)", "style": "-"},
    "slowmo": {"label": "SlowMo, freq 12, beta 0.7", "slowmo_momentum": 0.7, "style": "-"},
    "localsgd": {"label": "local SGD, freq 12, no slow momentum", "slowmo_momentum": 0.0, "style": "--"},
    "slowmo_lr0.3": {"label": "extra: SlowMo, beta 0.7, slowmo_lr 0.3", "slowmo_momentum": 0.7, "slowmo_lr": 0.3},
}


def build(name: str, model: nn.Module, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The strategy as `ddpkit train` builds it: torch DDP, or SlowMo with every 12 steps an averaging."""
    from ddpkit.train.loop.strategies import build_strategy
    from ddpkit.train.settings.config import TrainConfig

    cfg = CONFIGS[name]
    train = TrainConfig(strategy="ddp" if name == "sync" else "slowmo", optimizer="sgd", lr=lr, momentum=0.9)
    if name != "sync":
        train.slowmo_momentum, train.slowmo_lr = cfg["slowmo_momentum"], cfg.get("slowmo_lr", 1.0)
        train.localsgd_frequency = train.slowmo_frequency = FREQUENCY
        train.nprocs_per_node_slowmo = 1
    built = build_strategy(train, model, torch.device("cpu"))
    return built.model, built.optimizer


# -- the data --------------------------------------------------------------------------------------------------------


class Shard:
    """digits: this worker's part of the training set, visited in a new random order every epoch.

    ``iid``: every 4th sample (each worker sees every class); ``by-label``: the training set sorted by label and cut
    into 4 contiguous parts, so each worker sees 2-3 classes (heterogeneous workers, where local models drift).
    """

    def __init__(self, rank: int, seed: int, split: str = "iid") -> None:
        x, y, _, _ = digits_split()
        if split == "by-label":
            order = torch.sort(y, stable=True).indices
            part = order.tensor_split(WORLD_SIZE)[rank]
            self.x, self.y = x[part], y[part]
        else:
            self.x, self.y = x[rank::WORLD_SIZE], y[rank::WORLD_SIZE]
        self.generator = torch.Generator().manual_seed(seed * 100 + rank)
        self.order = torch.empty(0, dtype=torch.long)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.order.numel() < size:
            self.order = torch.cat([self.order, torch.randperm(self.x.shape[0], generator=self.generator)])
        idx, self.order = self.order[:size], self.order[size:]
        return self.x[idx], self.y[idx]


TEACHER_CLASSES_BY_RANK = ([0, 1, 2], [3, 4, 5], [6, 7], [8, 9])
"""teacher, ``by-label``: the classes each worker's samples are drawn from."""


class TeacherStream:
    """teacher: fresh samples every step; a fixed random tanh network labels Gaussian inputs (10 classes).

    ``iid``: every worker draws from the whole distribution; ``by-label``: worker k keeps only samples of the classes
    ``TEACHER_CLASSES_BY_RANK[k]`` (heterogeneous workers; the objective is the equal mix of the 4 workers' data).
    """

    def __init__(self, rank: int, seed: int, split: str = "iid") -> None:
        g = torch.Generator().manual_seed(12345)  # the same problem for every seed and rank
        self.w1 = torch.randn(64, 32, generator=g) / 8.0
        self.w2 = torch.randn(32, 10, generator=g) / 32**0.5
        self.generator = torch.Generator().manual_seed(seed * 100 + rank)
        self.classes = torch.tensor(TEACHER_CLASSES_BY_RANK[rank]) if split == "by-label" else None

    def batch(self, size: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        generator = generator or self.generator
        xs, ys, have = [torch.empty(0, 64)], [torch.empty(0, dtype=torch.long)], 0
        while have < size:
            x = torch.randn(size if self.classes is None else 4 * size, 64, generator=generator)
            y = (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=1)
            if self.classes is not None:
                keep = torch.isin(y, self.classes)
                x, y = x[keep], y[keep]
            xs.append(x[: size - have])
            ys.append(y[: size - have])
            have += ys[-1].numel()
        return torch.cat(xs), torch.cat(ys)


def data(name: str, rank: int, seed: int, split: str) -> tuple[Any, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(this worker's sampler, the data the loss is measured on, the test data)."""
    if name == "digits":
        x_train, y_train, x_test, y_test = digits_split()
        return Shard(rank, seed, split), (x_train, y_train), (x_test, y_test)
    stream = TeacherStream(rank, seed, split)
    if split == "by-label":  # the objective: an equal mix of every worker's distribution
        parts = [TeacherStream(k, seed, split).batch(2048, torch.Generator().manual_seed(999 + k)) for k in range(4)]
        held_out = (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
    else:
        held_out = stream.batch(8192, torch.Generator().manual_seed(999))
    return stream, held_out, held_out


# -- one run on 4 ranks ----------------------------------------------------------------------------------------------


@torch.no_grad()
def loss_on(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def train(rank: int, world_size: int, name: str, lr: float, seed: int, args: dict[str, Any]) -> dict[str, Any]:
    """One run on this rank; rank 0 returns the loss curve and the final test metrics."""
    steps = args["steps"]
    model = mlp(DIMS, seed)
    wrapped, optimizer = build(name, model, lr)
    # cosine: from lr down to lr/100 at the last step (the slow step divides by the current lr, so never 0)
    decay = (
        (lambda t: 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * t / steps))) if args["schedule"] == "cosine" else None
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay) if decay else None
    sampler, (x_train, y_train), (x_test, y_test) = data(args["data"], rank, seed, args["split"])
    curve = [(0, loss_on(model, x_train, y_train)[0])] if rank == 0 else []
    for step in range(1, steps + 1):
        x, y = sampler.batch(args["batch"])
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
        if name != "sync":
            wrapped.zero_grad(set_to_none=True)
            wrapped.perform_slowmo(optimizer)
        if scheduler is not None:
            scheduler.step()
        if rank == 0 and step % FREQUENCY == 0:
            curve.append((step, loss_on(model, x_train, y_train)[0]))
    if rank != 0:
        return {}
    test_loss, test_acc = loss_on(model, x_test, y_test)
    return {"curve": curve, "train_loss": curve[-1][1], "test_loss": test_loss, "test_acc": test_acc}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (lr, seed, configuration) as a 4-rank job."""
    try:
        lrs, seeds = [float(x) for x in args.lrs.split(",")], [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise UsageError(f"--lrs and --seeds: numbers separated by commas; got {args.lrs!r}, {args.seeds!r}") from None
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if any(n not in CONFIGS for n in names) or "sync" not in names:
        raise UsageError(f"--configs: a subset of {', '.join(CONFIGS)} that includes sync; got {args.configs!r}")
    if args.steps % FREQUENCY:
        raise UsageError(f"--steps must be a multiple of {FREQUENCY}; got {args.steps}")
    job = {k: getattr(args, k) for k in ("data", "steps", "batch", "split", "schedule")}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {f"{lr:g}": {n: [] for n in names} for lr in lrs}
    plan = [(lr, seed, name) for lr in lrs for seed in seeds for name in names]
    for lr, seed, name in progress(plan, desc="slowmo_quality"):
        out = run_distributed(train, WORLD_SIZE, name, lr, seed, job, timeout=600.0, pg_timeout=120.0)[0]
        results[f"{lr:g}"][name].append(out)
    return {"results": results, "verdicts": verdicts(results), "best_lr": best_lr(results)}


# -- the tables and the plot -----------------------------------------------------------------------------------------


def _mean(runs: list[dict[str, Any]], key: str = "train_loss") -> float:
    return statistics.mean(r[key] for r in runs)


def _above(runs: list[dict[str, Any]], sync: list[dict[str, Any]]) -> int:
    return sum(r["train_loss"] > s["train_loss"] for r, s in zip(runs, sync, strict=True))


def verdicts(results: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    out = []
    for lr, by_config in results.items():
        sync = _mean(by_config["sync"])
        rel = {name: _mean(runs) / sync - 1 for name, runs in by_config.items()}
        if "slowmo" not in rel or "localsgd" not in rel:
            continue
        worse = _above(by_config["localsgd"], by_config["sync"]) == len(by_config["sync"])
        two, one = abs(rel["slowmo"]) <= 0.03 and worse, rel["slowmo"] <= 0.03 and worse
        out.append(
            f"lr {lr}: SlowMo {100 * rel['slowmo']:+.1f}% vs sync, local SGD {100 * rel['localsgd']:+.1f}% "
            f"({'worse on every seed' if worse else 'not worse on every seed'}) -> goal "
            f"{'met' if two else 'NOT met'} read as |SlowMo - sync| <= 3%, {'met' if one else 'NOT met'} as <= +3%"
        )
    return out


def best_lr(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Each configuration at the lr where its mean final loss is lowest (a diverged, nan run never is)."""
    best: dict[str, dict[str, Any]] = {}
    for lr, by_config in results.items():
        for name, runs in by_config.items():
            mean = _mean(runs)
            if not math.isnan(mean) and (name not in best or mean < best[name]["loss"]):
                best[name] = {"lr": lr, "loss": mean}
    for entry in best.values():
        entry["vs_sync"] = entry["loss"] / best["sync"]["loss"] - 1 if "sync" in best else None
    return best


def table(report: dict[str, Any]) -> str:
    cfg, figures = report["config"], report["figures"]
    lines = [
        f"{cfg['data']} ({cfg['split']}, {cfg['schedule']} lr): {WORLD_SIZE} workers, {cfg['steps']} steps x "
        f"{cfg['batch']} samples; final loss, mean [min..max] over seeds {cfg['seeds']}",
        "| base lr | configuration | final loss | vs sync | above sync on | test loss | test acc. |",
        "|---|---|---|---|---|---|---|",
    ]
    for lr, by_config in figures["results"].items():
        sync = by_config["sync"]
        for name, runs in by_config.items():
            losses = [r["train_loss"] for r in runs]
            above = "-" if name == "sync" else f"{_above(runs, sync)}/{len(runs)}"
            lines.append(
                f"| {lr} | {CONFIGS[name]['label']} | {_mean(runs):.4f} [{min(losses):.4f}..{max(losses):.4f}] "
                f"| {100 * (_mean(runs) / _mean(sync) - 1):+.1f}% | {above} | {_mean(runs, 'test_loss'):.4f} "
                f"| {_mean(runs, 'test_acc'):.3f} |"
            )
    lines += ["", *figures["verdicts"], "each at its best lr:"]
    for name, b in figures["best_lr"].items():
        lines.append(
            f"  {CONFIGS[name]['label']}: {b['loss']:.4f} at lr {b['lr']} ({100 * b['vs_sync']:+.1f}% vs sync)"
        )
    return "\n".join(lines)


def result_name(args: argparse.Namespace) -> str:
    """slowmo_quality, or slowmo_quality_<data>[_by-label][_cosine] for the other variants."""
    parts = [] if args.data == "digits" else [args.data]
    parts += [args.split] if args.split != "iid" else []
    parts += [args.schedule] if args.schedule != "constant" else []
    if args.data == "digits" and parts:
        parts.insert(0, "digits")
    return "_".join(["slowmo_quality", *parts])


def plot(report: dict[str, Any], out_dir: Path) -> None:
    """One panel per base lr: mean loss against steps over the seeds, with the min..max band."""
    plt = plotting.pyplot()
    results, cfg = report["figures"]["results"], report["config"]
    cols = min(2, len(results))
    rows = (len(results) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.0 * rows), squeeze=False)
    for ax, (lr, by_config) in zip(axes.flat, results.items(), strict=False):
        for name, runs in by_config.items():
            steps = [s for s, _ in runs[0]["curve"]]
            curves = list(zip(*[[loss for _, loss in r["curve"]] for r in runs], strict=True))
            mean = [statistics.mean(c) for c in curves]
            style = CONFIGS[name].get("style", ":")
            (line,) = ax.plot(steps, mean, style, label=f"{CONFIGS[name]['label']} (final {mean[-1]:.3g})")
            ax.fill_between(
                steps, [min(c) for c in curves], [max(c) for c in curves], color=line.get_color(), alpha=0.2
            )
        ax.set(yscale="log", title=f"base lr {lr}", xlabel="step")
        ax.set_ylabel("training loss" if cfg["data"] == "digits" else "held-out loss (fresh data)")
        ax.legend()
    for ax in list(axes.flat)[len(results) :]:
        ax.set_visible(False)
    workload = f"{cfg['data']} ({cfg['split']}, {cfg['schedule']} lr), MLP, SGD(0.9), mean of {len(runs)} seeds"
    fig.suptitle(plotting.title(workload, WORLD_SIZE, report))
    plotting.save(fig, report["benchmark"], out_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", choices=["digits", "teacher"], default="digits", help="data set")
    parser.add_argument("--lrs", default="0.003,0.01,0.03,0.1", help="base learning rates, comma-separated")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="seeds, comma-separated")
    parser.add_argument("--steps", type=int, default=300, help="a multiple of 12 (the teacher figures used 600)")
    parser.add_argument("--batch", type=int, default=16, help="samples per worker and step")
    parser.add_argument("--split", choices=["iid", "by-label"], default="iid", help="how workers share the data")
    parser.add_argument("--schedule", choices=["constant", "cosine"], default="constant", help="base lr schedule")
    parser.add_argument("--configs", default="sync,slowmo,localsgd,slowmo_lr0.3", help="comma-separated subset")
