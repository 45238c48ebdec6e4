"""SlowMoDistributedDataParallel's argument checks: what is refused, warned about, or must agree between ranks.

Everything here runs before any collective (or, for `agreed_settings`, builds what the one agreement collective
compares), so a wrong argument fails every rank alike with an error that names it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddpkit.distributed.groups import check_nprocs_per_node


def master_params(fp32_params: torch.Tensor | list[torch.Tensor] | dict[Any, torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 master tensors `perform_slowmo` was given: one flat tensor, a list, or a dict of one flat tensor."""
    if isinstance(fp32_params, dict):
        if len(fp32_params) != 1:
            raise ValueError(f"perform_slowmo: a dict fp32_params must hold one flat tensor, got {len(fp32_params)}")
        fp32_params = next(iter(fp32_params.values()))
    return [fp32_params] if isinstance(fp32_params, torch.Tensor) else list(fp32_params)


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"SlowMoDistributedDataParallel: {name} must be an int >= 1, got {value!r}")


def check_settings(
    module: Any, nprocs_per_node: int, world_size: int, localsgd_frequency: int, slowmo_frequency: int
) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"SlowMoDistributedDataParallel: module must be a torch.nn.Module, got {type(module)}")
    check_nprocs_per_node(nprocs_per_node, world_size)
    check_positive_int("localsgd_frequency", localsgd_frequency)
    check_positive_int("slowmo_frequency", slowmo_frequency)


def check_slow_rule(slowmo_momentum: Any, slowmo_lr: Any) -> None:
    if not 0.0 <= slowmo_momentum < 1.0 or slowmo_lr <= 0:
        raise ValueError(
            f"SlowMoDistributedDataParallel: need 0 <= slowmo_momentum < 1 and slowmo_lr > 0, got "
            f"slowmo_momentum={slowmo_momentum}, slowmo_lr={slowmo_lr}"
        )


def agreed_settings(model: Any, num_shards: int) -> dict[str, Any]:
    """The settings every rank must share: ranks with other frequencies would pair collectives of different steps
    (and ranks with another compression, fragment count or delay would exchange messages of other sizes)."""
    names = ("nprocs_per_node", "process_world_size", "localsgd_frequency", "slowmo_frequency", "slowmo_momentum")
    settings = {name: getattr(model, name) for name in names}
    settings.update(slowmo_lr=model.slowmo_lr, slowmo_nesterov=model.rule.nesterov, slowmo_num_shards=num_shards)
    settings.update(slowmo_memory_efficient=model.slowmo_memory_efficient, broadcast_buffers=model.broadcast_buffers)
    settings.update(model.outer_settings.named())
    return settings


def check_step_inputs(module: nn.Module, optimizer: Any, params: list[torch.Tensor], master: bool) -> None:
    """`perform_slowmo`'s inputs: a torch optimizer holding `params`, fp32 tensors, as many as the module has."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"perform_slowmo: optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
    wrong = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if wrong:
        raise ValueError(
            f"perform_slowmo: SlowMo averages fp32 parameters, got {', '.join(wrong)}; train with an fp32 master "
            "copy and pass it as perform_slowmo(optimizer, fp32_params=master_params)"
        )
    expected = sum(p.numel() for p in module.parameters())
    if master and sum(p.numel() for p in params) != expected:
        raise ValueError(
            f"perform_slowmo: fp32_params hold {sum(p.numel() for p in params)} elements, the module's parameters "
            f"{expected}"
        )
    held = {p for group in optimizer.param_groups for p in group["params"]}
    missing = sum(p not in held for p in params)
    if missing:
        what = "fp32_params" if master else "the module's parameters"
        raise ValueError(
            f"perform_slowmo: the optimizer does not hold {missing} of {what}; build it on "
            f"{'those tensors' if master else 'model.parameters()'}"
        )
