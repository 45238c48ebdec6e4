"""GPU: step time, CUDA memory per rank (parameters, gradients, optimizer state) and bytes per step of DDP,
torch's ZeroRedundancyOptimizer, torch FSDP2 (``fully_shard``, ``reshard_after_forward=False``: ZeRO-2), ddpkit
OSS + DDP (ZeRO-1) and ddpkit OSS + ShardedDataParallel (ZeRO-2), on the 8.4M-parameter MLP and a 100M-parameter GPT.

Every strategy trains with Adam (fused, lr 1e-4) in the same pool of gloo ranks placed on the GPUs
(``run_distributed(device="cuda")``): with one GPU, all ranks share it, so the step time includes their
contention for it and gloo's trips through host memory, and says little about a machine with one GPU per rank
(there NCCL would be used); the memory per rank does not depend on that. Measured per strategy, max over ranks:

* step time: median over the timed steps of zero_grad + forward + backward + optimizer step, with the GPU
  synchronised before and after each step (after a barrier, not timed);
* peak memory: ``torch.cuda.max_memory_allocated`` over the run (the rank's own allocations, reset before the
  strategy is built), and what the rank holds after the last backward: parameters (FSDP2: its shards), gradients
  (``.grad``; ShardedDataParallel: the owned ones), and after the last step the optimizer state; "other" is the
  rest of the peak: activations, communication buckets, FSDP2's unsharded parameters between forward and backward;
* bytes sent per step and rank in ddpkit's wire model (DDP through a counting hook, torch ZeRO and FSDP2 through
  counting shims on torch's Python collectives; host staging of ddpkit on gloo sends nothing and is not bytes);
* a fingerprint of the final parameters (sum and sum of squares) against DDP's and between ranks.

``--device cpu`` runs the same on CPU (no CUDA memory figures) to check the benchmark itself without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.lib import plotting, workloads
from benchmarks.lib.cli import progress
from benchmarks.lib.counting import install_counting_shim
from benchmarks.lib.tables import markdown, num
from ddpkit.distributed import comm_stats, counting_allreduce_hook
from ddpkit.distributed.stats import CommStats, wire_bytes
from ddpkit.testing import rank_device, run_distributed
from ddpkit.train.loop.strategies import build_strategy
from ddpkit.train.settings.config import TrainConfig
from ddpkit.train.workloads.gpt import GPTConfig, gpt, parameter_count

QUESTION = "GPU: step time, CUDA memory (params/grads/state) and bytes of DDP, torch ZeRO, FSDP2 and ddpkit"
QUICK = {"world_size": 2, "steps": 2, "warmup": 1, "workloads": "mlp,gpt", "device": "cpu"}
LR = 1e-4
MB = 2**20
PYTHON_STATS = CommStats()  # collectives torch's ZeRO and FSDP2 call from Python, per rank process
GOAL_MEMORY, GOAL_STEP = 1.0, 1.1  # ddpkit ZeRO-2 against FSDP2's ZeRO-2: peak memory at most 1x, step time 1.1x


# -- workloads ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTBytes:
    """`ddpkit.train.workloads.gpt` on random byte sequences: the text workload's model (the data changes neither the
    step time nor the memory)."""

    config: GPTConfig
    name: str = "gpt"

    def describe(self) -> str:
        c = self.config
        return f"GPT {c.layers}x{c.width}, context {c.context} ({parameter_count(c):,} parameters), random bytes"

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return gpt(self.config)

    def batches(self, seed: int, rank: int, count: int, batch: int) -> list[workloads.Batch]:
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        tokens = [torch.randint(0, 256, (batch, self.config.context + 1), generator=g) for _ in range(count)]
        return [(t[:, :-1], t[:, 1:]) for t in tokens]

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def workload(name: str, quick: bool) -> tuple[workloads.Workload, int]:
    """The workload and its batch per rank."""
    if name == "gpt":
        config = GPTConfig(layers=2, width=64, heads=2, context=32) if quick else GPTConfig.preset("100m")
        return GPTBytes(config), 2 if quick else 4
    return workloads.workload(name, quick=quick), 8 if quick else 32


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one (then the root): the GPT's blocks, or an MLP's linear layers."""
    blocks = getattr(model, "blocks", None)
    return list(blocks) if blocks is not None else [m for m in model.modules() if isinstance(m, nn.Linear)]


