"""Who takes part in each synchronisation of a fault-tolerant job: quorums through a key-value store.

A fault-tolerant job (issue 24's first piece) has no fixed world: ranks ``0..max_world-1`` may die and come back.
Instead of one process group for the whole job, each synchronisation (a round, numbered alike on every rank: the
n-th outer sync) forms a quorum through a store every rank can reach (torch's TCPStore, hosted where no rank's
death takes it down, such as the launcher):

1. **Arrive**: each live rank writes its arrival key for the round. It then waits until every rank it expects has
   arrived (the last quorum's members and the ranks that announced they joined since), or `quorum_timeout`
   seconds have passed: a rank lost since the last round costs that timeout once, not every round.
2. **Decide**: the first rank to finish waiting writes the member list with an atomic compare-and-set; every rank
   reads that same list. A rank that arrived too late is not a member: it skips the round and tries the next.
   Fewer members than `min_replicas` raises `TooFewReplicas` on every rank.
3. **Group**: the members build a gloo process group of their own for the round (on the store, under the round's
   prefix, with `quorum_timeout` as its timeout), so a collective that a member never joins fails within that time
   instead of hanging, and the dead never hold up the living.
4. **Commit**: after the round's work each member says whether it succeeded; the first verdict written (all
   succeeded, or not) is everyone's, so a sync that failed anywhere is dropped everywhere (`Quorum.commit`).

A rank that starts late or restarts calls `announce_join` and waits for the next round after the latest decided
one (`next_round`); the quorum tells the others it `joined`, and the caller sends it the live state over the
round's group (for example `heal`: a broadcast from the lowest member that was in the previous quorum).

What it costs when nothing fails: per round, a few store round trips per rank and a new gloo group (a connection
per pair of members). Memory: the store keeps a few bytes per rank and round.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.comm import nbytes
from ddpkit.distributed.stats import comm_stats, wire_bytes

POLL_SECONDS = 0.02


class TooFewReplicas(RuntimeError):
    """Fewer ranks than `min_replicas` reached a quorum in time."""


@dataclass
class Quorum:
    """One round's decision: its `members` (global ranks, sorted), who `joined` or `left` since the previous
    quorum, and on members the round's `group` and this rank's `index` in it (None on a rank left out)."""

    round: int
    members: list[int]
    joined: list[int]
    left: list[int]
    previous: list[int] | None = None  # the previous round's members (None before round 1)
    group: Any = None
    index: int | None = None
    committed: bool | None = None  # the round's verdict, once `commit` returned
    _membership: Membership | None = field(default=None, repr=False)

    @property
    def is_member(self) -> bool:
        return self.index is not None

    def commit(self, ok: bool) -> bool:
        """Every member's verdict on the round's work: True only if it succeeded on every member (module doc)."""
        assert self._membership is not None
        return self._membership.commit(self, ok)


class Membership:
    """Quorums of the ranks ``0..max_world-1`` of a fault-tolerant job, one per round (module doc)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        max_world: int,
        min_replicas: int = 1,
        quorum_timeout: float = 10.0,
        prefix: str = "ddpkit/ft/",
    ) -> None:
        if not 0 <= rank < max_world:
            raise ValueError(f"Membership: rank must be in [0, max_world={max_world}), got {rank}")
        if not 1 <= min_replicas <= max_world:
            raise ValueError(f"Membership: min_replicas must be in [1, {max_world}], got {min_replicas}")
        if quorum_timeout <= 0:
            raise ValueError(f"Membership: quorum_timeout must be > 0 seconds, got {quorum_timeout}")
        self.store, self.rank, self.max_world = store, rank, max_world
        self.min_replicas, self.timeout, self.prefix = min_replicas, quorum_timeout, prefix

    def _key(self, round_: int, *parts: object) -> str:
        return f"{self.prefix}r{round_}/" + "/".join(map(str, parts))

    # -- joining -------------------------------------------------------------------------------------------------

    def announce_join(self) -> int:
        """Says this rank (re)joins, and returns the round to take part in next (after the latest decided one)."""
        latest = self.latest_round()
        for round_ in (latest + 1, latest + 2):  # the next round may be deciding already
            self._expect(round_)
        return latest + 1

    def _expect(self, round_: int) -> None:
        self.store.append(self._key(round_, "joiners"), f"{self.rank},")

    def latest_round(self) -> int:
        """The latest round whose members were decided (-1 before the first)."""
        if not self.store.check([f"{self.prefix}latest"]):
            return -1
        return int(self.store.get(f"{self.prefix}latest"))

    def _joiners(self, round_: int) -> set[int]:
        key = self._key(round_, "joiners")
        if not self.store.check([key]):
            return set()
        return {int(r) for r in self.store.get(key).decode().split(",") if r}

    # -- a round -------------------------------------------------------------------------------------------------

    def quorum(self, round_: int) -> Quorum:
        """Arrives at round `round_`, waits, and returns the decided quorum (module doc, steps 1-3)."""
        self.store.set(self._key(round_, "in", self.rank), "1")
        expected = self._expected(round_)
        deadline = time.monotonic() + self.timeout
        arrived = self._arrived(round_)
        while not expected <= arrived and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
            arrived = self._arrived(round_)
        members = self._decide(round_, sorted(arrived))
        previous = self._decided(round_ - 1)  # the same list on every rank, unlike what each rank last saw
        joined = sorted(set(members) - set(previous)) if previous is not None else []
        left = sorted(set(previous) - set(members)) if previous is not None else []
        if self.rank not in members:
            self._expect(round_ + 1)  # late: the next round waits for this rank
        if len(members) < self.min_replicas:
            raise TooFewReplicas(
                f"round {round_}: {len(members)} of {self.max_world} ranks reached the quorum within "
                f"{self.timeout:g} s (members {members}), fewer than min_replicas={self.min_replicas}"
            )
        quorum = Quorum(round_, members, joined, left, previous, _membership=self)
        if self.rank in members:
            quorum.index = members.index(self.rank)
            try:
                quorum.group = self._group(round_, quorum.index, len(members))
            except RuntimeError:  # a member vanished before connecting: the round fails (see `commit`)
                quorum.group = None
        return quorum

    def _expected(self, round_: int) -> set[int]:
        previous = self._decided(round_ - 1)
        base = set(previous) if previous is not None else set(range(self.max_world))
        return base | self._joiners(round_) | {self.rank}

    def _decided(self, round_: int) -> list[int] | None:
        key = self._key(round_, "members")
        if round_ < 0 or not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def _arrived(self, round_: int) -> set[int]:
        return {r for r in range(self.max_world) if self.store.check([self._key(round_, "in", r)])}

    def _decide(self, round_: int, arrived: list[int]) -> list[int]:
        decided = self.store.compare_set(self._key(round_, "members"), "", json.dumps(arrived))
        members = json.loads(decided)
        latest = self.latest_round()
        if round_ > latest:
            self.store.set(f"{self.prefix}latest", str(round_))
        return members

    def _group(self, round_: int, index: int, size: int) -> Any:
        store = dist.PrefixStore(self._key(round_, "pg") + "/", self.store)
        return dist.ProcessGroupGloo(store, index, size, timedelta(seconds=self.timeout))

    # -- commit ----------------------------------------------------------------------------------------------------

    def commit(self, quorum: Quorum, ok: bool) -> bool:
        """Module doc, step 4: writes this member's verdict, waits for the others' (or the timeout), and returns
        the round's verdict, which the first member to decide wrote for all."""
        self.store.set(self._key(quorum.round, "ok", self.rank), "1" if ok else "0")
        keys = [self._key(quorum.round, "ok", r) for r in quorum.members]
        deadline = time.monotonic() + self.timeout
        while not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        seen = all(self.store.check([k]) and self.store.get(k) == b"1" for k in keys)
        verdict = self.store.compare_set(self._key(quorum.round, "verdict"), "", "1" if seen else "0")
        quorum.committed = verdict == b"1"
        return quorum.committed


