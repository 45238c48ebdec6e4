"""What `ddpkit train` and `ddpkit bench` train: a model, its loss and (train, held-out) data, from built-in names
(``mlp``/``cnn`` on ``digits``/``mnist``/``synthetic``, ``gpt`` on ``text``) or from factories
(``PACKAGE.MODULE:FACTORY``, see `ddpkit.train.factories`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit.train import factories
from ddpkit.train.config import DATASETS, LOSSES, MODELS, TrainConfig
from ddpkit.train.data import Data, digits, mnist, synthetic
from ddpkit.train.factories import LossFn
from ddpkit.train.gpt import GPTConfig, gpt
from ddpkit.train.models import mlp, small_cnn
from ddpkit.train.text import text

CLASSIFICATION_DATA = ("digits", "mnist", "synthetic")


@dataclass
class Workload:
    """A model on this rank's device, the loss to train it with, and the (train, held-out) datasets."""

    name: str
    module: nn.Module
    loss_fn: LossFn
    train: Any
    heldout: Any


def gpt_config(cfg: TrainConfig) -> GPTConfig:
    """The GPT that --gpt-layers, --gpt-width, --gpt-heads and --context describe."""
    return GPTConfig(layers=cfg.gpt_layers, width=cfg.gpt_width, heads=cfg.gpt_heads, context=cfg.context)


def _check_gpt_flags(cfg: TrainConfig) -> None:
    flags = (("gpt-layers", cfg.gpt_layers), ("gpt-width", cfg.gpt_width), ("gpt-heads", cfg.gpt_heads))
    for flag, value in (*flags, ("context", cfg.context)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{flag} must be an integer >= 1; got {value!r}")
    if cfg.gpt_width % cfg.gpt_heads:
        raise ValueError(f"--gpt-width {cfg.gpt_width} must be divisible by --gpt-heads {cfg.gpt_heads}")


def _check_names(cfg: TrainConfig) -> None:
    for flag, value, allowed in (("model", cfg.model, MODELS), ("data", cfg.data, DATASETS)):
        if not factories.is_spec(value) and value not in allowed:
            raise ValueError(f"--{flag} must be one of {', '.join(allowed)} or PACKAGE.MODULE:FACTORY; got {value!r}")
    if cfg.loss is not None and cfg.loss not in LOSSES:
        raise ValueError(f"--loss must be one of {', '.join(LOSSES)}; got {cfg.loss!r}")
    if cfg.max_steps is not None and (not isinstance(cfg.max_steps, int) or cfg.max_steps < 1):
        raise ValueError(f"--max-steps must be an integer >= 1; got {cfg.max_steps!r}")


def _check_pairing(cfg: TrainConfig) -> None:
    if cfg.model in ("mlp", "cnn") and cfg.data not in CLASSIFICATION_DATA:
        raise ValueError(
            f"--model {cfg.model} classifies --data {'|'.join(CLASSIFICATION_DATA)}; for --data {cfg.data} use "
            "--model gpt (with --data text) or your own --model PACKAGE.MODULE:FACTORY"
        )
    if cfg.model == "gpt" and cfg.data in CLASSIFICATION_DATA:
        raise ValueError(f"--model gpt reads byte sequences: use --data text or a factory, not --data {cfg.data}")
    if cfg.loss == "mse" and (cfg.model == "gpt" or cfg.data == "text"):
        raise ValueError("--loss mse needs float targets; --model gpt and --data text predict bytes (cross_entropy)")


def validate_workload(cfg: TrainConfig) -> None:
    """Checks --model, --data, --loss, --max-steps and the GPT's shape; calls factories once to check what they
    return. Raises a ValueError/TypeError naming the flag, before any process starts."""
    _check_names(cfg)
    _check_pairing(cfg)
    _check_gpt_flags(cfg)
    if factories.is_spec(cfg.model) or factories.is_spec(cfg.data):
        check_model_fits_data(build_workload(cfg, torch.device("cpu")), cfg)


def _shapes(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_shapes(v) for v in value) + ")"
    return type(value).__name__


def check_model_fits_data(work: Workload, cfg: TrainConfig) -> None:
    """One forward and loss of two training items through the model, in eval mode without gradients, in this
    process: a model that does not take the data's inputs, or whose output the loss cannot compare with the
    targets, fails here naming --model and --data and the shapes, instead of on every rank after spawning."""
    from torch.utils.data import default_collate

    inputs, targets = default_collate([work.train[i] for i in range(min(2, len(work.train)))])
    was_training = work.module.training
    work.module.eval()
    stage = "the model's forward"
    try:
        with torch.no_grad():
            output = work.module(inputs)
            stage = "the loss"
            work.loss_fn(output, targets)
    except Exception as exc:
        got = f"inputs {_shapes(inputs)}, targets {_shapes(targets)}"
        if stage == "the loss":
            got += f", model output {_shapes(output)}"
        raise ValueError(
            f"--model {cfg.model} does not fit --data {cfg.data}: {stage} failed on two training items ({got}): "
            f"{type(exc).__name__}: {exc}. Make the model's input layer match the data's items, or the data the "
            "model (and --loss, or the model factory's loss, match the targets)"
        ) from exc
    finally:
        work.module.train(was_training)


def _classification_data(cfg: TrainConfig) -> Data:
    if cfg.data == "digits":
        return digits(cfg.seed)
    if cfg.data == "mnist":
        assert cfg.data_dir is not None
        return mnist(cfg.data_dir)
    return synthetic(cfg.synthetic_samples, cfg.synthetic_features, cfg.synthetic_classes, cfg.seed)


def _builtin_model(cfg: TrainConfig, data: Data | None) -> nn.Module:
    if cfg.model == "gpt":
        return gpt(gpt_config(cfg))
    assert data is not None
    if cfg.model == "cnn":
        if data.image_shape is None:
            raise ValueError("--model cnn needs image-shaped data")
        return small_cnn(data.image_shape, data.num_classes)
    return mlp(data.num_features, data.num_classes, cfg.hidden, cfg.depth)


def build_workload(cfg: TrainConfig, device: torch.device) -> Workload:
    """Data, then the model (after ``torch.manual_seed(seed)``, so every rank builds the same one) on `device`."""
    data = _classification_data(cfg) if cfg.data in CLASSIFICATION_DATA else None
    if data is not None:
        train, heldout = data.train, data.test
    elif cfg.data == "text":
        train, heldout = text(cfg.context)
    else:
        train, heldout = factories.build_data(cfg.data)
    torch.manual_seed(cfg.seed)
    factory_loss = None
    if factories.is_spec(cfg.model):
        module, factory_loss = factories.build_model(cfg.model)
    else:
        module = _builtin_model(cfg, data)
    loss_fn = factories.pick_loss(cfg.loss, factory_loss)
    return Workload(f"{cfg.model} on {cfg.data}", module.to(device), loss_fn, train, heldout)
