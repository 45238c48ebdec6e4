"""Ranks that must agree, checked in one small collective: settings, parameter shapes, dtypes and order.

A data-parallel job assumes every rank holds the same model and the same hyper-parameters. When they do not (a
different width, another parameter order, another learning rate or SlowMo frequency on one machine), the first
collective that depends on it hangs, crashes in the backend, or, worse, trains on silently with ranks that
disagree. `check_same_across_ranks` turns that into an error on every rank, before the first such collective,
that names the first setting that differs and which ranks hold which value.

What is communicated: one all-gather of two 8-byte digests (SHA-256 of the ranks' settings, in order, and of the
entries that may differ) per check. Only when the digests differ, which every rank sees alike, do the ranks
all-gather their settings as objects to name the difference; then every rank raises `RanksDisagree` (or warns,
for entries that may differ). Memory: the settings' text, a few bytes per entry.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import warnings
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.distributed import comm
from ddpkit.distributed.env import ProcessGroup, comm_device, group_rank, group_size
from ddpkit.distributed.objects import gather_objects

MAX_NAMED = 3
"""How many differing settings an error names (the first one first)."""
_SMALL_TENSOR = 16


class RanksDisagree(ValueError):
    """Ranks of one group hold different settings or parameters where they must hold the same."""


class CannotCompare(TypeError):
    """A setting whose value ddpkit cannot compare across processes (`canonical` with ``strict=True``)."""


def canonical(value: Any, strict: bool = False) -> str:
    """A text for `value` that is equal on two processes exactly when the values are (no addresses, no salt).

    Compared by value: None, bools, numbers, strings, tuples, lists, dicts, sets, dataclasses (their class and
    fields), enums, tensors of any size (shape, dtype and, past a few elements, a SHA-256 of their bytes), dtypes,
    devices, classes and functions (by qualified name). Anything else has no value ddpkit can compare: its type's
    name stands for it, or with `strict` it raises `CannotCompare`."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(canonical(v, strict) for v in value) + ")"
    if isinstance(value, set | frozenset):
        return "{" + ", ".join(sorted(canonical(v, strict) for v in value)) + "}"
    if isinstance(value, Mapping):
        items = sorted((canonical(k, strict), canonical(value[k], strict)) for k in value)
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={canonical(getattr(value, f.name), strict)}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    if isinstance(value, torch.Tensor):
        head = f"tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        if value.numel() <= _SMALL_TENSOR:
            return f"{head} {value.detach().cpu().tolist()}"
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"{head} sha256 {hashlib.sha256(data).hexdigest()[:32]}"
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if strict:
        raise CannotCompare(
            f"a {type(value).__qualname__} cannot be compared across processes; give a str, number, bool, None, "
            "a tuple, list, dict or set of those, a dataclass, an enum, a tensor, a dtype or a device (or a text "
            "that stands for the value)"
        )
    return type(value).__qualname__


def _digest(entries: list[tuple[str, str]]) -> int:
    h = hashlib.sha256()
    for key, value in entries:
        h.update(f"{len(key)}:{key}={len(value)}:{value};".encode())
    return int.from_bytes(h.digest()[:8], "big", signed=True)


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def describe_differences(per_rank: list[dict[str, str]], limit: int = MAX_NAMED) -> list[str]:
    """Per differing key (in the first rank's order, then keys only others have): which ranks hold which value."""
    keys = list(dict.fromkeys(k for entries in per_rank for k in entries))
    lines = []
    for key in keys:
        holders: dict[str, list[int]] = {}
        for rank, entries in enumerate(per_rank):
            holders.setdefault(entries.get(key, "(none)"), []).append(rank)
        if len(holders) > 1:
            values = "; ".join(f"{value} on {_ranks_text(ranks)}" for value, ranks in holders.items())
            lines.append(f"{key}: {values}")
        if len(lines) == limit:
            break
    return lines


def _texts(settings: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, str]]:
    items = settings.items() if isinstance(settings, Mapping) else settings
    return [(str(k), v if isinstance(v, str) else canonical(v)) for k, v in items]


