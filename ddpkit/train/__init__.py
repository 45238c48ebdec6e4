"""A small trainer with callbacks, strategies by name, offline datasets, checkpoints and run summaries."""

from ddpkit.train.trainer import Callback, StepRecord, Trainer, TrainerState

__all__ = ["Callback", "StepRecord", "Trainer", "TrainerState"]
