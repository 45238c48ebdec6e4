"""Who am I in the job: process-group checks, ranks, sizes and the device collectives run on."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def require_initialized(owner: str) -> None:
    """Raises a RuntimeError saying how to fix it when no default process group exists.

    Args:
        owner: the name the message starts with (the class or function that needs the group).
    """
    if not dist.is_available():
        raise RuntimeError(f"{owner} needs torch.distributed, which this build of PyTorch does not include.")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{owner} needs an initialised process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl', ...) first (torchrun sets the environment; "
            "ddpkit.testing.run_distributed does it for tests)."
        )


def group_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank inside `group` (None: the default group).

    Args:
        group: the process group (None: the default group).
    """
    return dist.get_rank(group)


def group_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks in `group` (None: the default group).

    Args:
        group: the process group (None: the default group).
    """
    return dist.get_world_size(group)


def global_rank(group: ProcessGroup | None, rank_in_group: int) -> int:
    """The global rank of `rank_in_group` in `group`, as torch's src/dst arguments expect."""
    if group is None or group is dist.group.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def group_label(group: ProcessGroup | None) -> str:
    """A short, stable name for a group, used as a CommStats key: ``world`` or ``ranks[0,2]``.

    Args:
        group: the process group (None: the default group).
    """
    if group is None or group is dist.group.WORLD:
        return "world"
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == dist.get_world_size():
        return "world"
    return "ranks[" + ",".join(str(r) for r in ranks) + "]"


def backend_name(group: ProcessGroup | None = None, device_type: str = "cpu") -> str:
    """The backend `group` runs collectives of `device_type` tensors on ("gloo", "nccl", ...), or "" if none.

    Read from the process group itself, per device type: ``init_process_group()`` without a backend reports
    "undefined" to ``get_backend`` although it runs gloo for CPU tensors, and "cpu:gloo,cuda:nccl" names two."""
    pg = dist.distributed_c10d._get_default_group() if group is None or group is dist.group.WORLD else group
    try:
        return str(pg._get_backend(torch.device(device_type)).name()).lower()
    except (RuntimeError, AttributeError, ValueError):
        pass
    name = str(dist.get_backend(group)).lower()
    if ":" not in name:
        return "" if name == "undefined" else name
    for part in name.split(","):
        device, _, backend = part.partition(":")
        if device.strip() == device_type:
            return backend.strip()
    return ""


def comm_device(group: ProcessGroup | None = None, data_device: torch.device | None = None) -> torch.device:
    """The device on which small control tensors (norms, flags, sizes) must live for `group`'s backend: the CPU
    wherever the group can take CPU tensors; else (NCCL alone) the device of the data they belong to
    (`data_device`: a rank whose model is on cuda:3 uses cuda:3 even if it never called ``set_device``), else the
    device the group was bound to (``init_process_group(device_id=...)``), else the current CUDA device.

    Args:
        group: the process group (None: the default group).
        data_device: the device of the data the control tensors belong to.
    """
    if backend_name(group, "cpu"):
        return torch.device("cpu")
    if data_device is not None and data_device.type != "cpu":
        return data_device
    pg = dist.distributed_c10d._get_default_group() if group is None or group is dist.group.WORLD else group
    bound = getattr(pg, "bound_device_id", None)
    if isinstance(bound, torch.device):
        return bound
    return torch.device("cuda", torch.cuda.current_device())


def job_timeout(group: ProcessGroup | None = None) -> timedelta | None:
    """The timeout `group`'s collectives run under (None: the default group's, the job's ``--timeout``).

    Groups a library creates with ``new_group`` get torch's default of 30 minutes unless told otherwise; passing
    this value makes every subgroup fail as soon as the job's own groups do. None when it cannot be read."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None
