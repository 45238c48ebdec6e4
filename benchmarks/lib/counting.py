"""Counting the bytes of collectives that torch or fairscale call from Python, in ddpkit's wire model.

ddpkit's own collectives count themselves in `ddpkit.distributed.comm_stats`, and DDP's C++ all-reduce is counted
through `counting_allreduce_hook`; torch's ZeroRedundancyOptimizer, PostLocalSGD, FSDP2 and fairscale call
``torch.distributed.broadcast/reduce/all_reduce/all_gather`` (FSDP2: ``all_gather_single`` and
``reduce_scatter_single``, ``*_tensor`` in other torch releases) from Python, which `install_counting_shim` wraps so
that those calls are recorded too. Calls made by ddpkit's `comm` module are skipped: nothing is counted twice.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ddpkit.distributed.stats import CommStats, wire_bytes

RECORDED_AS = {  # torch's name -> (ddpkit's kind, the argument whose bytes are the payload in ddpkit's model)
    "all_gather_into_tensor": ("all_gather", "input_tensor"),  # parameter gathers: what each rank gives
    "all_gather_single": ("all_gather", "input_tensor"),  # FSDP2's name for it in torch 2.13
    "reduce_scatter_tensor": ("reduce_scatter", "input"),  # gradient reduce-scatters: the whole input
    "reduce_scatter_single": ("reduce_scatter", "input"),  # FSDP2's name for it in torch 2.13
}
SHIMMED = ("broadcast", "reduce", "all_reduce", "all_gather", *RECORDED_AS)
DDPKIT_COMM = "ddpkit.distributed.comm"


def install_counting_shim(stats: CommStats, kinds: tuple[str, ...] = SHIMMED) -> None:
    """Wraps torch.distributed's Python collectives `kinds` so calls made outside ddpkit are recorded in `stats`."""
    for kind in kinds:
        original = getattr(dist, kind, None)
        if original is None:  # a name this torch does not have
            continue
        if not getattr(original, "_bench_shim", False):
            setattr(dist, kind, _counting(kind, original, stats))


def _counting(kind: str, original: Callable[..., Any], stats: CommStats) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def shim(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_globals.get("__name__") != DDPKIT_COMM:  # ddpkit counts its own
            bound = signature.bind(*args, **kwargs)
            recorded, argument = RECORDED_AS.get(kind, (kind, "tensor"))
            tensor = bound.arguments[argument]
            payload = tensor.numel() * tensor.element_size()
            size = dist.get_world_size(bound.arguments.get("group"))
            stats.record(recorded, "python", payload, wire_bytes(recorded, payload, size))
        return original(*args, **kwargs)

    shim._bench_shim = True  # type: ignore[attr-defined]
    return shim
