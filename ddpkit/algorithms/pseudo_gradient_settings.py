"""The settings of SlowMo's pseudo-gradient syncs (`ddpkit.algorithms.pseudo_gradient`) and their checks."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from ddpkit.algorithms.quantize import check_compression

MERGE_ALPHA = 0.5
"""Streaming DiLoCo's mixing factor: the weight a node's own parameters keep when a delayed sync is merged."""


@dataclass(frozen=True)
class OuterSyncSettings:
    """The `slowmo_compression*`, `slowmo_error_feedback`, `slowmo_fragments`, `slowmo_sync_delay` and
    `slowmo_merge_alpha` arguments of SlowMoDistributedDataParallel. The defaults leave SlowMo as it was."""

    compression: str = "none"
    block: int = 64
    error_feedback: bool = False
    fragments: int = 1
    sync_delay: int = 0
    merge_alpha: float = MERGE_ALPHA

    @property
    def active(self) -> bool:
        """Whether averaging goes through `OuterSync` (else: SlowMo's exact all-reduce of the parameters)."""
        return self.compression != "none" or self.fragments > 1 or self.sync_delay > 0

    def named(self) -> dict[str, Any]:
        """The settings by their argument names (for the check that every rank holds the same)."""
        return {
            "slowmo_compression": self.compression,
            "slowmo_compression_block": self.block,
            "slowmo_error_feedback": self.error_feedback,
            "slowmo_fragments": self.fragments,
            "slowmo_sync_delay": self.sync_delay,
            "slowmo_merge_alpha": self.merge_alpha,
        }

    def check(self, localsgd_frequency: int, slowmo_frequency: int | None, numel: int, sgp: bool) -> None:
        """Raises a ValueError or TypeError naming the argument (before any collective); warns where a setting has
        no effect. `slowmo_frequency` is None when slow momentum is off; `numel` counts the parameters."""
        check_compression(self.compression, self.block)
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"slowmo_error_feedback must be a bool, got {self.error_feedback!r}")
        _check_int("slowmo_fragments", self.fragments, 1)
        _check_int("slowmo_sync_delay", self.sync_delay, 0)
        alpha = self.merge_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"SlowMoDistributedDataParallel: slowmo_merge_alpha must be in [0, 1], got {alpha!r}")
        if sgp and self.active:
            raise ValueError(
                "SlowMoDistributedDataParallel: slowmo_compression, slowmo_fragments and slowmo_sync_delay need the "
                "LOCALSGD base algorithm (SGP gossips parameters every step)"
            )
        if self.fragments > min(localsgd_frequency, numel):
            raise ValueError(
                f"SlowMoDistributedDataParallel: slowmo_fragments={self.fragments} must be at most localsgd_frequency="
                f"{localsgd_frequency} (one fragment per step of a period) and the {numel} parameter elements"
            )
        if self.sync_delay >= localsgd_frequency:
            raise ValueError(
                f"SlowMoDistributedDataParallel: slowmo_sync_delay={self.sync_delay} must be smaller than the period "
                f"localsgd_frequency={localsgd_frequency}: a fragment's sync must be merged before its next one starts"
            )
        if self.sync_delay and slowmo_frequency is not None and slowmo_frequency % localsgd_frequency:
            raise ValueError(
                f"SlowMoDistributedDataParallel: slowmo_sync_delay > 0 needs slowmo_frequency ({slowmo_frequency}) to "
                f"be a multiple of localsgd_frequency ({localsgd_frequency}), so a fragment syncs every period exactly"
            )
        self._warn_idle()

    def _warn_idle(self) -> None:
        idle = []
        if self.error_feedback and self.compression == "none":
            idle.append("slowmo_error_feedback (nothing is lost without slowmo_compression)")
        if self.merge_alpha != MERGE_ALPHA and self.sync_delay == 0:
            idle.append("slowmo_merge_alpha (a sync without slowmo_sync_delay replaces the parameters)")
        if idle:
            warnings.warn(f"SlowMoDistributedDataParallel: {'; '.join(idle)} has no effect", stacklevel=4)


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"SlowMoDistributedDataParallel: {name} must be an int >= {low}, got {value!r}")
