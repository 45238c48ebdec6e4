"""Which collective each rank was in when a job failed: a ledger of the last one, and a diagnosis across ranks.

Ranks that call different collectives (one extra ``step()``, a skipped backward, ``consolidate_state_dict`` on one
rank, a parameter frozen on one rank only) end in gloo's "Timed out" or "Connection closed by peer", which names
neither call. Every collective ddpkit issues through `ddpkit.distributed.comm` notes here, on the calling thread,
its number on this rank, its kind, group, size and the first caller outside the transport layer (a few
microseconds; nothing is sent). Wrappers also note the state that decides which collectives they issue
(`set_context`: for example ShardedDataParallel's trainable parameters).

`diagnose(timeout)`, called on a failure, writes this rank's entry to the job's store (the key-value store
every rank joined through), waits up to `timeout` seconds for the other ranks' entries, and returns lines naming
each rank's last collective and the contexts that differ between ranks. Nothing is exchanged before a failure.
`explain_uncaught_failures` prints them for an uncaught failure in a loop of the user's own.
Memory: one entry and the contexts' strings.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

_TRANSPORT = str(Path(__file__).parent)
_PACKAGE_PARENT = str(Path(__file__).parent.parent.parent)


@dataclass
class Entry:
    """This rank's last collective and its contexts."""

    calls: int = 0
    kind: str = ""
    group: str = ""
    nbytes: int = 0
    caller: str = ""
    contexts: dict[str, str] = field(default_factory=dict)


_entry = Entry()
_main_thread = threading.main_thread()
_diagnoses = 0


def _caller() -> str:
    """The first frame outside ddpkit's transport layer: ``function (path:line)``."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TRANSPORT):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.removeprefix(_PACKAGE_PARENT).lstrip("/")
    return f"{frame.f_code.co_qualname} ({path}:{frame.f_lineno})"


def note(kind: str, group: str, nbytes: int) -> None:
    """Records a collective this rank is issuing (main thread only: background channels keep their own order)."""
    if threading.current_thread() is not _main_thread:
        return
    _entry.calls += 1
    _entry.kind, _entry.group, _entry.nbytes, _entry.caller = kind, group, nbytes, _caller()


def set_context(name: str, value: str) -> None:
    """Records state that decides which collectives this rank issues (compared across ranks by `diagnose`)."""
    _entry.contexts[name] = value


def snapshot() -> dict[str, Any]:
    """This rank's entry, as `diagnose` shares it."""
    return asdict(_entry)


def describe(rank: int, entry: dict[str, Any] | None) -> str:
    """One line for one rank's entry."""
    if entry is None:
        return f"rank {rank}: no report (it ended, or is stuck outside ddpkit's collectives)"
    if not entry["calls"]:
        return f"rank {rank}: no ddpkit collective yet"
    return (
        f"rank {rank}: collective #{entry['calls']}, {entry['kind']} of {entry['nbytes']} B on {entry['group']}, "
        f"from {entry['caller']}"
    )


def compare(entries: list[dict[str, Any] | None]) -> list[str]:
    """Lines naming each rank's last collective, then every context whose value differs between ranks."""
    lines = [describe(rank, e) for rank, e in enumerate(entries)]
    known = [(rank, e) for rank, e in enumerate(entries) if e is not None]
    names = sorted({name for _, e in known for name in e["contexts"]})
    for name in names:
        values = {rank: e["contexts"].get(name, "(none)") for rank, e in known}
        if len(set(values.values())) > 1:
            lines.append(f"{name} differ: " + "; ".join(f"rank {r}: {v}" for r, v in values.items()))
    calls = {(e["calls"], e["kind"], e["group"], e["nbytes"]) for _, e in known}
    if len(known) > 1 and len(calls) > 1:
        lines.append(
            "the ranks were not in the same collective: the code took different paths on different ranks (a step, "
            "a backward, a consolidate_state_dict or a requires_grad change on some ranks only)"
        )
    return lines


def diagnose(timeout: float = 5.0) -> list[str]:
    """After a failure: shares this rank's entry through the job's store and returns `compare`'s lines for all
    ranks (waiting up to `timeout` s for them; ranks that do not report are named). [] without a process group."""
    global _diagnoses
    if not dist.is_available() or not dist.is_initialized():
        return []
    _diagnoses += 1
    try:
        store = dist.distributed_c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        prefix = f"ddpkit/ledger/{_diagnoses}/"
        store.set(f"{prefix}{rank}", json.dumps(snapshot()))
        deadline = time.monotonic() + timeout
        # its own entry is known here: read back, it was "no report" whenever the store went away meanwhile
        entries = [snapshot() if r == rank else _read(store, f"{prefix}{r}", deadline) for r in range(world)]
    except Exception:  # the store's host is gone: nothing to compare with
        return [describe(dist.get_rank(), snapshot())]
    return compare(entries)


PEER_GONE = re.compile(r"closed by peer|Connection reset|Broken pipe|ECONNRESET|EPIPE|remote worker|Socket closed")
"""What gloo says when a peer's connection went away."""


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` says a collective failed on a peer: it timed out, or the peer's connection went away."""
    text = str(exc)
    return bool(re.search(r"[Tt]imed? ?out", text) or PEER_GONE.search(text))


_EXPLAINING: list[bool] = []  # whether `explain_uncaught_failures` installed its hook in this process


def explain_uncaught_failures(timeout: float = 3.0) -> None:
    """Makes an uncaught collective failure of this process (gloo's "Timed out", a peer's connection gone) print,
    before its traceback, which collective each rank was in and what differs (`diagnose`, waiting up to `timeout`
    s for the other ranks' entries): a loop of the user's own says what ``ddpkit train`` says. Chained to the
    previous ``sys.excepthook``; installed once. ddpkit's wrappers call it when they are built."""
    if _EXPLAINING:
        return
    _EXPLAINING.append(True)
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, traceback: Any) -> None:
        if is_peer_failure(exc):
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"
            for line in diagnose(timeout):
                print(f"ddpkit: rank {rank} saw {line}", file=sys.stderr, flush=True)
        previous(kind, exc, traceback)

    sys.excepthook = hook


def _read(store: Any, key: str, deadline: float) -> dict[str, Any] | None:
    try:
        store.wait([key], timedelta(seconds=max(0.05, deadline - time.monotonic())))
        return json.loads(store.get(key))
    except Exception:
        return None
