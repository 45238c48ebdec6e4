"""ShardedGradScaler: torch's dynamic loss scaling with the skip decision agreed over a process group."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.amp import GradScaler

from ddpkit.distributed import comm
from ddpkit.distributed.env import ProcessGroup, comm_device, group_size

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """`torch.amp.GradScaler` for sharded training: every rank skips the same steps and keeps the same scale.

    Algorithm: torch's (scale the loss; unscale the gradients this rank holds and look for inf/NaN; step only
    without one; back off or grow the scale), plus one agreement: after unscaling, the found-inf flag is combined
    (max) over `process_group`. Under `OSS` + `ShardedDataParallel` each rank holds only the gradients it owns, so
    an overflow may be seen on one rank only; without the agreement that rank would skip `OSS.step` while the
    others wait in its broadcasts, and the scales would drift apart. Works on CPU (bf16/fp16) and CUDA.

    Sends: one all-reduce of one float32 per `unscale_` and optimizer (none on one rank or when disabled). Holds:
    torch's scale and growth tracker, one flag per optimizer. Devices, process groups, fused steps:
    docs/sharded.md.

    Args:
        init_scale: the loss scale at the start.
        growth_factor: what the scale is multiplied by after `growth_interval` steps without an inf or NaN.
        backoff_factor: what the scale is multiplied by after a step with an inf or NaN on any rank.
        growth_interval: steps without an inf or NaN before the scale grows.
        enabled: False makes every call a pass-through (no scaling, no collective), as torch's.
        process_group: the ranks that agree on skipping a step (None: the default group).
        device: where the scaled tensors live, ``"cuda"`` or ``"cpu"`` (None: cuda when available, else cpu).

    Raises:
        ValueError: a factor, interval or scale out of its range, or an unknown `device`.
        TypeError: a device given where `init_scale` goes (fairscale's order), or a `process_group` that is not one.
        RuntimeError: ``device="cuda"`` without CUDA, or several ranks (``WORLD_SIZE > 1``) without a group.

    Example::

        model = DDP(model)  # or ShardedDataParallel(model, optimizer)
        optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
        scaler = ShardedGradScaler()
        for x, y in data:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):  # on CPU: "cpu", fp16 or bf16
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # optional, e.g. to clip: optimizer.clip_grad_norm(1.0)
            scaler.step(optimizer)  # skipped on every rank if any rank found an inf/NaN
            scaler.update()
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: ProcessGroup | None = None,
        *,
        device: str | torch.device | None = None,
    ) -> None:
        if isinstance(init_scale, str | torch.device):
            raise TypeError(
                f"ShardedGradScaler: init_scale must be a number, got {init_scale!r}; the positional parameters "
                f"follow fairscale's order (init_scale first), so pass the device by keyword: device={init_scale!r}"
            )
        device_type = _device_type(device)
        if enabled and device_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                "ShardedGradScaler: device='cuda' but CUDA is not available; use device='cpu' "
                "(or leave device unset to pick 'cuda' when available, else 'cpu')"
            )
        _check_factors(init_scale, growth_factor, backoff_factor, growth_interval)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"ShardedGradScaler: process_group must be a torch.distributed.ProcessGroup or None (the default "
                f"group), got {type(process_group).__name__}"
            )
        super().__init__(device_type, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.process_group = process_group
        self._device_type = device_type

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscales this rank's gradients of `optimizer`, then agrees on the found-inf flag over the group.

        A collective when the group has several ranks: every rank must call it (or `step`, which calls it when
        it was not called explicitly this iteration) for the same optimizers in the same order.
        """
        if not self.is_enabled():
            return
        super().unscale_(optimizer)
        self._unscale_held_pieces(optimizer)
        self._agree_on_found_inf(optimizer)

    def _unscale_held_pieces(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscales and checks the gradients that pieces of split parameters hold apart from their parameter
        (`OSS.held_piece_grads`), which torch's walk over ``param.grad`` does not reach, as torch does the others."""
        held = getattr(optimizer, "held_piece_grads", None)
        grads = held() if callable(held) else []
        if not grads:
            return
        assert self._scale is not None  # (set by the unscale_ that just ran)
        inv_scale = self._scale.double().reciprocal().float()  # in fp64 first, as torch does
        flags = _found_inf_flags(self, optimizer)
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), same in by_kind.items():
            found = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv_scale.to(device))
            flags[device] = torch.maximum(flags[device], found) if device in flags else found

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscales (unless already done), then runs ``optimizer.step()`` unless some rank found an inf/NaN.

        Returns what ``optimizer.step`` returned, or None when the step was skipped.
        """
        if self.is_enabled() and getattr(optimizer, "_step_supports_amp_scaling", False):
            # torch lets scaler-aware (fused) optimizers check for infs themselves, on this rank's gradients only.
            # Unscaling first makes torch hand them the agreed flag and no scale (so they do not unscale again).
            # No flag recorded yet means unscale_ was not called this iteration (ours always records one).
            if "closure" not in kwargs and not _found_inf_flags(self, optimizer):
                self.unscale_(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def _agree_on_found_inf(self, optimizer: torch.optim.Optimizer) -> None:
        """Replaces this rank's found-inf flags for `optimizer` by one flag: the maximum over the group.

        A rank that holds none of the optimizer's gradients has no flag; it contributes 0 and gets the agreed
        flag, which torch's `step` needs (it asserts that some inf check was recorded).
        """
        flags = _found_inf_flags(self, optimizer)
        communicate = self._must_communicate()
        data = next(iter(flags.values())).device if flags else None
        device = comm_device(self.process_group, data) if communicate else torch.device(self._device_type)
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for flag in flags.values():
            found = torch.maximum(found, flag.reshape(1).to(device))
        if communicate:
            comm.all_reduce(found, self.process_group, op=dist.ReduceOp.MAX)
        # Kept where this rank's gradients are (torch moves flags to the scale's device when it reads them).
        home = next(iter(flags), device)
        flags.clear()
        flags[home] = found.reshape(()).to(home)

    def _must_communicate(self) -> bool:
        """True when the flag must be all-reduced: a process group with more than one rank exists."""
        if dist.is_available() and dist.is_initialized():
            return group_size(self.process_group) > 1
        if self.process_group is not None:
            raise RuntimeError("ShardedGradScaler: process_group was given but torch.distributed is not initialised")
        world = os.environ.get("WORLD_SIZE", "1")
        if world.isdigit() and int(world) > 1:
            raise RuntimeError(
                f"ShardedGradScaler: WORLD_SIZE={world} but no process group is initialised, so the ranks cannot "
                "agree on skipped steps: call torch.distributed.init_process_group(...) before the first "
                "unscale_/step (or build the scaler with enabled=False)"
            )
        return False


def _found_inf_flags(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    """torch's per-device found-inf flags of `optimizer` for this iteration: the one place that reads its internals.

    `torch.amp.GradScaler` keeps, per optimizer, ``_per_optimizer_states[id(optimizer)]["found_inf_per_device"]``:
    a dict from device to a float32 scalar that is non-zero when that device's gradients held an inf/NaN. It is
    filled by `unscale_` (empty when no gradient exists), read by `step` (skip if any is non-zero) and by `update`
    (back off if any is non-zero), and reset by `update`. The returned dict is the live one: changing it changes
    what `step` and `update` decide.
    """
    try:
        flags = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    except (AttributeError, KeyError, TypeError) as exc:
        raise RuntimeError(
            f"ShardedGradScaler: this torch version ({torch.__version__}) keeps GradScaler's per-optimizer "
            "found-inf flags differently than ddpkit expects; please report it"
        ) from exc
    if not isinstance(flags, dict):
        raise RuntimeError(
            f"ShardedGradScaler: unexpected GradScaler found-inf state {type(flags).__name__} in torch "
            f"{torch.__version__}; please report it"
        )
    return flags


def _device_type(device: str | torch.device | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"ShardedGradScaler: device must be a str, torch.device or None, got {type(device).__name__}")
    try:
        return torch.device(device).type
    except RuntimeError as exc:
        raise ValueError(f"ShardedGradScaler: device={device!r} is not a device type (e.g. 'cpu', 'cuda')") from exc


def _check_factors(init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"ShardedGradScaler: init_scale must be a finite number > 0, got {init_scale!r}")
    if not (isinstance(growth_factor, (int, float)) and math.isfinite(growth_factor) and growth_factor > 1.0):
        raise ValueError(f"ShardedGradScaler: growth_factor must be a finite number > 1.0, got {growth_factor!r}")
    if not (isinstance(backoff_factor, (int, float)) and 0.0 < backoff_factor < 1.0):
        raise ValueError(f"ShardedGradScaler: backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"ShardedGradScaler: growth_interval must be an int >= 1, got {growth_interval!r}")
