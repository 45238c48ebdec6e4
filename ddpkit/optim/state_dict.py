"""Translating optimizer state between a rank's shard and torch's whole-model state-dict format.

torch's format: ``{"state": {index: {name: value}}, "param_groups": [{hyper-parameters, "params": [index]}]}``
where indices count the parameters of all groups in order. OSS saves and loads exactly that, so a checkpoint
does not depend on the world size it was written at, and a plain torch optimizer can load it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
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


def shard_of(saved: Mapping[str, Any], param_groups: ParamGroups, local_groups: ParamGroups) -> dict[str, Any]:
    """The local optimizer's state dict for the parameters in `local_groups`, cut out of a whole-model `saved`.

    `param_groups` are the whole model's groups (same order as `saved`), `local_groups` the shard's groups in
    the same order. Hyper-parameters come from `saved`. Tensors are cloned: `saved` is never shared or changed.
    """
    position = {}
    for group, saved_group in zip(param_groups, saved["param_groups"], strict=True):
        for param, index in zip(group["params"], saved_group["params"], strict=True):
            position[param] = index
    state, groups, local_index = {}, [], 0
    for saved_group, local in zip(saved["param_groups"], local_groups, strict=True):
        indices = []
        for param in local["params"]:
            saved_state = saved["state"].get(position[param])
            if saved_state is not None:
                state[local_index] = clone_state(saved_state)
            indices.append(local_index)
            local_index += 1
        groups.append({**group_hyperparameters(saved_group), "params": indices})
    return {"state": state, "param_groups": groups}
