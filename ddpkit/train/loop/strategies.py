"""Strategies by name: a model, wrapped for data parallelism, with the optimizer and scaler that go with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.algorithms.gossip_graphs import GRAPHS
from ddpkit.distributed import counting_allreduce_hook, group_rank, group_size
from ddpkit.nn import ShardedDataParallel, SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from ddpkit.optim import OSS, ShardedGradScaler
from ddpkit.train.settings.config import SLOW_LINK_FLAGS, TrainConfig

OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Strategy:
    """What the trainer needs: the model to call, the raw module, the optimizer to step, the scaler."""

    name: str
    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    amp_dtype: torch.dtype | None


def optimizer_arguments(cfg: TrainConfig) -> dict[str, float]:
    """The torch optimizer's arguments: lr and weight decay resolved (AdamW: torch's 0.01 unless --weight-decay
    says otherwise), and SGD's momentum."""
    args = {"lr": cfg.learning_rate, "weight_decay": cfg.resolved_weight_decay}
    if cfg.optimizer == "sgd":
        args["momentum"] = cfg.momentum
    return args


def slowmo_node_size(cfg: TrainConfig) -> int:
    """SlowMo's processes per node: as asked, else the real node size across machines, else 1 (each local
    process acts as a node, so local SGD happens even on one machine)."""
    if cfg.nprocs_per_node_slowmo:
        return cfg.nprocs_per_node_slowmo
    return cfg.nproc_per_node if cfg.nnodes > 1 else 1


def sgp_arguments(cfg: TrainConfig) -> dict[str, Any]:
    """SlowMo's SGP arguments from --slowmo-base sgp, --graph and the rest (none for local SGD)."""
    if cfg.slowmo_base != "sgp":
        return {}
    n = slowmo_node_size(cfg)
    node, local_rank = divmod(group_rank(), n)
    nodes = group_size() // n
    graph = GRAPHS[cfg.graph](node, nodes, n, local_rank, cfg.peers_per_itr) if nodes > 1 else None
    return {
        "slowmo_base_algorithm": SlowMoBaseAlgorithm.SGP,
        "graph": graph,
        "push_sum": cfg.push_sum,
        "overlap": cfg.overlap,
        "synch_freq": cfg.synch_freq,
        "slowmo_sgp_average_params": cfg.slowmo_sgp_average_params,
    }


def slow_link_arguments(cfg: TrainConfig) -> dict[str, Any]:
    """SlowMo's arguments for slow links: compressed, fragmented, delayed pseudo-gradients (local SGD only)."""
    return {name: getattr(cfg, name) for name in SLOW_LINK_FLAGS}


def _ddp(module: nn.Module, device: torch.device) -> DistributedDataParallel:
    """torch DDP whose all-reduce shows in comm_stats. (OSS's `reduce_to_owners_hook` would send fewer bytes,
    but its gloo reduces use one direction of a link at a time: no faster across hosts, and every rank's
    gradients would no longer be DDP's; see benchmarks/README.md, hosts.)"""
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(module, device_ids=ids)
    ddp.register_comm_hook(None, counting_allreduce_hook)
    return ddp


def build_strategy(cfg: TrainConfig, module: nn.Module, device: torch.device) -> Strategy:
    """Wraps `module` (already on `device`) as `cfg.strategy` says; a collective (wrappers sync parameters)."""
    cls = OPTIMIZER_CLASSES[cfg.optimizer]
    args = optimizer_arguments(cfg)
    model: nn.Module
    optimizer: torch.optim.Optimizer
    if cfg.strategy == "ddp":
        model = _ddp(module, device)
        optimizer = cls(module.parameters(), **args)
    elif cfg.strategy == "oss":
        optimizer = OSS(module.parameters(), optim=cls, shared_parameters=cfg.shared_parameters, **args)
        model = _ddp(module, device)
    elif cfg.strategy == "sharded":
        optimizer = OSS(module.parameters(), optim=cls, shared_parameters=cfg.shared_parameters, **args)
        model = ShardedDataParallel(module, optimizer)
    else:
        model = SlowMoDistributedDataParallel(
            module,
            nprocs_per_node=slowmo_node_size(cfg),
            slowmo_momentum=cfg.slowmo_momentum,
            slowmo_lr=cfg.slowmo_lr,
            slowmo_frequency=cfg.slowmo_frequency,
            localsgd_frequency=cfg.localsgd_frequency,
            slowmo_nesterov=cfg.slowmo_nesterov,
            **slow_link_arguments(cfg),
            **sgp_arguments(cfg),
        )
        optimizer = cls(module.parameters(), **args)
    if cfg.adascale:
        from ddpkit.optim import AdaScale

        optimizer = AdaScale(optimizer, num_gradients_to_accumulate=cfg.grad_accum)
    scaler = ShardedGradScaler(device=device.type) if cfg.amp == "fp16" else None
    return Strategy(cfg.strategy, model, module, optimizer, scaler, AMP_DTYPES[cfg.amp])
