"""AdaScale: adaptive learning-rate scaling for large-batch data-parallel SGD."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ddpkit.distributed import comm
from ddpkit.distributed.env import ProcessGroup, comm_device
from ddpkit.optim.adascale_checks import SingleWorkerError, check_options, check_scale, is_int, resolve_world_size
from ddpkit.optim.adascale_math import (
    SmoothedEstimate,
    combined_gain,
    default_smoothing,
    estimates_from_fairscale,
    gain,
    observe,
)
from ddpkit.optim.adascale_meter import MicroGradientMeter, square_norm
from ddpkit.optim.adascale_wrapped import WrappedOptimizer, scaled_learning_rates
from ddpkit.optim.oss import OSS

__all__ = ["AdaScale"]

_STATE_KEY = "adascale"


class AdaScale(WrappedOptimizer):
    """Wraps an SGD-like optimizer so that a batch S times larger keeps the single-worker learning-rate schedule.

    Algorithm (AdaScale SGD, Johnson et al., ICML 2020): from the ``S = world_size x num_gradients_to_accumulate``
    micro-gradients ``g_i`` of an update it estimates, per param group, the variance ``sigma2`` of one base batch's
    gradient (the batch the schedule was tuned for) and the squared norm ``mu2`` of the true gradient::

        v      = (sum_i ||g_i||^2 - S ||mean_i g_i||^2) / (S - 1)      # sample variance of a micro-gradient
        sigma2 = max(v * scale / S, 1e-6)        mu2 = max(||mean_i g_i||^2 - v / S, 0)

    smooths both (`smoothing`, debiased unless ``debias_ewma=False``) and multiplies the step's learning rate by
    the gain ``r = (sigma2 + mu2) / (sigma2 / scale + mu2)`` in ``[1, scale]``. The gains' sum, `scale_invariant_steps`,
    drives the 1-worker schedule (`step_scheduler`): stopping at its T steps takes about T / S updates.

    Sends: per update, at its last backward, one all-reduce of 2 float64 per param group (none on one rank). Holds:
    a few floats per group. How the norms are measured, mixed precision, clipping, OSS: docs/adascale.md.

    Args:
        optimizer: the SGD-like torch optimizer (or an `OSS`) whose learning rate the gain multiplies.
        world_size: the ranks an update averages over (None: the group's size; 1: local, over accumulation only).
        scale: S, how many base batches one update averages (None: world size x `num_gradients_to_accumulate`).
        smoothing: the moving averages' coefficient in [0, 1) (None: the paper's ``max(1 - S / 1000, 0)``).
        num_gradients_to_accumulate: backward passes per update (gradient accumulation).
        is_scaled_loss: each accumulated loss was divided by `num_gradients_to_accumulate` (False: their sum).
        debias_ewma: correct the moving averages' bias towards 0 in the first updates.
        process_group: the ranks that average the gradients (None: the wrapped OSS's group, else the default).

    Raises:
        ValueError: an argument out of its range, or a `world_size` that is not the process group's.
        SingleWorkerError: one worker without accumulation (no spread of gradients to measure).

    Example::

        model = DDP(model)
        optimizer = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000, gamma=0.1)  # the 1-worker schedule
        while optimizer.scale_invariant_steps < T:  # T: the 1-worker run's number of steps
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()  # lr x gain for this step
            optimizer.step_scheduler(scheduler)  # advance the schedule by the gain, not by 1
    """

    def __init__(
        self,
        optimizer: Optimizer,
        world_size: int | None = None,
        scale: float | None = None,
        smoothing: float | None = None,
        num_gradients_to_accumulate: int = 1,
        is_scaled_loss: bool = True,
        debias_ewma: bool = True,
        process_group: ProcessGroup | None = None,
    ) -> None:
        check_options(scale, smoothing, num_gradients_to_accumulate, is_scaled_loss, debias_ewma)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                "AdaScale: optimizer must be a torch.optim.Optimizer instance (e.g. torch.optim.SGD(params, lr=0.1)), "
                f"got {type(optimizer).__name__}"
            )
        self._optimizer = optimizer
        self._num_grads_to_accum = num_gradients_to_accumulate
        self._requested = (world_size, process_group, scale, smoothing)  # None: derived from the group
        self._follow(optimizer if isinstance(optimizer, OSS) else None)
        self._is_scaled_loss = is_scaled_loss
        self._debias_ewma = debias_ewma
        self._estimates: list[SmoothedEstimate] = []
        self._scale_invariant_steps = 0.0
        self._updates = 0
        self._backward_passes = 0  # of the current update, measured so far
        self._measured = False  # the current update's estimates were taken
        self._warned_partial = False
        self._meter = MicroGradientMeter(self._micro_factor, self._on_backward_end)
        self._grads_divided = False
        self._init_optimizer_base()
        self._sync_groups()
        self._meter.watch(self._watched_groups())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(world_size={self._world_size}, scale={self._scale:g}, "
            f"num_gradients_to_accumulate={self._num_grads_to_accum}, smoothing={self._smoothing:g}, "
            f"optimizer={self._optimizer!r})"
        )

    # -- settings ----------------------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def scale(self) -> float:
        """How many base batches one update averages (the gain's upper bound)."""
        return self._scale

    @property
    def smoothing(self) -> float:
        """The moving averages' coefficient theta (0: only the latest update counts)."""
        return self._smoothing

    @property
    def num_gradients_to_accumulate(self) -> int:
        return self._num_grads_to_accum

    @property
    def scale_invariant_steps(self) -> float:
        """Progress in single-worker iterations: the sum of the gains of all updates so far."""
        return self._scale_invariant_steps

    def set_scale(self, scale: float, update_estimate: bool = True) -> None:
        """Declares that each update now averages `scale` base batches (the gain and the next updates use it).

        With ``update_estimate=True`` (fairscale's default and meaning) the smoothed variance estimate is multiplied
        by ``old scale / scale``; with False it is kept as it is. Call it between updates.
        """
        check_scale(scale, "set_scale")
        self._check_between_updates("set_scale")
        if update_estimate:
            for estimate in self._estimates:
                estimate.rescale_sigma2(self._scale / float(scale))
        self._scale = float(scale)

    def set_num_gradients_to_accumulate(self, num_gradients_to_accumulate: int, update_smoothing: bool = True) -> None:
        """Changes how many micro-batches (backward passes) each rank accumulates per update; call it between
        updates. The scale stays (call `set_scale` too when the batch per update changed); with `update_smoothing`
        the smoothing becomes the default for ``S = world_size x n``, ``max(1 - S / 1000, 0)``.
        """
        n = num_gradients_to_accumulate
        if not is_int(n) or n < 1:
            raise ValueError(f"set_num_gradients_to_accumulate: expected an int >= 1, got {n!r}")
        if self._world_size * n < 2:
            raise SingleWorkerError(
                "set_num_gradients_to_accumulate: a single worker needs num_gradients_to_accumulate >= 2 "
                f"(there is no spread of gradients to measure otherwise), got {n}"
            )
        self._check_between_updates("set_num_gradients_to_accumulate")
        self._num_grads_to_accum = n
        if update_smoothing:
            self._smoothing = default_smoothing(self._world_size * n)

    def _check_between_updates(self, where: str) -> None:
        if self._meter.pending or self._backward_passes:
            raise RuntimeError(
                f"{where}: micro-gradients of the current update were already measured; "
                "call it between updates (after step() or zero_grad())"
            )

    # -- estimates -----------------------------------------------------------------------------------------------

    def gain(self, pg_idx: int | None = None) -> float:
        """The gain at the current scale: of parameter group `pg_idx`, or of the whole model (None), from the
        sums of the groups' estimates. After the last backward pass of an update it already includes that update's
        gradients (it is the gain `step()` uses); 1 before the first measurement. Never communicates."""
        if pg_idx is None:
            return combined_gain(self._estimates, self._scale)
        estimate = self._estimates[pg_idx]
        return gain(estimate.sigma2, estimate.mu2, self._scale) if estimate.count else 1.0

    def estimates(self, pg_idx: int | None = None) -> tuple[float, float]:
        """The smoothed ``(sigma2, mu2)`` of group `pg_idx`, or summed over the groups (None)."""
        chosen = self._estimates if pg_idx is None else [self._estimates[pg_idx]]
        return sum(e.sigma2 for e in chosen), sum(e.mu2 for e in chosen)

    # -- hooks -------------------------------------------------------------------------------------------------------

    def _micro_factor(self) -> float:
        """Each micro-batch loss was divided by n when ``is_scaled_loss``: its gradient's squared norm times n^2."""
        n = self._num_grads_to_accum
        return float(n * n) if self._is_scaled_loss else 1.0

    def _on_backward_end(self) -> None:
        """End of a backward pass that produced gradients: after the update's n-th, take its estimates."""
        self._backward_passes += 1
        if self._backward_passes >= self._num_grads_to_accum:
            self._measure()

    def _measure(self) -> None:
        """The update's estimates from its micro-gradient norms and averaged gradients (one small all-reduce)."""
        self._sync_groups()
        sum_sq, mean_sq = self._reduce_norms()
        if not self._is_scaled_loss:
            n2 = float(self._num_grads_to_accum**2)  # .grad holds the sum of the n micro-gradients, not their mean
            mean_sq = [v / n2 for v in mean_sq]
        self._update_estimates(sum_sq, mean_sq)
        self._meter.clear()
        self._backward_passes = 0
        self._measured = True

    @property
    def _hook_handles(self) -> list[Any]:
        """fairscale's name for the gradient hooks' handles, one per trainable parameter (its tests count them)."""
        return self._meter.handles

    def unhook(self) -> None:
        """Removes the gradient hooks (e.g. when training is over); `step()` is an error afterwards."""
        self._meter.close()

    # -- the update ----------------------------------------------------------------------------------------------

    def scale_grad_by_num_grads_to_accum(self) -> None:
        """Divides the accumulated gradients by `num_gradients_to_accumulate`: for ``is_scaled_loss=False``, call it
        after the last backward of an update and before `step()` (or gradient clipping)."""
        if self._is_scaled_loss:
            raise RuntimeError(
                "scale_grad_by_num_grads_to_accum: this AdaScale has is_scaled_loss=True, i.e. each accumulated "
                "loss was already divided by num_gradients_to_accumulate; dividing again would be wrong"
            )
        for group in self._watched_groups():
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self._num_grads_to_accum)
        for grad in self._sharding.held_piece_grads() if self._sharding is not None else []:
            grad.div_(self._num_grads_to_accum)  # split parameters whose pieces hold their gradient apart
        self._grads_divided = True

    def step(self, closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """Steps the wrapped optimizer with each group's learning rate multiplied by its gain (taken at the end of
        the update's last backward pass), restored afterwards. After fewer backward passes than
        `num_gradients_to_accumulate` (an epoch's last, shorter accumulation) the current gain is used and the
        estimates are left as they are (a warning says so once).

        A `closure` is evaluated once first (with gradients enabled) and its loss returned; other arguments go to
        the wrapped optimizer's `step`.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_can_step()
        if not self._measured and self._world_size > 1 and not self._meter.watching:
            self._measure()  # nothing hooked here: the other ranks' all-reduce at their last backward needs this one
        gains = [self.gain(i) for i in range(len(self.param_groups))]
        with scaled_learning_rates(self.param_groups, gains):
            self._optimizer.step(*args, **kwargs)
        self._scale_invariant_steps += self.gain()
        self._updates += 1
        self._start_next_update()
        return loss

    def _check_can_step(self) -> None:
        if self._meter.closed:
            raise RuntimeError("AdaScale.step: unhook() was called, so no gradient is measured any more")
        if self._backward_passes and not self._warned_partial:
            self._warned_partial = True
            warnings.warn(
                f"AdaScale.step: {self._backward_passes} backward pass(es) in this update but "
                f"num_gradients_to_accumulate={self._num_grads_to_accum} (e.g. an epoch's last, shorter "
                "accumulation): stepping with the current gain, the estimates stay as they are",
                stacklevel=3,
            )
        if self._measured and not self._is_scaled_loss and self._num_grads_to_accum > 1 and not self._grads_divided:
            raise RuntimeError(
                "AdaScale.step: is_scaled_loss=False and gradients are accumulated, so call "
                "scale_grad_by_num_grads_to_accum() after the last backward and before step()"
            )

    def _follow(self, oss: OSS | None) -> None:
        """The process group (`process_group`, else `oss`'s, else the default group), the world size and the
        defaults that follow from it (`scale`, `smoothing`), and `oss` as the sharding of the gradients."""
        world_size, process_group, scale, smoothing = self._requested
        group = process_group if process_group is not None or oss is None else oss.group
        self._world_size = resolve_world_size(world_size, group)
        if oss is not None and self._world_size != oss.world_size:
            raise ValueError(
                f"AdaScale: world_size={self._world_size} but the OSS shards over {oss.world_size} ranks; leave "
                "world_size=None (it then follows the OSS's group)"
            )
        num_grads = self._world_size * self._num_grads_to_accum
        if num_grads < 2:
            raise SingleWorkerError(
                "AdaScale: a single worker without gradient accumulation has no spread of gradients to measure; "
                "use several workers (world_size > 1) or num_gradients_to_accumulate > 1"
            )
        self._group = group
        self._scale = float(num_grads) if scale is None else float(scale)
        self._smoothing = default_smoothing(num_grads) if smoothing is None else float(smoothing)
        # The OSS whose shards the gradients follow: the wrapped one, or the one this is the local optimizer of
        # (`_measure_whole_model_of`); its param groups are the whole model's and its owners count the gradients.
        self._sharding: OSS | None = oss

    def _measure_whole_model_of(self, oss: OSS) -> None:
        """Called by `oss` when this AdaScale is its local optimizer (``OSS(params, AdaScaleWrapper, ...)``): the
        estimates then come from the whole model, as for ``AdaScale(OSS(...))``, instead of from this rank's shard
        (the gradients of every parameter are measured here; the averaged ones are counted by their owners). Without
        a `process_group` of its own it takes the OSS's group (and the world size and defaults that follow)."""
        self._follow(oss)
        self._meter.watch(self._watched_groups())

    def _watched_groups(self) -> list[dict[str, Any]]:
        """The param groups whose gradients the estimates come from: the whole model's (an OSS's are; inside one,
        they are the local optimizer's groups with every rank's share, in the same order)."""
        return self._sharding.param_groups if self._sharding is not None else self.param_groups

    def _counted_grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The averaged gradients this rank adds to the norm: all of them, or under OSS its own share (every
        element counted by one rank)."""
        if self._sharding is None:
            return [p.grad for p in params if p.grad is not None]
        return self._sharding.owned_grads(params)

    def _reduce_norms(self) -> tuple[list[float], list[float]]:
        """Per group: ``sum_i ||g_i||^2`` over all micro-gradients and ``||mean_i g_i||^2`` (one all-reduce)."""
        watched = self._watched_groups()
        n_groups = len(watched)
        first = next((p for group in watched for p in group["params"]), None)
        data = first.device if first is not None else None
        device = comm_device(self._group, data) if self._world_size > 1 else torch.device("cpu")
        norms = torch.zeros(2 * n_groups, dtype=torch.float64, device=device)
        self._meter.totals_into(norms)
        for i, group in enumerate(watched):
            params = [p for p in group["params"] if p.requires_grad]
            grads = self._counted_grads(params)
            if grads:  # summed where the gradients are, then moved once (a CUDA-to-host copy synchronises)
                norms[n_groups + i] += torch.stack([square_norm(g).to(grads[0].device) for g in grads]).sum().to(device)
        if self._world_size > 1:
            comm.all_reduce(norms, self._group)
        values = norms.tolist()
        holders = 1 if self._sharding is not None else self._world_size  # ranks holding each averaged gradient
        return values[:n_groups], [v / holders for v in values[n_groups:]]

    def _update_estimates(self, sum_sq: list[float], mean_sq: list[float]) -> None:
        num_grads = self._world_size * self._num_grads_to_accum
        for estimate, total, mean in zip(self._estimates, sum_sq, mean_sq, strict=True):
            if total == 0.0 and mean == 0.0:
                continue  # the group got no gradient: keep its estimates
            observation = observe(total, mean, num_grads, self._scale)
            if observation.is_finite():  # e.g. an overflow under mixed precision: skip, do not poison the averages
                estimate.update(observation, self._smoothing)

    def _start_next_update(self) -> None:
        self._meter.clear()
        self._backward_passes = 0
        self._measured = False
        self._grads_divided = False
        self._meter.watch(self._watched_groups())

    def held_piece_grads(self) -> list[torch.Tensor]:
        """The gradients that pieces of split parameters hold apart (`OSS.held_piece_grads` of the wrapped OSS;
        none without one)."""
        return self._sharding.held_piece_grads() if self._sharding is not None else []

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients (through the wrapped optimizer) and starts a new update's measurements."""
        self._optimizer.zero_grad(set_to_none=set_to_none)
        self._start_next_update()

    def add_param_group(self, pg: dict[str, Any]) -> None:
        """Adds a group to the wrapped optimizer; it gets its own estimates and hooks."""
        self._check_between_updates("add_param_group")
        self._optimizer.add_param_group(pg)
        self._sync_groups()
        self._meter.watch(self._watched_groups())

    def _sync_groups(self) -> None:
        while len(self._estimates) < len(self.param_groups):
            self._estimates.append(SmoothedEstimate(debias=self._debias_ewma))

    # -- LR schedules by scale-invariant progress -------------------------------------------------------------------

    def step_scheduler(self, scheduler: LRScheduler) -> int:
        """Advances `scheduler` to ``floor(scale_invariant_steps)`` steps; returns how many steps it took.

        Call it after `step()` instead of ``scheduler.step()``: a schedule written for the single-worker run (in its
        iterations) then stretches by itself to the large-batch run. Works with any torch LR scheduler that steps
        without arguments (not ReduceLROnPlateau); the scheduler's own state (``last_epoch``) is the position, so
        checkpointing it with this optimizer resumes exactly.
        """
        if not isinstance(scheduler, LRScheduler) or isinstance(scheduler, ReduceLROnPlateau):
            raise TypeError(
                "step_scheduler: expected a torch.optim.lr_scheduler.LRScheduler that steps without arguments "
                f"(ReduceLROnPlateau is not), got {type(scheduler).__name__}"
            )
        taken = 0
        while scheduler.last_epoch < math.floor(self._scale_invariant_steps):
            scheduler.step()
            taken += 1
        return taken

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict plus an ``"adascale"`` entry with the estimates and counters.

        Arguments go to the wrapped optimizer (e.g. OSS's ``all_ranks``). The result loads into a plain torch
        optimizer too (the extra entry is ignored there).
        """
        saved = dict(self._optimizer.state_dict(*args, **kwargs))
        saved[_STATE_KEY] = {
            "scale_invariant_steps": self._scale_invariant_steps,
            "updates": self._updates,
            "estimates": [e.to_dict() for e in self._estimates],
            "scale": self._scale,
            "smoothing": self._smoothing,
            "world_size": self._world_size,
            "num_gradients_to_accumulate": self._num_grads_to_accum,
        }
        return saved

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Loads the wrapped optimizer's state and AdaScale's estimates and counters.

        The scale, smoothing and accumulation count stay as configured here (the estimates are per base batch, so
        a checkpoint resumes at another world size). A fairscale AdaScale's state dict loads too, estimates
        included. A state dict without AdaScale's entry (e.g. from a plain torch optimizer) leaves the estimates as
        they are.
        """
        state_dict = data
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
        saved = state_dict.get(_STATE_KEY)
        if saved is not None and len(saved["estimates"]) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: the AdaScale state has {len(saved['estimates'])} parameter groups, this "
                f"optimizer has {len(self.param_groups)}"
            )
        inner_state = state_dict.get("state")
        legacy = inner_state.get(_STATE_KEY) if isinstance(inner_state, dict) else None
        if saved is None and isinstance(legacy, dict) and "grad_var_avg" in legacy:  # a fairscale AdaScale's
            estimates = estimates_from_fairscale(legacy, len(self.param_groups), self._debias_ewma)
            state_dict = {**state_dict, "state": {k: v for k, v in inner_state.items() if k != _STATE_KEY}}
            self._optimizer.load_state_dict(state_dict)
            self._estimates = estimates
            return
        self._optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != _STATE_KEY})
        if saved is None:
            return
        self._sync_groups()
        for estimate, values in zip(self._estimates, saved["estimates"], strict=True):
            estimate.load(values)
        self._scale_invariant_steps = float(saved["scale_invariant_steps"])
        self._updates = int(saved["updates"])
