"""The only layer of ddpkit that talks to torch.distributed directly.

Its names load on first use (`__getattr__`), so that the modules without torch in it (`launch`,
`local_processes`, `segment_files`, `rank_guard`) can be imported by a launcher that never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpkit.distributed.comm import all_gather, all_reduce, broadcast, reduce, reduce_scatter
    from ddpkit.distributed.env import comm_device, group_label, group_rank, group_size, require_initialized
    from ddpkit.distributed.hooks import counting_allreduce_hook
    from ddpkit.distributed.stats import CollectiveCount, CommStats, comm_stats

_HOMES = {
    "ddpkit.distributed.comm": ("all_gather", "all_reduce", "broadcast", "reduce", "reduce_scatter"),
    "ddpkit.distributed.env": ("comm_device", "group_label", "group_rank", "group_size", "require_initialized"),
    "ddpkit.distributed.hooks": ("counting_allreduce_hook",),
    "ddpkit.distributed.stats": ("CollectiveCount", "CommStats", "comm_stats"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "CollectiveCount",
    "CommStats",
    "all_gather",
    "all_reduce",
    "broadcast",
    "comm_device",
    "comm_stats",
    "counting_allreduce_hook",
    "group_label",
    "group_rank",
    "group_size",
    "reduce",
    "reduce_scatter",
    "require_initialized",
]


def __getattr__(name: str) -> Any:
    """Loads a public name (or a submodule) on first use (PEP 562)."""
    if name not in _HOME_OF:
        try:  # a submodule not imported yet (``ddpkit.distributed.comm``)
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(_HOME_OF[name]), name)
    globals()[name] = value
    return value
