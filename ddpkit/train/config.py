"""Everything `ddpkit train` can be told, with defaults, TOML loading and checks that run before any process."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STRATEGIES = ("ddp", "oss", "sharded", "slowmo")
OPTIMIZERS = ("sgd", "adam", "adamw")
AMP_MODES = ("off", "bf16", "fp16")
DATASETS = ("digits", "mnist", "synthetic", "text")  # or PACKAGE.MODULE:FACTORY (ddpkit.train.factories)
MODELS = ("mlp", "cnn", "gpt")  # or PACKAGE.MODULE:FACTORY
LOSSES = ("cross_entropy", "mse")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}


@dataclass
class TrainConfig:
    """One training run. Field names are the CLI flags with dashes turned into underscores."""

    # what to train
    strategy: str = "sharded"
    optimizer: str = "adam"
    lr: float | None = None  # None: 0.05 for sgd, 1e-3 for adam/adamw
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0
    adascale: bool = False
    amp: str = "off"
    grad_accum: int = 1
    epochs: int = 5
    batch_size: int = 32
    seed: int = 0
    data: str = "digits"
    data_dir: str | None = None
    synthetic_samples: int = 4096
    synthetic_features: int = 64
    synthetic_classes: int = 10
    model: str = "mlp"
    hidden: int = 256
    depth: int = 2
    loss: str | None = None  # cross_entropy | mse; None: the model factory's loss, else cross_entropy
    max_steps: int | None = None  # stop after this many optimizer steps, whatever --epochs says
    # --model gpt (ddpkit.train.gpt) and --data text (ddpkit.train.text)
    gpt_layers: int = 6
    gpt_width: int = 384
    gpt_heads: int = 6
    context: int = 128  # bytes per window of --data text, and the GPT's context
    # SlowMo
    slowmo_momentum: float = 0.5
    slowmo_lr: float = 1.0
    slowmo_frequency: int = 48
    localsgd_frequency: int = 3
    nprocs_per_node_slowmo: int | None = None  # SlowMo's "node" size; None: --nproc-per-node across machines, else 1
    # where it runs
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port on one machine, 29500 across machines
    backend: str = "auto"
    device: str = "auto"  # auto: CUDA with NCCL, else CPU; "cuda" with gloo puts the model on GPUs too
    timeout: float = 60.0
    # outputs
    out: str | None = None
    resume: bool = False
    progress: bool = True

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]


def load_toml(path: str) -> dict[str, Any]:
    """Reads a TOML config (flat keys named like the flags, dashes or underscores) into TrainConfig fields."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path!r}: no such file")
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"--config {path}: unknown setting {key!r}")
        values[name] = value
    return values


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}; got {value!r}")


def _at_least(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {low}; got {value!r}")


def validate(cfg: TrainConfig) -> None:
    """Raises a ValueError (or FileNotFoundError) that names the flag, before any process starts."""
    for name, allowed in (
        ("strategy", STRATEGIES),
        ("optimizer", OPTIMIZERS),
        ("amp", AMP_MODES),
        ("backend", BACKENDS),
        ("device", DEVICES),
    ):
        _choice(name, getattr(cfg, name), allowed)
    from ddpkit.train.workload import validate_workload

    validate_workload(cfg)
    for name in ("grad_accum", "epochs", "batch_size", "nproc_per_node", "nnodes", "hidden", "depth"):
        _at_least(name, getattr(cfg, name), 1)
    for name in ("slowmo_frequency", "localsgd_frequency", "synthetic_samples", "synthetic_features"):
        _at_least(name, getattr(cfg, name), 1)
    _at_least("synthetic_classes", cfg.synthetic_classes, 2)
    _at_least("node_rank", cfg.node_rank, 0)
    if cfg.node_rank >= cfg.nnodes:
        raise ValueError(f"--node-rank {cfg.node_rank} must be smaller than --nnodes {cfg.nnodes}")
    if cfg.master_port is not None and not 0 < cfg.master_port < 65536:
        raise ValueError(f"--master-port must be in 1..65535; got {cfg.master_port}")
    if cfg.timeout <= 0:
        raise ValueError(f"--timeout must be positive (seconds); got {cfg.timeout}")
    if cfg.lr is not None and cfg.lr <= 0:
        raise ValueError(f"--lr must be positive; got {cfg.lr}")
    _validate_combinations(cfg)
    _validate_device(cfg)


def _validate_device(cfg: TrainConfig) -> None:
    if cfg.backend == "nccl" and cfg.device == "cpu":
        raise ValueError("--device cpu needs --backend gloo (NCCL communicates CUDA tensors only)")
    if cfg.device == "cuda" or cfg.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            flag = "--device cuda" if cfg.device == "cuda" else "--backend nccl"
            raise ValueError(f"{flag} needs CUDA, which this machine's PyTorch does not see")


def _validate_combinations(cfg: TrainConfig) -> None:
    if cfg.adascale and cfg.optimizer != "sgd":
        raise ValueError(f"--adascale scales SGD's learning rate: use --optimizer sgd (got {cfg.optimizer})")
    if cfg.adascale and cfg.strategy == "slowmo":
        raise ValueError("--adascale needs gradients averaged every step; it does not combine with --strategy slowmo")
    if cfg.adascale and cfg.amp == "fp16":
        raise ValueError("--adascale measures unscaled gradients: it does not combine with --amp fp16 (use bf16)")
    if cfg.adascale and cfg.world_size * cfg.grad_accum < 2:
        raise ValueError("--adascale needs at least two gradients per step: use 2+ processes or --grad-accum >= 2")
    if cfg.data == "mnist":
        if not cfg.data_dir:
            raise ValueError("--data mnist needs --data-dir PATH holding the four MNIST IDX files")
        from ddpkit.train.data import mnist_paths

        mnist_paths(cfg.data_dir)
    elif cfg.data_dir:
        raise ValueError(f"--data-dir is only read with --data mnist (got --data {cfg.data})")
    if (
        cfg.model == "cnn"
        and cfg.data == "synthetic"
        and round(cfg.synthetic_features**0.5) ** 2 != cfg.synthetic_features
    ):
        raise ValueError("--model cnn on synthetic data needs a square --synthetic-features (e.g. 64 for 8x8)")
    if cfg.strategy == "slowmo":
        node = cfg.nprocs_per_node_slowmo or 1
        if cfg.world_size % node:
            raise ValueError(f"--slowmo-nprocs-per-node {node} must divide the world size {cfg.world_size}")
    if cfg.resume and not cfg.out:
        raise ValueError("--resume needs --out DIR (where the checkpoint was written)")
    if cfg.resume:
        _check_resumable(cfg)


def _check_resumable(cfg: TrainConfig) -> None:
    meta_path = os.path.join(cfg.out or "", "checkpoint", "meta.json")
    if cfg.node_rank != 0:
        return  # only rank 0's machine holds the shared part of the checkpoint
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"--resume: no checkpoint in {os.path.dirname(meta_path)}")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta["world_size"] != cfg.world_size or meta["strategy"] != cfg.strategy:
        raise ValueError(
            f"--resume: the checkpoint was written by --strategy {meta['strategy']} on {meta['world_size']} "
            f"processes; resume with the same (got {cfg.strategy} on {cfg.world_size})"
        )