# -- the strategies -----------------------------------------------------------------------------------------------


@dataclass
class Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    local_optimizer: torch.optim.Optimizer


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR, fused=True)


def _ddp(model: nn.Module, device: torch.device) -> DDP:
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    ddp.register_comm_hook(None, counting_allreduce_hook)  # its C++ all-reduce then shows in comm_stats
    return ddp


def _plain_ddp(model: nn.Module, device: torch.device) -> Setup:
    ddp = _ddp(model, device)
    optimizer = _adam(ddp.parameters())
    return Setup(ddp, optimizer, optimizer)


def _zero(model: nn.Module, device: torch.device) -> Setup:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = _ddp(model, device)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=LR, fused=True)
    return Setup(ddp, optimizer, optimizer.optim)


def _fsdp2(model: nn.Module, device: torch.device) -> Setup:
    from torch.distributed.fsdp import fully_shard

    for unit in shard_units(model):
        fully_shard(unit, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    optimizer = _adam(model.parameters())
    return Setup(model, optimizer, optimizer)


def _ddpkit(strategy: str) -> Callable[[nn.Module, torch.device], Setup]:
    def build(model: nn.Module, device: torch.device) -> Setup:
        built = build_strategy(TrainConfig(strategy=strategy, optimizer="adam", lr=LR), model, device)
        return Setup(built.model, built.optimizer, getattr(built.optimizer, "optim", built.optimizer))

    return build


STRATEGIES: dict[str, tuple[str, Callable[[nn.Module, torch.device], Setup]]] = {
    "ddp": ("torch DDP + Adam (baseline)", _plain_ddp),
    "zero": ("torch DDP + ZeroRedundancyOptimizer (ZeRO-1)", _zero),
    "fsdp2": ("torch FSDP2, reshard_after_forward=False (ZeRO-2)", _fsdp2),
    "oss_ddp": ("ddpkit OSS + torch DDP (ZeRO-1)", _ddpkit("oss")),
    "oss_sdp": ("ddpkit OSS + ShardedDataParallel (ZeRO-2)", _ddpkit("sharded")),
}


# -- one rank -------------------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard, else the tensor


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = _local(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


TENSOR_COLLECTIVES = {  # FSDP2's, by torch version: name -> kind in ddpkit's wire model
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
}


def _counting_tensor_collectives(stats: CommStats) -> None:
    """Counts FSDP2's single-tensor all-gathers and reduce-scatters (by their input) in ddpkit's wire model."""
    for name, kind in TENSOR_COLLECTIVES.items():
        original = getattr(dist, name, None)
        if original is None or getattr(original, "_bench_shim", False):
            continue

        def shim(*args: Any, _original: Callable = original, _kind: str = kind, **kwargs: Any) -> Any:
            tensor = kwargs.get("input_tensor", kwargs.get("input", args[1] if len(args) > 1 else None))
            payload = tensor.numel() * tensor.element_size()
            n = dist.get_world_size(kwargs.get("group"))
            stats.record(_kind, "python", payload, wire_bytes(_kind, payload, n))
            return _original(*args, **kwargs)

        shim._bench_shim = True  # type: ignore[attr-defined]
        setattr(dist, name, shim)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fingerprint(model: nn.Module, device: torch.device) -> list[float]:
    """(sum, sum of squares) of the whole model's parameters, in float64, the same on every rank."""
    sharded = [p for p in model.parameters() if hasattr(p, "to_local")]
    local = [_local(p).detach().double() for p in model.parameters()]
    values = torch.stack([sum(t.sum() for t in local), sum((t * t).sum() for t in local)]).to(device)
    if sharded:
        dist.all_reduce(values)  # each rank holds its shards: their sums add up to the whole model's
    return values.cpu().tolist()


def run_rank(rank: int, world_size: int, key: str, work: workloads.Workload, cfg: dict[str, Any]) -> dict:
    device = rank_device()
    install_counting_shim(PYTHON_STATS)
    _counting_tensor_collectives(PYTHON_STATS)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    setup = STRATEGIES[key][1](work.model(cfg["seed"]).to(device), device)
    made = work.batches(cfg["seed"], rank, cfg["warmup"] + 1, cfg["batch"])
    batches = [(x.to(device), y.to(device)) for x, y in made]
    times, held = [], {}
    for i in range(cfg["warmup"] + cfg["steps"]):
        x, y = batches[min(i, cfg["warmup"])]  # the timed steps reuse one batch: no host-to-GPU copy timed
        if i == cfg["warmup"]:
            comm_stats.reset()
            PYTHON_STATS.reset()
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        setup.model.zero_grad(set_to_none=True)
        work.loss(setup.model(x), y).backward()
        if i == cfg["warmup"] + cfg["steps"] - 1:
            params = list(setup.model.parameters())
            held["params"] = _bytes(params)
            held["grads"] = _bytes(p.grad for p in params)
        setup.optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    held["state"] = _bytes(v for s in setup.local_optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    sent = (comm_stats.total().sent_bytes + PYTHON_STATS.total().sent_bytes) / cfg["steps"]
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    counted = comm_stats.calls() + PYTHON_STATS.calls() > 0
    fingerprint = _fingerprint(setup.model, device)
    del setup, batches
    return {
        "step_ms": 1e3 * statistics.median(times[cfg["warmup"] :]),
        "peak_mb": None if peak is None else peak / MB,
        **{f"{k}_mb": v / MB for k, v in held.items()},
        "sent_mb_per_step": sent / MB if counted else None,
        "fingerprint": fingerprint,
    }


# -- every strategy on every workload -------------------------------------------------------------------------------


def measure(key: str, work: workloads.Workload, cfg: dict[str, Any]) -> dict[str, Any]:
    """One strategy on the shared pool of ranks: max over ranks, and whether the ranks agree."""
    ranks = run_distributed(
        run_rank, cfg["world_size"], key, work, cfg, device=cfg["device"], timeout=cfg["timeout"], pg_timeout=300
    )
    row: dict[str, Any] = {"key": key, "label": STRATEGIES[key][0]}
    for field in ("step_ms", "peak_mb", "params_mb", "grads_mb", "state_mb", "sent_mb_per_step"):
        values = [r[field] for r in ranks]
        row[field] = None if None in values else max(values)
    held = row["params_mb"] + row["grads_mb"] + row["state_mb"]
    row["other_mb"] = None if row["peak_mb"] is None else row["peak_mb"] - held
    prints = [r["fingerprint"] for r in ranks]
    row["fingerprint"] = prints[0]
    row["ranks_agree"] = all(_close(p, prints[0], 1e-9) for p in prints)
    return row


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return all(abs(x - y) <= rel * max(abs(x), abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ratios against DDP, and whether each strategy computed DDP's parameters (fingerprint within 1e-5)."""
    base = next((r for r in rows if r["key"] == "ddp"), None)
    for row in rows:
        row["step_vs_ddp"] = _ratio(row["step_ms"], base and base["step_ms"])
        row["peak_vs_ddp"] = _ratio(row["peak_mb"], base and base["peak_mb"])
        row["same_as_ddp"] = None if base is None else _close(row["fingerprint"], base["fingerprint"], 1e-5)
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    keys = [k.strip() for k in args.strategies.split(",") if k.strip()]
    unknown = [k for k in keys if k not in STRATEGIES]
    if unknown or not keys:
        raise ValueError(f"--strategies: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(STRATEGIES)}")
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    by_workload, skipped = {}, {}
    for name in names:
        work, batch = workload(name, args.quick)
        cfg = {"world_size": args.world_size, "steps": args.steps, "warmup": args.warmup, "seed": 0}
        cfg.update(batch=args.batch or batch, device=device, timeout=args.timeout)
        rows = []
        for key in progress(keys, desc=f"gpu {name}"):
            try:
                rows.append(measure(key, work, cfg))
            except Exception as exc:  # e.g. a torch strategy that gloo cannot carry on CUDA: report it, go on
                skipped[f"{name}/{key}"] = f"{type(exc).__name__}: {str(exc).strip()[-400:]}"
                print(f"{name}/{key} failed: {skipped[f'{name}/{key}']}", flush=True)
        by_workload[name] = {"workload": work.describe(), "batch": cfg["batch"], "rows": compare(rows)}
    return {
        "device": device,
        "gpus": torch.cuda.device_count() if device == "cuda" else 0,
        "world_size": args.world_size,
        "by_workload": by_workload,
        "skipped": skipped,
        "verdict": {name: verdict(w["rows"]) for name, w in by_workload.items()},
    }


def verdict(rows: list[dict[str, Any]]) -> str:
    """ddpkit's ZeRO-2 against FSDP2's: peak memory at most 1x, step time at most 1.1x."""
    at = {r["key"]: r for r in rows}
    if "oss_sdp" not in at or "fsdp2" not in at or at["fsdp2"]["peak_mb"] is None:
        return "ddpkit ZeRO-2 against FSDP2: not measured (FSDP2 did not run, or no CUDA memory figures)"
    ours, theirs = at["oss_sdp"], at["fsdp2"]
    memory, step = ours["peak_mb"] / theirs["peak_mb"], ours["step_ms"] / theirs["step_ms"]
    met = "met" if memory <= GOAL_MEMORY and step <= GOAL_STEP else "NOT met"
    goal = f"goal <= {GOAL_MEMORY}, <= {GOAL_STEP}"
    return f"ddpkit ZeRO-2 / FSDP2: peak memory {memory:.2f}x, step time {step:.2f}x ({goal}): {met}"


# -- the table and the plot -------------------------------------------------------------------------------------------


HEADER = ["strategy", "step ms", "x DDP", "peak MB", "x DDP", "params MB", "grads MB", "opt state MB", "other MB"]
HEADER += ["sent MB/step", "same as DDP"]


def _row(r: dict[str, Any]) -> list[str]:
    same = {None: "-", True: "yes", False: "NO"}[r["same_as_ddp"]] + ("" if r["ranks_agree"] else " (ranks differ)")
    mb = [num(r[f], ".0f") for f in ("peak_mb",)] + [num(r["peak_vs_ddp"])]
    parts = [num(r[f], ".1f") for f in ("params_mb", "grads_mb", "state_mb", "other_mb")]
    return [r["label"], f"{r['step_ms']:.1f}", num(r["step_vs_ddp"]), *mb, *parts, num(r["sent_mb_per_step"]), same]


def table(report: dict[str, Any]) -> str:
    f = report["figures"]
    where = f"{f['world_size']} gloo ranks on {f['gpus']} GPU(s)" if f["device"] == "cuda" else "CPU (no CUDA memory)"
    out = [f"{where}, {report['machine'].get('gpu') or 'no GPU'}; Adam (fused) lr {LR}; per rank, max over ranks"]
    for name, w in f["by_workload"].items():
        out += ["", f"{w['workload']}; batch {w['batch']}/rank", markdown(HEADER, [_row(r) for r in w["rows"]])]
        out.append(f"verdict ({name}): {f['verdict'][name]}")
    out += [f"skipped {k}: {why}" for k, why in f["skipped"].items()]
    return "\n".join(out)


def plot(report: dict[str, Any], out_dir: Path) -> None:
    """Per workload: memory per rank by part (stacked) and step time, per strategy."""
    plt = plotting.pyplot()
    f = report["figures"]
    fig, axes = plt.subplots(len(f["by_workload"]), 2, figsize=(13, 4 * len(f["by_workload"])), squeeze=False)
    for (name, w), (left, right) in zip(f["by_workload"].items(), axes, strict=True):
        labels = [r["key"] for r in w["rows"]]
        start = [0.0] * len(labels)
        for part in ("params_mb", "grads_mb", "state_mb", "other_mb"):
            sizes = [r[part] or 0.0 for r in w["rows"]]
            left.barh(labels, sizes, left=start, label=part.removesuffix("_mb"))
            start = [a + b for a, b in zip(start, sizes, strict=True)]
        left.set(xlabel="MB per rank (peak = sum)", title=f"{name}: memory")
        left.legend()
        right.barh(labels, [r["step_ms"] for r in w["rows"]])
        right.set(xlabel="step ms", title=f"{name}: step time")
    workloads_run = "; ".join(w["workload"] for w in f["by_workload"].values())
    fig.suptitle(plotting.title(workloads_run, f["world_size"], report))
    plotting.save(fig, "gpu", out_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks, shared out over the GPUs")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--workloads", default="mlp,gpt", help="mlp (8.4M parameters) and/or gpt (100M)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=None, help="samples per rank (mlp 32, gpt 4 sequences)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="cpu: check it on CPU")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per strategy")
