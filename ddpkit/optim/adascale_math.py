"""The arithmetic of AdaScale, free of torch and of communication: one step's estimates, their moving averages
and the gain.

Notation (Johnson et al., "AdaScale SGD", ICML 2020): an update averages ``S`` micro-gradients ``g_1 .. g_S``,
each computed on one micro-batch. ``sigma2`` is the variance (trace of the covariance) of the gradient of one
*base* batch, the batch the user's single-worker schedule was tuned for; ``mu2`` is the squared norm of the true
gradient. ``scale`` is how many base batches one update averages (by default ``S``: a micro-batch is a base batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SIGMA2_FLOOR = 1e-6
"""Lower bound of one step's variance estimate (keeps the gain finite when every micro-gradient is equal)."""

MU2_FLOOR = 0.0
"""Lower bound of one step's squared-gradient-norm estimate."""


def default_smoothing(num_grads: int) -> float:
    """The paper's moving-average coefficient ``theta = max(1 - S / 1000, 0)`` for S micro-gradients per update."""
    return max(1.0 - num_grads / 1000.0, 0.0)


@dataclass(frozen=True)
class Observation:
    """One update's (clamped) estimates: `sigma2` per base batch and `mu2`."""

    sigma2: float
    mu2: float

    def is_finite(self) -> bool:
        return math.isfinite(self.sigma2) and math.isfinite(self.mu2)


def observe(sum_sq: float, mean_sq: float, num_grads: int, scale: float) -> Observation:
    """Estimates from one update's S micro-gradients.

    `sum_sq` is ``sum_i ||g_i||^2`` and `mean_sq` is ``||(1/S) sum_i g_i||^2``. The unbiased sample variance of a
    micro-gradient is ``v = (sum_sq - S * mean_sq) / (S - 1)``; since ``E ||mean||^2 = mu2 + v / S``,
    ``mu2 = mean_sq - v / S``; a micro-gradient averages ``scale / S`` base batches, so the variance of one base
    batch is ``sigma2 = v * scale / S``. `sigma2` is then clamped below at `SIGMA2_FLOOR`, `mu2` at `MU2_FLOOR`.
    """
    if num_grads < 2:
        raise ValueError(f"observe: num_grads must be >= 2 to measure a variance, got {num_grads}")
    micro_var = (sum_sq - num_grads * mean_sq) / (num_grads - 1)
    mu2 = mean_sq - micro_var / num_grads
    sigma2 = micro_var * scale / num_grads
    return Observation(max(sigma2, SIGMA2_FLOOR), max(mu2, MU2_FLOOR))


def gain(sigma2: float, mu2: float, scale: float) -> float:
    """``r = (sigma2 + mu2) / (sigma2 / scale + mu2)``: 1 when the noise is negligible, `scale` when it dominates."""
    denominator = sigma2 / scale + mu2
    if denominator <= 0.0:
        return 1.0  # nothing measured yet
    return (sigma2 + mu2) / denominator


@dataclass
class SmoothedEstimate:
    """Moving averages of `sigma2` and `mu2` for one parameter group.

    Each update moves both towards the new observation ``x``: ``avg += alpha * (x - avg)``. With `debias` (the
    default) the average is an exponential moving average ``m_t = theta m_{t-1} + (1 - theta) x_t`` divided by its
    total weight ``w_t = theta w_{t-1} + (1 - theta)`` (``1 - theta^t`` for a constant theta), so it is not biased
    towards its zero start; that is ``alpha = (1 - theta) / w_t``. Without it, the paper's rule: the plain mean of
    the observations for the first ``1 / (1 - theta)`` updates, then the exponential average, i.e.
    ``alpha = max(1 / t, 1 - theta)``. ``theta = 0`` keeps only the latest observation.
    """

    debias: bool = True
    sigma2: float = 0.0
    mu2: float = 0.0
    count: int = 0
    weight: float = 0.0

    def update(self, observation: Observation, smoothing: float) -> None:
        self.count += 1
        if self.debias:
            self.weight = smoothing * self.weight + (1.0 - smoothing)
            alpha = (1.0 - smoothing) / self.weight
        else:
            alpha = max(1.0 / self.count, 1.0 - smoothing)
        self.sigma2 += alpha * (observation.sigma2 - self.sigma2)
        self.mu2 += alpha * (observation.mu2 - self.mu2)

    def rescale_sigma2(self, factor: float) -> None:
        self.sigma2 *= factor

    def to_dict(self) -> dict[str, Any]:
        return {"sigma2": self.sigma2, "mu2": self.mu2, "count": self.count, "weight": self.weight}

    def load(self, saved: dict[str, Any]) -> None:
        self.sigma2 = float(saved["sigma2"])
        self.mu2 = float(saved["mu2"])
        self.count = int(saved["count"])
        self.weight = float(saved["weight"])


def combined_gain(estimates: list[SmoothedEstimate], scale: float) -> float:
    """The whole model's gain: the formula applied to the sums of the groups' estimates (1 before any update)."""
    if not any(e.count for e in estimates):
        return 1.0
    return gain(sum(e.sigma2 for e in estimates), sum(e.mu2 for e in estimates), scale)


def estimates_from_fairscale(entry: dict[str, Any], num_groups: int, debias: bool) -> list[SmoothedEstimate]:
    """The estimates held by a fairscale AdaScale checkpoint (its wrapped optimizer's ``state["adascale"]``: per
    group ``grad_var_avg`` = sigma2 and ``grad_sqr_avg`` = mu2, with the debiasing weight ``grad_var_avg_unbias``
    or the update count ``grad_var_avg_count``), continuing exactly as fairscale's moving averages would."""
    sigma2, mu2 = [float(v) for v in entry["grad_var_avg"]], [float(v) for v in entry["grad_sqr_avg"]]
    if len(sigma2) != num_groups or len(mu2) != num_groups:
        raise ValueError(
            f"load_state_dict: the fairscale AdaScale state has {len(sigma2)} parameter groups, this optimizer has "
            f"{num_groups}"
        )
    out = []
    for i in range(num_groups):
        weight = float(entry["grad_var_avg_unbias"][i]) if "grad_var_avg_unbias" in entry else 0.0
        count = int(entry["grad_var_avg_count"][0]) if "grad_var_avg_count" in entry else int(weight > 0.0)
        if count == 0:  # never updated (fairscale starts mu2 at 1 there: the same gain of 1)
            out.append(SmoothedEstimate(debias=debias))
            continue
        out.append(SmoothedEstimate(debias=debias, sigma2=sigma2[i], mu2=mu2[i], count=count, weight=weight))
    return out
