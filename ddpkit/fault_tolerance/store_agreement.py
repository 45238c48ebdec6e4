"""Ranks of a fault-tolerant job that must agree, checked through the job's store instead of a collective.

A fault-tolerant job has no group spanning it, so the plain job's agreement check (`ddpkit.distributed.agreement`,
an all-gather) cannot run. Instead each rank writes its settings (name -> canonical text) into the store before the
job's first round (`offer`); once the round's members are decided every member compares theirs (`agree`): ranks
that differ are all refused, naming the settings and the ranks, and the job ends. The first member then records
the agreed settings as the job's; a rank that joins later compares itself with those (`check_joiner`) and alone is
refused. Sends: one key per rank (its settings' text), read by every member once; one read per joiner.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.distributed.agreement import MAX_NAMED, CannotCompare, RanksDisagree, canonical, describe_differences

SETTINGS = "settings"  # key (under the prefix) of the job's settings, as its first round agreed them


def settings_texts(settings: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, str]:
    """`settings` as name -> canonical text (equal texts exactly when the values are equal); raises
    `CannotCompare` naming a setting whose value cannot be compared by value (`agreement.canonical`)."""
    items = settings.items() if isinstance(settings, Mapping) else settings
    texts = {}
    for name, value in items:
        try:
            texts[str(name)] = value if isinstance(value, str) else canonical(value, strict=True)
        except CannotCompare as exc:
            raise CannotCompare(f"the setting {str(name)!r}: {exc}") from None
    return texts


def _key(prefix: str, rank: int | None = None) -> str:
    return prefix + SETTINGS + ("" if rank is None else f"/{rank}")


def offer(store: Any, prefix: str, rank: int, settings: dict[str, str]) -> None:
    """This rank's settings, for the first round's members to compare."""
    store.set(_key(prefix, rank), json.dumps(settings))


def record(store: Any, prefix: str, settings: dict[str, str]) -> None:
    """`settings` as the job's, unless the job's are recorded already (a re-seeded store gets them again)."""
    store.compare_set(_key(prefix), "", json.dumps(settings))


def agree(store: Any, prefix: str, rank: int, members: list[int], ended_key: str) -> None:
    """Compares the `members`' offered settings; raises `RanksDisagree` on every member (and ends the job for
    the ranks waiting to join, through `ended_key`) unless they are equal. The first member records them."""
    per_member = [json.loads(t) for t in store.multi_get([_key(prefix, r) for r in members])]
    lines = describe_differences(per_member)
    if lines:
        message = "ranks disagree on their settings: " + " | ".join(_relabel(line, members) for line in lines)
        store.compare_set(ended_key, "", message)
        raise RanksDisagree(f"rank {rank}: {message}")
    if rank == members[0]:
        record(store, prefix, per_member[0])


def check_joiner(store: Any, prefix: str, rank: int, settings: dict[str, str], timeout: float) -> None:
    """A joiner's `settings` against the job's (before it announces itself): `RanksDisagree` on this rank."""
    key = _key(prefix)
    try:
        store.wait([key], timedelta(seconds=timeout))
    except dist.DistStoreError:
        raise RanksDisagree(f"rank {rank}: the job's settings never appeared in its store") from None
    job = json.loads(store.get(key))
    differ = [k for k in dict.fromkeys([*job, *settings]) if job.get(k) != settings.get(k)]
    if differ:
        named = " | ".join(
            f"{k}: {job.get(k, '(none)')} in the job, {settings.get(k, '(none)')} on rank {rank}"
            for k in differ[:MAX_NAMED]
        )
        raise RanksDisagree(f"rank {rank} may not join: its settings differ from the job's: {named}")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _relabel(line: str, members: list[int]) -> str:
    """`describe_differences`'s line, whose ranks are positions among `members`, in global ranks."""
    return re.sub(
        r"(ranks?) (\d+(?:, \d+)*)", lambda m: _ranks([members[int(r)] for r in m.group(2).split(", ")]), line
    )
