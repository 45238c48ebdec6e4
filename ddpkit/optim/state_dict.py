"""Translating optimizer state between a rank's shard and torch's whole-model state-dict format.

torch's format: ``{"state": {index: {name: value}}, "param_groups": [{hyper-parameters, "params": [index]}]}``
where indices count the parameters of all groups in order. OSS saves and loads exactly that, so a checkpoint
does not depend on the world size it was written at, and a plain torch optimizer can load it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

ParamGroups = Sequence[Mapping[str, Any]]


def clone_state(state: Mapping[str, Any], device: torch.device | None = None) -> dict[str, Any]:
    """A copy of one parameter's state that shares nothing with the original (tensors are cloned, other values
    deep-copied), optionally with its tensors moved to `device`."""
    out = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().to(device) if device is not None else value.detach()
            value = value.clone()
        else:
            value = copy.deepcopy(value)
        out[name] = value
    return out


def group_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group's entries except its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def indexed_param_groups(param_groups: ParamGroups) -> list[dict[str, Any]]:
    """torch's saved form of `param_groups`: hyper-parameters plus the global indices of the parameters."""
    out, offset = [], 0
    for group in param_groups:
        count = len(group["params"])
        out.append({**group_hyperparameters(group), "params": list(range(offset, offset + count))})
        offset += count
    return out


def check_compatible(saved: Mapping[str, Any], param_groups: ParamGroups) -> None:
    """Raises a ValueError that says what differs when `saved` cannot be loaded into `param_groups`."""
    if not isinstance(saved, Mapping) or "state" not in saved or "param_groups" not in saved:
        raise ValueError("load_state_dict: expected torch's optimizer format, a dict with 'state' and 'param_groups'")
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"load_state_dict: the state dict has {len(saved_groups)} parameter groups, this optimizer has "
            f"{len(param_groups)}"
        )
    for i, (old, new) in enumerate(zip(saved_groups, param_groups, strict=True)):
        if len(old["params"]) != len(new["params"]):
            raise ValueError(
                f"load_state_dict: parameter group {i} has {len(old['params'])} parameters in the state dict "
                f"and {len(new['params'])} here"
            )
    check_state_shapes(saved, [p for group in param_groups for p in group["params"]])


PER_ELEMENT_STATE = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "sum",
        "square_avg",
        "acc_delta",
        "prev",
        "step_size",
        "ax",
        "grad_avg",
    }
)
"""State entries torch's optimizers keep with exactly their parameter's shape."""


def check_state_shapes(saved: Mapping[str, Any], params: Sequence[torch.Tensor]) -> None:
    """Raises a ValueError naming the parameter and the entry when a state tensor of `saved` (torch's format)
    cannot belong to the parameter it would be loaded into: a per-element entry (`PER_ELEMENT_STATE`) of another
    shape, any tensor with as many elements as the parameter but another shape, or a floating-point parameter
    whose per-element entry is not floating-point. Counting alone is not enough: the state of another model with
    as many parameters would otherwise reach a fused kernel that reads and writes past the tensors' ends.
    `params`: the parameters in the order of ``saved["param_groups"]``."""
    indices = [index for group in saved["param_groups"] for index in group["params"]]
    if len(indices) != len(params):
        raise ValueError(f"load_state_dict: the state dict has {len(indices)} parameters, this optimizer {len(params)}")
    for position, (index, param) in enumerate(zip(indices, params, strict=True)):
        state = saved["state"].get(index)
        if not isinstance(state, Mapping):
            continue
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            per_element = name in PER_ELEMENT_STATE
            if tuple(value.shape) != tuple(param.shape) and (per_element or value.numel() == param.numel()):
                raise ValueError(
                    f"load_state_dict: state {name!r} of parameter {position} has shape {tuple(value.shape)}, the "
                    f"parameter has shape {tuple(param.shape)}: the state dict belongs to another model"
                )
            if per_element and param.is_floating_point() and not value.is_floating_point():
                raise ValueError(
                    f"load_state_dict: state {name!r} of parameter {position} is {value.dtype}, the parameter "
                    f"{param.dtype}: expected floating-point state"
                )


Cuts = Mapping[torch.Tensor, tuple[torch.Tensor, Callable[[dict[str, Any]], dict[str, Any]]]]
"""Per local tensor that is a piece of a parameter: that parameter, and how to cut its saved state to the piece."""


def shard_of(
    saved: Mapping[str, Any], param_groups: ParamGroups, local_groups: ParamGroups, cuts: Cuts | None = None
) -> dict[str, Any]:
    """The local optimizer's state dict for the tensors in `local_groups`, cut out of a whole-model `saved`.

    `param_groups` are the whole model's groups (same order as `saved`), `local_groups` the shard's groups in
    the same order; a local tensor named in `cuts` is a piece of a parameter and gets its share of that
    parameter's state. Hyper-parameters come from `saved`. Tensors are cloned: `saved` is never shared or changed.
    """
    cuts = cuts or {}
    position = {}
    for group, saved_group in zip(param_groups, saved["param_groups"], strict=True):
        for param, index in zip(group["params"], saved_group["params"], strict=True):
            position[param] = index
    state, groups, local_index = {}, [], 0
    for saved_group, local in zip(saved["param_groups"], local_groups, strict=True):
        indices = []
        for tensor in local["params"]:
            param, cut = cuts.get(tensor, (tensor, clone_state))
            saved_state = saved["state"].get(position[param])
            if saved_state is not None:
                state[local_index] = cut(saved_state)
            indices.append(local_index)
            local_index += 1
        groups.append({**group_hyperparameters(saved_group), "params": indices})
    return {"state": state, "param_groups": groups}