def heal(quorum: Quorum, tensors: list[torch.Tensor]) -> bool:
    """Sends `tensors` (the live state, the same shapes on every member) from the lowest member that was in the
    previous quorum to every member of this one, over the round's group, when someone joined; True if it did.
    A collective of the members (they all decide alike: the quorum is the same on each)."""
    if not quorum.is_member or not quorum.joined or quorum.previous is None:
        return False
    sources = [r for r in quorum.members if r in quorum.previous]
    if not sources:
        return False
    root = quorum.members.index(sources[0])
    for tensor in tensors:
        size = nbytes(tensor)
        sent = (len(quorum.members) - 1) * size if quorum.index == root else 0.0
        comm_stats.record("broadcast", "quorum", size, float(sent))
        quorum.group.broadcast([tensor], root).wait()
    return True


def quorum_mean(quorum: Quorum, flat: torch.Tensor, counts: bool) -> None:
    """In place on every member: the mean of `flat` over the members whose `counts` is True (the others, such as
    ranks that just joined, send zeros and receive the mean). One all-reduce of `flat` and one of a count, over
    the round's group; counted in `comm_stats` under the group label ``quorum``."""
    assert quorum.is_member
    weight = torch.tensor([1.0 if counts else 0.0], dtype=torch.float64)
    if not counts:
        flat.zero_()
    n = len(quorum.members)
    for tensor in (flat, weight):
        comm_stats.record("all_reduce", "quorum", nbytes(tensor), wire_bytes("all_reduce", nbytes(tensor), n))
    quorum.group.allreduce([flat]).wait()
    quorum.group.allreduce([weight]).wait()
    if weight.item() < 1:
        raise TooFewReplicas(f"round {quorum.round}: no member holds live state (every member just joined)")
    flat.div_(weight.item())
