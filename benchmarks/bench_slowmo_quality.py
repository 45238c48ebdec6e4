"""SlowMo's training quality on 4 workers: synchronous SGD vs SlowMo vs local SGD without slow momentum.

Run::

    python benchmarks/bench_slowmo_quality.py                   # digits, 4 lrs x 5 seeds x 4 configs, ~3 min
    python benchmarks/bench_slowmo_quality.py --data teacher    # streaming synthetic data, ~7 min
    python benchmarks/bench_slowmo_quality.py --lrs 0.03 --seeds 0 1        # a quick look
    python benchmarks/bench_slowmo_quality.py --from-json results.json      # tables and plot again, no training

4 gloo ranks on one machine (`ddpkit.testing.run_distributed`, one thread each), each a node of its own
(``nprocs_per_node=1``); an MLP 64 -> 128 -> 128 -> 10 (ReLU), the same initial weights on every rank; base
optimizer SGD with momentum 0.9 and a constant lr (the paper's local optimizer keeps its momentum); batch 16 per
worker and step. The configurations, with the same base lr, steps, initial weights and data order:

* ``sync``: synchronous SGD, torch DDP (gradients averaged every step);
* ``slowmo``: ddpkit SlowMo, localsgd_frequency=12, slowmo_momentum=0.7, slowmo_frequency=12, slowmo_lr=1
  (the paper's setting: a slow step with every averaging);
* ``localsgd``: the same without slow momentum (slowmo_momentum=0, so SlowMo is off): plain local SGD;
* ``slowmo_lr0.3`` (extra, not in the goal): SlowMo with slowmo_lr=0.3 = 1 - beta, so that its long-run step
  size ``slowmo_lr * lr / (1 - beta)`` equals the base lr: separates the slow momentum from the larger step.

Data (``--data``), nothing downloaded:

* ``digits``: scikit-learn's bundled digits (1797 8x8 images), split 80/20 (stratified, fixed); the training part
  is dealt into 4 disjoint shards, one per worker, each visited in a fresh random order every epoch. The loss is
  the cross-entropy on the whole training set (the objective, as the paper plots); default 300 steps (13 epochs).
* ``teacher``: fresh samples every step from a fixed random tanh network labelling Gaussian inputs (10 classes),
  so nothing can be memorised; the loss is measured on 8192 held-out samples; default 600 steps. With
  ``--split by-label`` each worker draws only from its own 2-3 classes (heterogeneous workers) and the held-out
  samples are an equal mix of the 4 workers' distributions (the objective every configuration minimises).

Every 12 steps (right after the local-SGD replicas have been averaged, so they are equal) rank 0 measures the
loss. Each (base lr, configuration) runs once per seed (initial weights and data order). The table gives the mean
and min..max over seeds of the final loss, the difference of the means from synchronous SGD, and on how many seeds
(paired: same initial weights and data) the configuration ended above synchronous SGD. The goal is checked at each lr in
two readings: SlowMo's mean within 3% of synchronous SGD's either way, or at most 3% above it; both also need
local SGD to end worse than synchronous SGD on every seed. The plot (``--plot``) has a
panel per lr with the mean loss against steps and the min..max band.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WORLD_SIZE = 4
FREQUENCY = 12

CONFIGS: dict[str, dict[str, Any]] = {
    "sync": {"label": "synchronous SGD (torch DDP)", "style": "-"},
    "slowmo": {"label": "SlowMo, freq 12, beta 0.7", "slowmo_momentum": 0.7, "style": "-"},
    "localsgd": {"label": "local SGD, freq 12, no slow momentum", "slowmo_momentum": 0.0, "style": "--"},
    "slowmo_lr0.3": {
        "label": "extra: SlowMo, beta 0.7, slowmo_lr 0.3",
        "slowmo_momentum": 0.7,
        "slowmo_lr": 0.3,
        "style": ":",
    },
}


@lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y) of scikit-learn's digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, stratify=y, random_state=0)
    as_x, as_y = (lambda a: torch.tensor(a, dtype=torch.float32)), (lambda a: torch.tensor(a, dtype=torch.long))
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


class Shard:
    """digits: this worker's part of the training set, visited in a new random order every epoch.

    ``iid``: every 4th sample (each worker sees every class); ``by-label``: the training set sorted by label and cut
    into 4 contiguous parts, so each worker sees 2-3 classes (heterogeneous workers, where local models drift).
    """

    def __init__(self, rank: int, seed: int, split: str = "iid") -> None:
        x, y, _, _ = digits()
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


def data(
    name: str, rank: int, seed: int, split: str = "iid"
) -> tuple[Any, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(this worker's sampler, the data the loss is measured on, the test data)."""
    if name == "digits":
        x_train, y_train, x_test, y_test = digits()
        return Shard(rank, seed, split), (x_train, y_train), (x_test, y_test)
    stream = TeacherStream(rank, seed, split)
    if split == "by-label":  # the objective: an equal mix of every worker's distribution
        parts = [TeacherStream(k, seed, split).batch(2048, torch.Generator().manual_seed(999 + k)) for k in range(4)]
        held_out = (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
    else:
        held_out = stream.batch(8192, torch.Generator().manual_seed(999))
    return stream, held_out, held_out


@torch.no_grad()
def loss_on(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def train(
    rank: int,
    world_size: int,
    dataset: str,
    name: str,
    lr: float,
    seed: int,
    steps: int,
    batch: int,
    split: str = "iid",
    schedule: str = "constant",
) -> dict[str, Any]:
    """One run on this rank; rank 0 returns the training-loss curve and the final test metrics."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpkit.nn import SlowMoDistributedDataParallel

    cfg = CONFIGS[name]
    model = make_model(seed)
    if name == "sync":
        wrapped: nn.Module = DDP(model)
    else:
        wrapped = SlowMoDistributedDataParallel(
            model,
            nprocs_per_node=1,
            localsgd_frequency=FREQUENCY,
            slowmo_frequency=FREQUENCY,
            slowmo_momentum=cfg["slowmo_momentum"],
            slowmo_lr=cfg.get("slowmo_lr", 1.0),
        )
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    # cosine: from lr down to lr/100 at the last step (the slow step divides by the current lr, so never 0)
    decay = (lambda t: 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * t / steps))) if schedule == "cosine" else None
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay) if decay else None
    sampler, (x_train, y_train), (x_test, y_test) = data(dataset, rank, seed, split)
    curve = [(0, loss_on(model, x_train, y_train)[0])] if rank == 0 else []
    for step in range(1, steps + 1):
        x, y = sampler.batch(batch)
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


def summary(runs: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return statistics.mean(values), min(values), max(values)


def print_tables(results: dict[float, dict[str, list[dict[str, Any]]]], args: argparse.Namespace) -> None:
    what = "training loss (whole training set)" if args.data == "digits" else "held-out loss (fresh samples)"
    print(
        f"\n{args.data}: {WORLD_SIZE} workers, {args.steps} steps x {args.batch} samples per worker, "
        f"{len(args.seeds)} seeds; final {what}, mean [min..max] over seeds"
    )
    print(
        "| base lr | configuration | final loss | vs sync (means) | above sync on | test loss | test accuracy |\n"
        "|---|---|---|---|---|---|---|"
    )
    verdicts = []
    for lr, by_config in results.items():
        sync_runs = by_config["sync"]
        sync = summary(sync_runs, "train_loss")[0]
        rel = {}
        for name, runs in by_config.items():
            mean, lo, hi = summary(runs, "train_loss")
            rel[name] = mean / sync - 1
            above = sum(r["train_loss"] > s["train_loss"] for r, s in zip(runs, sync_runs, strict=True))
            print(
                f"| {lr:g} | {CONFIGS[name]['label']} | {mean:.4f} [{lo:.4f}..{hi:.4f}] | "
                f"{100 * rel[name]:+.1f}% | {'-' if name == 'sync' else f'{above}/{len(runs)} seeds'} | "
                f"{summary(runs, 'test_loss')[0]:.4f} | {summary(runs, 'test_acc')[0]:.3f} |"
            )
        local_worse = all(
            r["train_loss"] > s["train_loss"] for r, s in zip(by_config["localsgd"], sync_runs, strict=True)
        )
        two_sided = abs(rel["slowmo"]) <= 0.03 and local_worse
        one_sided = rel["slowmo"] <= 0.03 and local_worse
        verdicts.append(
            f"lr {lr:g}: SlowMo {100 * rel['slowmo']:+.1f}% vs sync, local SGD {100 * rel['localsgd']:+.1f}% "
            f"({'worse on every seed' if local_worse else 'not worse on every seed'}) -> goal "
            f"{'met' if two_sided else 'NOT met'} read as |SlowMo - sync| <= 3%, "
            f"{'met' if one_sided else 'NOT met'} read as SlowMo <= sync + 3%"
        )
    print("\n".join(["", *verdicts, "", *best_lr_verdict(results)]))


def best_lr_verdict(results: dict[float, dict[str, list[dict[str, Any]]]]) -> list[str]:
    """Each configuration at the base lr where its mean final loss is lowest, against synchronous SGD at its own."""
    best: dict[str, tuple[float, list[dict[str, Any]]]] = {}
    for lr, by_config in results.items():
        for name, runs in by_config.items():
            mean = summary(runs, "train_loss")[0]
            if not math.isnan(mean) and (name not in best or mean < summary(best[name][1], "train_loss")[0]):
                best[name] = (lr, runs)  # a diverged run (nan) is never the best
    if "sync" not in best:
        return []
    sync_lr, sync_runs = best["sync"]
    sync = summary(sync_runs, "train_loss")[0]
    lines = [f"each at its best lr: synchronous SGD {sync:.4f} at lr {sync_lr:g}"]
    for name, (lr, runs) in best.items():
        if name != "sync":
            above = sum(r["train_loss"] > s["train_loss"] for r, s in zip(runs, sync_runs, strict=True))
            mean = summary(runs, "train_loss")[0]
            lines.append(
                f"  {CONFIGS[name]['label']}: {mean:.4f} at lr {lr:g}, {100 * (mean / sync - 1):+.1f}%, "
                f"above sync on {above}/{len(runs)} seeds"
            )
    return lines


def plot(results: dict[float, dict[str, list[dict[str, Any]]]], path: str, args: argparse.Namespace) -> None:
    """One panel per base lr: mean training loss against steps over the seeds, with the min..max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(results))
    rows = (len(results) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.0 * rows), squeeze=False)
    for ax, (lr, by_config) in zip(axes.flat, results.items(), strict=False):
        for name, runs in by_config.items():
            steps = [s for s, _ in runs[0]["curve"]]
            curves = list(zip(*[[loss for _, loss in r["curve"]] for r in runs], strict=True))
            mean = [statistics.mean(c) for c in curves]
            label = f"{CONFIGS[name]['label']} (final {mean[-1]:.3g})"
            (line,) = ax.plot(steps, mean, CONFIGS[name]["style"], label=label)
            ax.fill_between(
                steps, [min(c) for c in curves], [max(c) for c in curves], color=line.get_color(), alpha=0.2
            )
        ax.set_yscale("log")
        ax.set_title(f"base lr {lr:g}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss" if args.data == "digits" else "held-out loss (fresh data)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(results) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"{args.data}: MLP, {WORLD_SIZE} workers x batch {args.batch}, SGD(momentum 0.9), mean of {len(args.seeds)} "
        "seeds (band: min..max)",
        fontsize=10,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=["digits", "teacher"], default="digits")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.003, 0.01, 0.03, 0.1], help="base learning rates")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=None, help="a multiple of 12 (default: digits 300, teacher 600)")
    parser.add_argument("--batch", type=int, default=16, help="samples per worker and step")
    parser.add_argument("--split", choices=["iid", "by-label"], default="iid", help="how workers share the data")
    parser.add_argument("--schedule", choices=["constant", "cosine"], default="constant", help="base lr schedule")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--plot", default=None, help="default: benchmarks/figures/slowmo_quality_<data>.png")
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--from-json", default=None, help="print the tables and plot from saved results")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        for key in ("data", "seeds", "steps", "batch", "split", "schedule"):
            setattr(args, key, saved["args"].get(key, getattr(args, key)))
        results = {float(lr): by_config for lr, by_config in saved["results"].items()}
    else:
        args.steps = args.steps or (300 if args.data == "digits" else 600)
        if args.steps % FREQUENCY:
            parser.error(f"--steps must be a multiple of {FREQUENCY}")
        results = run_all(args)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}))
    print_tables(results, args)
    plot(results, args.plot or f"benchmarks/figures/slowmo_quality_{args.data}.png", args)
    return 0


def run_all(args: argparse.Namespace) -> dict[float, dict[str, list[dict[str, Any]]]]:
    """Every (lr, seed, configuration) as a 4-rank job; progress on stdout."""
    from ddpkit.testing import run_distributed

    results: dict[float, dict[str, list[dict[str, Any]]]] = {}
    total, done, began = len(args.lrs) * len(args.configs) * len(args.seeds), 0, time.monotonic()
    for lr in args.lrs:
        results[lr] = {name: [] for name in args.configs}
        for seed in args.seeds:
            for name in args.configs:
                job = (args.data, name, lr, seed, args.steps, args.batch, args.split, args.schedule)
                out = run_distributed(train, WORLD_SIZE, *job, timeout=600.0, pg_timeout=120.0)[0]
                results[lr][name].append(out)
                done += 1
                print(
                    f"[{done}/{total}, {time.monotonic() - began:.0f} s] lr {lr:g} seed {seed} {name:9s} "
                    f"loss {out['train_loss']:.4f}  test accuracy {out['test_acc']:.3f}",
                    flush=True,
                )
    return results


if __name__ == "__main__":
    sys.exit(main())
