"""What `ddpkit train` and `ddpkit bench` train: a model, its loss and (train, held-out) data, from built-in names
(``mlp``/``cnn`` on ``digits``/``mnist``/``synthetic``, ``gpt`` on ``text``) or from factories
(``PACKAGE.MODULE:FACTORY``, see `ddpkit.train.workloads.factories`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddpkit.train.workloads import factories
from ddpkit.train.workloads.factories import LossFn
from ddpkit.train.workloads.registry import CLASSIFICATION_DATA, DATASETS, MODELS, gpt_config, is_spec

if TYPE_CHECKING:
    from ddpkit.train.settings.config import TrainConfig

__all__ = ["CLASSIFICATION_DATA", "Workload", "build_workload", "check_model_fits_data", "gpt_config"]


@dataclass
class Workload:
    """A model on this rank's device, the loss to train it with, and the (train, held-out) datasets."""

    name: str
    module: nn.Module
    loss_fn: LossFn
    train: Any
    heldout: Any


def check_factories(cfg: TrainConfig) -> None:
    """Calls --model's and --data's factories once (in this process) and checks what they return fits together
    (`check_model_fits_data`). Raises a ValueError/TypeError naming the flag, before any process starts."""
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


def build_workload(cfg: TrainConfig, device: torch.device) -> Workload:
    """Data, then the model (after ``torch.manual_seed(seed)``, so every rank builds the same one) on `device`."""
    data = None
    if cfg.data in DATASETS:
        train, heldout, data = DATASETS[cfg.data].build(cfg)
    else:
        train, heldout = factories.build_data(cfg.data)
    torch.manual_seed(cfg.seed)
    factory_loss = None
    if is_spec(cfg.model):
        module, factory_loss = factories.build_model(cfg.model)
    else:
        module = MODELS[cfg.model].build(cfg, data)
    loss_fn = factories.pick_loss(cfg.loss, factory_loss)
    return Workload(f"{cfg.model} on {cfg.data}", module.to(device), loss_fn, train, heldout)
