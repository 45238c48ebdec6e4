"""A small trainer with callbacks, strategies by name, offline datasets, checkpoints and run summaries.

Parts: `settings` (flags, checks, what ranks share), `workloads` (models and data by name or factory),
`checkpoints`, `loop` (the trainer, its callbacks, whole jobs, `ddpkit bench`). `Trainer` and its companions are
loaded on first use, so importing a workload (the byte GPT, say) does not import the trainer.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Callback", "StepRecord", "Trainer", "TrainerState"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ddpkit.train.loop import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'ddpkit.train' has no attribute {name!r}")
