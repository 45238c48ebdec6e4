"""Your own model and data: ``--model PACKAGE.MODULE:FACTORY`` and ``--data PACKAGE.MODULE:FACTORY``.

A *model factory* is any importable function called with no arguments that returns either an ``nn.Module``, or
a pair ``(module, loss_fn)`` where ``loss_fn(output, target)`` returns the scalar loss to minimise. A *data
factory* is any importable function called with no arguments that returns a pair ``(train, held_out)`` of
map-style datasets (``__len__`` and ``__getitem__``) whose items are ``(input, target)``.

The loss, in order of precedence: ``--loss cross_entropy|mse`` when given, else the loss the model factory
returned, else cross-entropy. ``cross_entropy`` takes the class scores on the last dimension when the output has
more dimensions than two (``[B, T, C]`` logits against ``[B, T]`` targets, the language-model layout) and on
dimension 1 otherwise (``[B, C]`` against ``[B]``).

Factories run on every rank after ``torch.manual_seed(seed)`` (the wrappers also copy rank 0's parameters to
the others), so they must build the same datasets everywhere; `check_model_spec`/`check_data_spec` call them once
before any process starts, so a spec that cannot work fails with a message naming the flag.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; class scores on the last dimension for outputs of 3+ dimensions."""
    if output.dim() > 2:
        return F.cross_entropy(output.flatten(0, -2), target.flatten())
    return F.cross_entropy(output, target)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error against a float target of the output's shape."""
    return F.mse_loss(output, target.to(output.dtype))


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}


def load_factory(spec: str, flag: str) -> Callable[[], Any]:
    """The function ``spec`` names; a ValueError/TypeError naming `flag` if it cannot be imported or called."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{flag} {spec!r}: expected PACKAGE.MODULE:FACTORY")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{flag} {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{flag} {spec!r}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{flag} {spec!r}: {attribute!r} is a {type(target).__name__}, not a callable factory")
    return target


def call_factory(spec: str, flag: str) -> Any:
    """Calls the factory `spec` names; an exception it raises comes back naming the flag, the factory and the
    exception's type, with the original as its cause (its traceback shows where in the factory)."""
    factory = load_factory(spec, flag)
    try:
        return factory()
    except Exception as exc:
        raise RuntimeError(f"{flag} {spec!r}: the factory raised {type(exc).__name__}: {exc}") from exc


def build_model(spec: str) -> tuple[nn.Module, LossFn | None]:
    """Calls the model factory `spec`: (module, its loss or None)."""
    made = call_factory(spec, "--model")
    loss = None
    if isinstance(made, tuple) and len(made) == 2:
        made, loss = made
        if not callable(loss):
            raise TypeError(f"--model {spec!r}: the factory's second value must be a loss function, got {loss!r}")
    if not isinstance(made, nn.Module):
        raise TypeError(
            f"--model {spec!r}: the factory must return an nn.Module or (nn.Module, loss_fn); got {type(made).__name__}"
        )
    if not any(p.requires_grad for p in made.parameters()):
        raise ValueError(f"--model {spec!r}: the module has no trainable parameters")
    return made, loss


def _is_dataset(value: object) -> bool:
    return hasattr(value, "__len__") and hasattr(value, "__getitem__")


def build_data(spec: str) -> tuple[Any, Any]:
    """Calls the data factory `spec`: (train, held-out) map-style datasets of (input, target) items."""
    made = call_factory(spec, "--data")
    if not isinstance(made, tuple | list) or len(made) != 2 or not all(_is_dataset(d) for d in made):
        raise TypeError(
            f"--data {spec!r}: the factory must return (train, held_out), two datasets with __len__ and "
            f"__getitem__; got {type(made).__name__}"
        )
    train, held_out = made
    if len(train) == 0 or len(held_out) == 0:
        raise ValueError(f"--data {spec!r}: the training and held-out datasets must not be empty")
    item = train[0]
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise TypeError(f"--data {spec!r}: dataset items must be (input, target) pairs; got {type(item).__name__}")
    return train, held_out


def pick_loss(name: str | None, from_factory: LossFn | None) -> LossFn:
    """``--loss`` when given, else the model factory's loss, else cross-entropy."""
    if name is not None:
        return LOSSES[name]
    return from_factory if from_factory is not None else cross_entropy