def check_same_across_ranks(
    settings: Mapping[str, Any] | Iterable[tuple[str, Any]],
    group: ProcessGroup | None = None,
    what: str = "job",
    advisory: Iterable[tuple[str, Any]] = (),
) -> None:
    """Raises `RanksDisagree` on every rank of `group` unless every rank passed equal `settings` (a collective).

    `settings` maps a name ("--lr", "parameter 3") to a value; values are compared by `canonical` text and in
    order. The error names up to `MAX_NAMED` differing settings, the first one first, with each value's ranks.
    `advisory` entries may differ (a per-rank entry of a param group that no optimizer reads): when they do, every
    rank warns, naming them and their ranks. Both digests travel in the one all-gather.
    """
    entries, optional = _texts(settings), _texts(advisory)
    if not dist.is_initialized() or group_size(group) < 2:
        return
    device = comm_device(group)
    digests = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(group_size(group))]
    mine = torch.tensor([_digest(entries), _digest(optional)], dtype=torch.int64, device=device)
    comm.all_gather(digests, mine, group)
    required_differ = len({int(d[0].item()) for d in digests}) > 1
    optional_differ = len({int(d[1].item()) for d in digests}) > 1
    if not required_differ and not optional_differ:
        return
    everyone = gather_objects(dict(entries if required_differ else optional), dst=-1, group=group)
    assert everyone is not None
    lines = describe_differences(everyone) or ["the same settings in another order"]
    me = group_rank(group)
    if required_differ:
        raise RanksDisagree(f"{what}: ranks disagree (seen from rank {me}): " + " | ".join(lines))
    warnings.warn(
        f"{what}: param group entries that the optimizer does not read differ across ranks (seen from rank {me}): "
        + " | ".join(lines)
        + "; accepted (pass check_agreement=False to skip the check)",
        stacklevel=3,
    )


def parameter_settings(
    params: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    known_keys: Collection[str] | None = None,
) -> list[tuple[str, str]]:
    """What must agree about `params`: their number, and per position its name (when a module gives names),
    shape, dtype and whether it is trained; for param groups also each group's size and hyper-parameters (with
    `known_keys`, only those keys: the others are `param_group_extras`)."""
    if isinstance(params, nn.Module):
        named: list[tuple[str | None, torch.Tensor]] = [(n, p) for n, p in params.named_parameters()]
        groups: list[dict[str, Any]] = []
    else:
        listed = list(params)
        groups = [g for g in listed if isinstance(g, dict)]
        tensors = [p for g in groups for p in g["params"]] if groups else listed
        named = [(None, p) for p in tensors]
    entries = [("number of parameters", str(len(named)))]
    for index, (name, p) in enumerate(named):
        trained = "trained" if p.requires_grad else "frozen"
        text = f"shape {tuple(p.shape)}, {str(p.dtype).removeprefix('torch.')}, {trained}"
        entries.append((f"parameter {index}", f"{name}: {text}" if name else text))
    for index, group in enumerate(groups):
        entries.append((f"param group {index} size", str(len(group["params"]))))
        for key in sorted(k for k in group if k != "params" and (known_keys is None or k in known_keys)):
            entries.append((f"param group {index} {key}", canonical(group[key])))
    return entries


def optimizer_settings(optimizers: list[torch.optim.Optimizer], first: int = 0) -> dict[str, Any]:
    """What every replica's optimizers must share, for `Manager.require_same`: each one's class and, per param
    group, its size and hyper-parameters (``"optimizer 0 group 1 lr"`` -> 0.1), numbered from `first`.

    Args:
        optimizers: the optimizers, in the order every replica creates them.
        first: the number of the first of them (an optimizer set up after others).

    Returns:
        name -> value, every hyper-parameter as its `canonical` text (any value is accepted).
    """
    settings: dict[str, Any] = {}
    for index, optimizer in enumerate(optimizers, start=first):
        settings[f"optimizer {index}"] = type(optimizer)
        for g, group in enumerate(optimizer.param_groups):
            settings[f"optimizer {index} group {g} size"] = len(group["params"])
            for key in sorted(k for k in group if k != "params"):
                settings[f"optimizer {index} group {g} {key}"] = canonical(group[key])  # (any value: by its text)
    return settings


def param_group_extras(groups: Iterable[dict[str, Any]], known_keys: Collection[str]) -> list[tuple[str, str]]:
    """The entries of param `groups` outside `known_keys` (the optimizer's hyper-parameters): a per-rank `rank`
    or a name that may differ between ranks without harm."""
    return [
        (f"param group {index} {key}", canonical(group[key]))
        for index, group in enumerate(groups)
        for key in sorted(k for k in group if k != "params" and k not in known_keys)
    ]


def check_parameters_agree(
    params: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    group: ProcessGroup | None = None,
    what: str = "parameters",
    extra: Mapping[str, Any] | None = None,
    known_keys: Collection[str] | None = None,
) -> None:
    """Raises `RanksDisagree` on every rank unless all ranks of `group` hold parameters of the same number, shapes,
    dtypes and order (and names, for a module; sizes and hyper-parameters, for param groups), and equal `extra`
    settings: one all-gather of 16 bytes per rank (a collective). `what` names the caller in the error. With
    `known_keys` (an optimizer's hyper-parameters), other keys of param groups only warn when they differ."""
    if not isinstance(params, nn.Module):
        params = list(params)  # read twice below: an iterator would be empty the second time
    entries: list[tuple[str, Any]] = [*(extra or {}).items(), *parameter_settings(params, known_keys)]
    advisory: list[tuple[str, str]] = []
    if known_keys is not None and not isinstance(params, nn.Module):
        advisory = param_group_extras([g for g in params if isinstance(g, dict)], known_keys)
    check_same_across_ranks(entries, group, what, advisory)
