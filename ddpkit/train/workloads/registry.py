"""The built-in models, datasets and losses, by name: what each builds and what it checks.

`ddpkit.train.settings.config` reads the names from here (for its flags and messages) and `workload` the
builders and checks, so neither imports the other at import time. Builders import their modules when called,
which keeps this table cheap to import (``ddpkit --help`` reads it). A model or dataset of your own needs no
entry: pass ``PACKAGE.MODULE:FACTORY`` (`ddpkit.train.workloads.factories`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from ddpkit.train.settings.config import TrainConfig
    from ddpkit.train.workloads.data import Data


@dataclass(frozen=True)
class DataEntry:
    """A built-in dataset: `build(cfg)` returns (train, held-out) and, for classification data, its `Data`."""

    build: Callable[[TrainConfig], tuple[Any, Any, Data | None]]


@dataclass(frozen=True)
class ModelEntry:
    """A built-in model: `build(cfg, data)` (data: the classification `Data`, or None) and `check(cfg)`, which
    refuses data it cannot read, naming the flags."""

    build: Callable[[TrainConfig, Data | None], nn.Module]
    check: Callable[[TrainConfig], None]


def _classification(load: Callable[[TrainConfig], Data]) -> Callable[[TrainConfig], tuple[Any, Any, Data | None]]:
    def build(cfg: TrainConfig) -> tuple[Any, Any, Data | None]:
        data = load(cfg)
        return data.train, data.test, data

    return build


def _digits(cfg: TrainConfig) -> Data:
    from ddpkit.train.workloads.data import digits

    return digits(cfg.seed)


def _mnist(cfg: TrainConfig) -> Data:
    from ddpkit.train.workloads.data import mnist

    assert cfg.data_dir is not None
    return mnist(cfg.data_dir)


def _synthetic(cfg: TrainConfig) -> Data:
    from ddpkit.train.workloads.data import synthetic

    return synthetic(cfg.synthetic_samples, cfg.synthetic_features, cfg.synthetic_classes, cfg.seed)


def _text(cfg: TrainConfig) -> tuple[Any, Any, Data | None]:
    from ddpkit.train.workloads.text import text

    train, heldout = text(cfg.context)
    return train, heldout, None


def _mlp(cfg: TrainConfig, data: Data | None) -> nn.Module:
    from ddpkit.train.workloads.models import mlp

    assert data is not None
    return mlp(data.num_features, data.num_classes, cfg.hidden, cfg.depth)


def _cnn(cfg: TrainConfig, data: Data | None) -> nn.Module:
    from ddpkit.train.workloads.models import small_cnn

    assert data is not None
    if data.image_shape is None:
        raise ValueError("--model cnn needs image-shaped data")
    return small_cnn(data.image_shape, data.num_classes)


def _gpt(cfg: TrainConfig, data: Data | None) -> nn.Module:
    from ddpkit.train.workloads.gpt import gpt

    return gpt(gpt_config(cfg))


def gpt_config(cfg: TrainConfig) -> Any:
    """The `GPTConfig` that --gpt-layers, --gpt-width, --gpt-heads and --context describe."""
    from ddpkit.train.workloads.gpt import GPTConfig

    return GPTConfig(layers=cfg.gpt_layers, width=cfg.gpt_width, heads=cfg.gpt_heads, context=cfg.context)


def check_gpt_flags(cfg: TrainConfig) -> None:
    flags = (("gpt-layers", cfg.gpt_layers), ("gpt-width", cfg.gpt_width), ("gpt-heads", cfg.gpt_heads))
    for flag, value in (*flags, ("context", cfg.context)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{flag} must be an integer >= 1; got {value!r}")
    if cfg.gpt_width % cfg.gpt_heads:
        raise ValueError(f"--gpt-width {cfg.gpt_width} must be divisible by --gpt-heads {cfg.gpt_heads}")


def _check_classifier(cfg: TrainConfig) -> None:
    if cfg.data not in CLASSIFICATION_DATA:
        raise ValueError(
            f"--model {cfg.model} classifies --data {'|'.join(CLASSIFICATION_DATA)}; for --data {cfg.data} use "
            "--model gpt (with --data text) or your own --model PACKAGE.MODULE:FACTORY"
        )


def _check_byte_model(cfg: TrainConfig) -> None:
    if cfg.data in CLASSIFICATION_DATA:
        raise ValueError(f"--model gpt reads byte sequences: use --data text or a factory, not --data {cfg.data}")


CLASSIFICATION_DATA = ("digits", "mnist", "synthetic")
DATASETS: dict[str, DataEntry] = {
    "digits": DataEntry(_classification(_digits)),
    "mnist": DataEntry(_classification(_mnist)),
    "synthetic": DataEntry(_classification(_synthetic)),
    "text": DataEntry(_text),
}
MODELS: dict[str, ModelEntry] = {
    "mlp": ModelEntry(_mlp, _check_classifier),
    "cnn": ModelEntry(_cnn, _check_classifier),
    "gpt": ModelEntry(_gpt, _check_byte_model),
}
LOSSES = ("cross_entropy", "mse")  # their functions: `ddpkit.train.workloads.factories.LOSSES`


def is_spec(value: object) -> bool:
    """Whether `value` names a factory (``package.module:function``) rather than a built-in."""
    return isinstance(value, str) and ":" in value


def check_workload_flags(cfg: TrainConfig) -> None:
    """Checks --model, --data, --loss, --max-steps and the GPT's shape without importing a model or torch (a
    factory's output is checked by `ddpkit.train.workloads.workload.check_factories`). Raises a ValueError naming
    the flag."""
    _check_names(cfg)
    _check_pairing(cfg)
    check_gpt_flags(cfg)


def _check_names(cfg: TrainConfig) -> None:
    for flag, value, allowed in (("model", cfg.model, MODELS), ("data", cfg.data, DATASETS)):
        if not is_spec(value) and value not in allowed:
            raise ValueError(f"--{flag} must be one of {', '.join(allowed)} or PACKAGE.MODULE:FACTORY; got {value!r}")
    if cfg.loss is not None and cfg.loss not in LOSSES:
        raise ValueError(f"--loss must be one of {', '.join(LOSSES)}; got {cfg.loss!r}")
    if cfg.max_steps is not None and (not isinstance(cfg.max_steps, int) or cfg.max_steps < 1):
        raise ValueError(f"--max-steps must be an integer >= 1; got {cfg.max_steps!r}")


def _check_pairing(cfg: TrainConfig) -> None:
    if cfg.model in MODELS:
        MODELS[cfg.model].check(cfg)
    if cfg.loss == "mse" and (cfg.model == "gpt" or cfg.data == "text"):
        raise ValueError("--loss mse needs float targets; --model gpt and --data text predict bytes (cross_entropy)")
