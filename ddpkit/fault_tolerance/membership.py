"""Who takes part in each synchronisation of a fault-tolerant job: quorums through a key-value store.

A fault-tolerant job has no fixed world: ranks ``0..max_world-1`` may die and come back. Instead of one
process group for the whole job, each synchronisation (a round, numbered alike on every rank: the n-th step of
DDP, the n-th outer sync of local SGD) forms a quorum through a store every rank can reach (torch's TCPStore,
hosted where no rank's death takes it down, such as the launcher):

1. **Arrive**: each rank writes its arrival key for the round. A *live* rank (a member of the previous round, or
   any rank at round 0) then waits until every rank it expects has arrived (the previous round's members and the
   ranks that announced they join), or `quorum_timeout` seconds have passed (`start_timeout` at round 0, when
   ranks are still starting): a rank lost since the last round costs that timeout once, not every round. With
   heartbeats (`liveness`, `ddpkit.fault_tolerance.liveness`), a wait that lasts past `FIRST_WAIT` also ends once
   every rank still missing has stopped beating.
2. **Decide**: the first live rank to finish waiting writes the member list with an atomic compare-and-set; every
   rank reads that same list. A rank that is not live (it starts late, restarts, or stalled past a round) never
   decides: it waits for the live ranks' decision (up to `join_timeout`), so it cannot form a quorum of its own
   while they are still training towards the round. A rank that arrived too late skips the round and is expected
   in the next. Fewer members than `min_replicas` raises `TooFewReplicas` on every rank.
3. **Group**: the members build a gloo process group of their own for the round (on the store, under the round's
   prefix, with `quorum_timeout` as its timeout), so a collective that a member never joins fails within that time
   instead of hanging. When the members are those of the previous round and it committed, its group is reused:
   nothing is connected while nothing changes.
4. **Commit**: after the round's work each member says whether it succeeded; the first verdict written (all
   succeeded, or not) is everyone's, so a round that failed anywhere is dropped everywhere (`Quorum.commit`).
   When every member succeeded and no rank asked to join the next round, the verdict's writer also decides the
   next round with the same members (`predict_next`): the members then start it without a store round trip. A
   rank lost between two such rounds makes the next one's collective fail (at once when its machine resets the
   connection, within `quorum_timeout` when it is silent) and is dropped at the round after.

A rank that starts late or restarts calls `announce_join` and takes part from the next round after the latest
decided one; the quorum tells the others it `joined`, and the members send it the live state over the round's
group (`heal_object`: sent point to point from the lowest member that was in the previous quorum to each joiner
alone).

What it costs when nothing fails: per round the commit's 2-4 store round trips per member (about 100 us each
from Python on one host) and no new connection; a round's first member deletes the keys of the round
`KEPT_ROUNDS` before (`forget_through`, in the background: first a tombstone, the latest round forgotten, which a
rank that was stopped reads at once and rejoins from the latest round; then one delete per key, its arrivals' and
its group's included; about five for a round decided ahead). Memory:
the store keeps a few bytes per rank for `KEPT_ROUNDS` rounds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed import wire_format
from ddpkit.distributed.comm import nbytes
from ddpkit.distributed.stats import comm_stats, wire_bytes
from ddpkit.fault_tolerance.clock import Clock, SystemClock
from ddpkit.fault_tolerance.connections import side_connection
from ddpkit.fault_tolerance.job_secret import seal, secret_of, unseal
from ddpkit.fault_tolerance.reachability import format_report, parse_reports, reachable_side

DEFAULT_PREFIX = "ddpkit/ft/"
FIRST_WAIT = 1.0  # seconds a quorum waits for everyone before it asks whether those missing still beat
REFILL_TIMEOUTS = 3  # quorum timeouts a round short of min_replicas waits on for ranks to come back
POLL_SECONDS = 0.05  # how often it looks again after that
NO_VALUE = "\x00none"  # a value no key holds: compare_set(key, NO_VALUE, NO_VALUE) reads a key that exists in one
# request (a TCPStore's get waits for the key first: two), changing nothing
KEPT_ROUNDS = 8  # a round's keys are deleted once this many later rounds committed (a late joiner may still read)
UNKNOWN = b"?"  # the verdict of a round forgotten before this member learned it (it was stopped meanwhile)
LATEST = "latest"  # key (under the prefix) of the latest decided round
ENDED = "ended"  # key of the message that ended the job (too few replicas)
FINAL = "final"  # key of the members of the job's last round: the job is over, nobody joins it any more
LEAVERS = "leavers"  # key of "rank@round," entries: the rank takes part in no round from `round` on (-1: back)
FORGOTTEN = "forgotten"  # key of the latest round whose keys are deleted (written before they go: a tombstone)


def round_key(prefix: str, round_: int, *parts: object) -> str:
    """The store key of round `round_`'s entry `parts` (its members: ``round_key(prefix, r, "members")``)."""
    return f"{prefix}r{round_}/" + "/".join(map(str, parts))


def latest_round(store: Any, prefix: str = DEFAULT_PREFIX) -> int:
    """The latest round whose members were decided in the job's `store` (-1 before the first)."""
    if not store.check([prefix + LATEST]):
        return -1
    return int(store.get(prefix + LATEST))


def forgotten_through(store: Any, prefix: str = DEFAULT_PREFIX) -> int:
    """The latest round whose keys were deleted (-1: none), in one request: recorded before they go, so a round
    at or below it is long past even while some of its keys still exist."""
    seen = store.compare_set(prefix + FORGOTTEN, NO_VALUE, NO_VALUE)
    return -1 if seen in (NO_VALUE.encode(), b"") else int(seen)


def _advance_record(store: Any, key: str, round_: int, expected: bytes) -> bytes:
    """Sets the round record `key` to `round_` unless a later round is recorded already (it only moves forward);
    a compare-and-set from `expected`, the value the caller saw last (one request when nobody else moved it).
    Returns the value written, for the caller's next `expected`."""
    new = str(round_).encode()
    while True:
        seen = store.compare_set(key, expected, new)
        if seen == new:
            return new
        if seen == expected:  # (the key is missing: a compare-and-set from a value returns that value)
            expected = b""
            continue
        if int(seen) >= round_:
            return new
        expected = seen


def decided_members(store: Any, prefix: str, round_: int) -> list[int] | None:
    """The members decided for round `round_` (None: not decided, or its keys deleted already)."""
    key = round_key(prefix, round_, "members")
    if round_ < 0 or not store.check([key]):
        return None
    return json.loads(store.get(key))


def latest_members(store: Any, prefix: str = DEFAULT_PREFIX) -> list[int] | None:
    """The members of the latest round decided in the job's `store` (None before the first is decided): what a
    process that watches the job from outside (node 0's launcher) reads."""
    return decided_members(store, prefix, latest_round(store, prefix))


class TooFewReplicas(RuntimeError):
    """Fewer ranks than `min_replicas` reached a quorum in time."""


class PeersUnreachable(RuntimeError):
    """This rank reaches the job's store but, for `join_timeout`, not the members of its rounds."""


class JobFinished(RuntimeError):
    """The job this rank would join has finished (its last round's members said so): there is nothing to join.
    A job's name (its store's prefix, an etcd job name) names one run: a new run takes a new name."""


@dataclass
class Quorum:
    """One round's decision: its `members` (global ranks, sorted), who `joined` or `left` since the previous
    quorum, and on members the round's `group` and this rank's `index` in it (None on a rank left out).
    `waited`: seconds this rank spent from its arrival to the decision."""

    round: int
    members: list[int]
    joined: list[int]
    left: list[int]
    previous: list[int] | None = None  # the previous round's members (None before round 1)
    group: Any = None
    index: int | None = None
    committed: bool | None = None  # the round's verdict, once `commit` returned (None: unknown to this member)
    verdict_unknown: bool = False  # the round was forgotten before this member learned its verdict
    next_decided: bool = False  # its commit decided the next round too: the same members (module doc, step 4)
    waited: float = 0.0
    resume_at: int | None = None  # on a rank left out: the round it is expected at next (None: the next one)
    _membership: Membership | None = field(default=None, repr=False)

    @property
    def secret(self) -> bytes | None:
        """The job's secret its messages are tagged with (`ddpkit.fault_tolerance.job_secret`); None: untagged."""
        return None if self._membership is None else secret_of(self._membership.store)

    @property
    def is_member(self) -> bool:
        return self.index is not None

    @property
    def next_round(self) -> int:
        """The round this rank takes part in next: the following one, or for a rank left out of a round long past
        the one after the latest decided (it catches up at once instead of walking the rounds between)."""
        return self.round + 1 if self.resume_at is None else self.resume_at

    @property
    def changed(self) -> bool:
        return bool(self.joined or self.left)

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
        quorum_timeout: float = 5.0,
        prefix: str = DEFAULT_PREFIX,
        *,
        start_timeout: float | None = None,
        join_timeout: float = 300.0,
        predict_next: bool = True,
        clock: Clock | None = None,
    ) -> None:
        if not 0 <= rank < max_world:
            raise ValueError(f"Membership: rank must be in [0, max_world={max_world}), got {rank}")
        if not 1 <= min_replicas <= max_world:
            raise ValueError(f"Membership: min_replicas must be in [1, {max_world}], got {min_replicas}")
        if quorum_timeout <= 0:
            raise ValueError(f"Membership: quorum_timeout must be > 0 seconds, got {quorum_timeout}")
        self.store, self.rank, self.max_world = store, rank, max_world
        self.min_replicas, self.timeout, self.prefix = min_replicas, quorum_timeout, prefix
        self.start_timeout = max(quorum_timeout, start_timeout or 0.0)
        self.join_timeout = join_timeout
        self.predict_next = predict_next
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._forgetting: Any = None  # the store connection `forget_through` deletes through
        self._latest_written = b""  # the latest round this rank recorded (`advance_latest`)
        self._forgotten_through = -1  # the rounds whose keys this rank deleted (`forget_through`)
        self._tombstone = b""  # the latest forgotten round this rank recorded (`forget_through`)
        self.liveness: Any = None  # a `ddpkit.fault_tolerance.liveness.Liveness`: stop waiting for ranks that are gone
        self.joining = False  # announced a join and not yet a member
        self.last: Quorum | None = None  # the last round this rank was a member of
        # called with round 0's members on each of them once decided, before the round's group is made: ranks
        # that must agree are compared there, so a rank that differs is refused like the others, never left
        # waiting in a connection they abandoned (`Manager`'s settings agreement)
        self.first_round_check: Any = None
        self.lanes = 1  # the groups each round makes (one per process of a replica: `replica_membership`)
        # a `ddpkit.fault_tolerance.reachability.Reachability`: a failed round reports the peers this rank could not
        # reach, decisions keep ranks that reach each other, a join waits until it reaches the members (None: not)
        self.reach: Any = None

    def _key(self, round_: int, *parts: object) -> str:
        return round_key(self.prefix, round_, *parts)

    # -- joining -------------------------------------------------------------------------------------------------

    def announce_join(self) -> int:
        """Says this rank (re)joins without live state, and returns the round to take part in next (after the
        latest decided one); it counts as joined in the first round it is a member of."""
        self.last = None
        if self.rank in self._left(1 << 62):  # it left before: it is back
            self.store.append(self.prefix + LEAVERS, f"{self.rank}@-1,")
        self.joining = True
        return self._expect_from_latest()

    def _expect_from_latest(self) -> int:
        """Asks the two rounds after the latest decided one to expect this rank (the next may be deciding, or be
        decided ahead, already), once it reaches their members (`_await_reach`); returns the first of them."""
        self._await_reach()
        latest = self.latest_round()
        for round_ in (latest + 1, latest + 2):
            self._expect(round_)
        return latest + 1

    def _expect(self, round_: int) -> None:
        self.store.append(self._key(round_, "joiners"), f"{self.rank},")
        self._mark_change(round_)

    def _mark_change(self, round_: int) -> None:
        """Marks round `round_` as one whose members may differ from the round before (a rank joins or leaves at
        it), so that no commit decides it ahead with the same members (`_success_verdict`: one look)."""
        self.store.append(self._key(round_, "changes"), f"{self.rank},")

    def _await_reach(self) -> None:
        """With `reach`: waits until this rank reaches every member of the latest round on the data plane (probed
        about once a second), so that a rank cut off from its peers never joins a round only to fail it; raises
        `PeersUnreachable` after `join_timeout`."""
        if self.reach is None:
            return
        deadline = self.clock.monotonic() + self.join_timeout
        while True:
            members = decided_members(self.store, self.prefix, self.latest_round()) or []
            unreached = self.reach.unreached(self.store, members)
            if not unreached:
                return
            if self.clock.monotonic() > deadline:
                raise PeersUnreachable(
                    f"rank {self.rank} reaches the job's store but not its members {unreached} (a TCP connect to "
                    f"each failed for {self.join_timeout:g} s): check the network between the machines (a "
                    "firewall, a route, GLOO_SOCKET_IFNAME)"
                )
            self.clock.sleep(POLL_SECONDS * 20)

    def latest_round(self) -> int:
        """The latest round whose members were decided (-1 before the first)."""
        return latest_round(self.store, self.prefix)

    def _joiners(self, round_: int) -> set[int]:
        key = self._key(round_, "joiners")
        if not self.store.check([key]):
            return set()
        return {int(r) for r in self.store.get(key).decode().split(",") if r}

    def raise_if_finished(self) -> None:
        """Raises `JobFinished` when the job's last round was recorded (`FINAL`): nobody joins it any more."""
        if self.store.check([self.prefix + FINAL]):
            members = self.store.get(self.prefix + FINAL).decode()
            raise JobFinished(
                f"the fault-tolerant job finished already (its last members: {members}); nothing to join. A job's "
                "store stands for one run: start a new run on a fresh store (a store of its own: another "
                "--master-port, or `ddpkit store` started again) or, on etcd, under a new name (etcd://.../NEW-NAME)"
            )

    def _live(self, round_: int) -> bool:
        """Whether this rank holds live state for `round_`: it was a member of the round before (or it is round 0
        and this rank did not announce a join)."""
        if self.last is not None and self.last.round == round_ - 1:
            return True
        return round_ == 0 and not self.joining

    # -- a round -------------------------------------------------------------------------------------------------

    def decided_ahead(self, round_: int) -> bool:
        """Whether round `round_` was decided by this rank's last commit (the same members: `quorum` then makes no
        store call and returns at once)."""
        last = self.last
        return last is not None and last.round == round_ - 1 and last.next_decided

    def quorum(self, round_: int) -> Quorum:
        """Arrives at round `round_`, waits, and returns the decided quorum (module doc, steps 1-3)."""
        last = self.last
        if last is not None and last.round == round_ - 1 and last.next_decided:  # decided by the last commit
            return self._member_of(Quorum(round_, last.members, [], [], last.members, _membership=self))
        now = self.clock.monotonic
        arrival = now()
        live = self._live(round_)
        if not live:  # before the arrival key: a member whose arrival anyone saw is listed by then (`_joined`)
            self.store.append(self._key(round_, "joining"), f"{self.rank},")
        self.store.set(self._key(round_, "in", self.rank), "live" if live else "joining")
        self.store.append(self._key(round_, "arrived"), f"{self.rank},")  # who arrived, for O(members) reads
        previous = self._previous(round_)
        if live:  # (a round decided already, without this late rank, is what `_decide` returns)
            arrived = self._await_arrivals(round_, self._expected(round_, previous), arrival)
            if len(arrived) < self.min_replicas and round_ > 0:
                arrived = self._await_refill(round_, arrived)
            members: list[int] | None = self._decide(round_, self._reachable(round_, sorted(arrived)))
        else:
            members = self._await_decision(round_)  # (None: long past)
        if members is None or self._forgotten(round_):  # (after deciding: a forget may have run in between)
            return self._left_behind(round_, previous, now() - arrival)
        joined = self._joined(round_, members) if previous is not None else []
        left = sorted(set(previous) - set(members)) if previous is not None else []
        quorum = Quorum(round_, members, joined, left, previous, waited=now() - arrival, _membership=self)
        if self.rank not in members:  # late: the next round to be decided waits for this rank
            quorum.resume_at = max(round_ + 1, self._expect_from_latest())
            self.joining = True
        if len(members) < self.min_replicas:
            waited = self.timeout * (1 + (REFILL_TIMEOUTS if round_ > 0 else 0))
            message = (
                f"round {round_}: {len(members)} of {self.max_world} ranks reached the quorum within "
                f"{waited:g} s (members {members}), fewer than min_replicas={self.min_replicas}"
            )
            self.store.compare_set(self.prefix + ENDED, "", message)  # ranks waiting to join stop too
            raise TooFewReplicas(message)
        if self.rank in members:
            if round_ == 0 and self.first_round_check is not None:  # before any connection is made
                self.first_round_check(members)
            if members.index(self.rank) == 0:
                self.advance_latest(round_)
            self._member_of(quorum)
        return quorum

    def _left_behind(self, round_: int, previous: list[int] | None, waited: float) -> Quorum:
        """This rank was stopped while the job went on past `round_` and forgot it: what it wrote there goes (no
        key of a round forgotten stays behind), and it is expected at the round after the latest decided one, which
        it takes part in next (`Quorum.next_round`) instead of walking the rounds between."""
        if self._forgotten(round_):
            self._erase(self.store, round_)
        resume = self._expect_from_latest()
        self.joining, self.last = True, None
        return Quorum(round_, [], [], [], previous, waited=waited, resume_at=resume, _membership=self)

    def _member_of(self, quorum: Quorum) -> Quorum:
        """`quorum`, decided with this rank in it, as this rank's latest: its index and group."""
        quorum.index = quorum.members.index(self.rank)
        quorum.group = self._group_for(quorum)
        self.joining = False
        self.last = quorum
        return quorum

    def _previous(self, round_: int) -> list[int] | None:
        """The members of the round before `round_` (the same list on every rank)."""
        if self.last is not None and self.last.round == round_ - 1:
            return self.last.members
        return self._decided(round_ - 1)

    def _joined(self, round_: int, members: list[int]) -> list[int]:
        """The members of `round_` that arrived without live state: they listed themselves in the round's
        ``joining`` key before writing their arrival (one read, whatever the number of members). A member that never
        arrived (the round was decided by the previous commit, `predict_next`, whose members all hold live state)
        is not listed."""
        key = self._key(round_, "joining")
        if not self.store.check([key]):
            return []
        listed = {int(r) for r in self.store.get(key).decode().split(",") if r}
        return [r for r in members if r in listed]

    def _expected(self, round_: int, previous: list[int] | None) -> set[int]:
        base = set(previous) if previous is not None else set(range(self.max_world))
        return (base - self._left(round_)) | self._joiners(round_) | {self.rank}

    # -- leaving -------------------------------------------------------------------------------------------------

    def announce_leave(self, round_: int) -> None:
        """Says this rank takes part in no round from `round_` on (it ends, or is told to stop): no quorum
        waits for it, and the round before it is not used to decide `round_` ahead (`_success_verdict`)."""
        self.store.append(self.prefix + LEAVERS, f"{self.rank}@{round_},")
        for marked in (round_, round_ + 1):  # (the round before `round_` may have been decided ahead already)
            self._mark_change(marked)

    def _left(self, round_: int) -> set[int]:
        """The ranks that announced they take part in no round from `round_` or before on, and did not join again
        since (each rank's latest entry counts)."""
        key = self.prefix + LEAVERS
        if not self.store.check([key]):
            return set()
        latest: dict[int, int] = {}
        for entry in filter(None, self.store.get(key).decode().split(",")):
            rank, at = entry.split("@")
            latest[int(rank)] = int(at)
        return {rank for rank, at in latest.items() if 0 <= at <= round_}

    def _await_arrivals(self, round_: int, expected: set[int], since: float) -> set[int]:
        """The ranks that arrived at `round_` once all of `expected` did, the round's timeout passed, or (after
        round 0, with `liveness`) every rank still missing stopped beating (`ddpkit.fault_tolerance.liveness`)."""
        limit = self.start_timeout if round_ == 0 else self.timeout
        keys = [self._key(round_, "in", r) for r in sorted(expected)]
        first = limit if self.liveness is None or round_ == 0 else min(limit, FIRST_WAIT)
        try:
            self.store.wait(keys, timedelta(seconds=max(1e-3, since + first - self.clock.monotonic())))
            return expected  # (a rank that was not expected announced itself too late: it is expected next round)
        except dist.DistStoreError:
            pass  # someone is missing: wait on while it beats, quietly (a timed-out wait logs a warning)
        while self.clock.monotonic() < since + limit:
            missing = [r for r, key in zip(sorted(expected), keys, strict=True) if not self.store.check([key])]
            if not missing or (self.liveness is not None and self.liveness.gone(self.store, missing)):
                break
            self.clock.sleep(POLL_SECONDS)
        return self._arrived(round_)

    def _await_refill(self, round_: int, arrived: set[int]) -> set[int]:
        """The ranks that arrived at `round_` once `min_replicas` did, or `REFILL_TIMEOUTS` more quorum timeouts
        passed: a round short of the minimum (a member paused for a few seconds, a machine restarting) waits for
        ranks to come back before the job ends for good."""
        deadline = self.clock.monotonic() + REFILL_TIMEOUTS * self.timeout
        while len(arrived) < self.min_replicas and self.clock.monotonic() < deadline:
            self.clock.sleep(POLL_SECONDS * 4)
            arrived = self._arrived(round_)
        return arrived

    def _arrived(self, round_: int) -> set[int]:
        """The ranks that arrived at `round_` so far (each appends itself on arrival)."""
        key = self._key(round_, "arrived")
        if not self.store.check([key]):
            return set()
        return {int(r) for r in self.store.get(key).decode().split(",") if r}

    def _await_decision(self, round_: int) -> list[int] | None:
        """The members of `round_` as the live ranks decide them (None: the round is long past and its keys were
        deleted); TooFewReplicas if none is decided in `join_timeout`."""
        key, ended = self._key(round_, "members"), self.prefix + ENDED
        deadline = self.clock.monotonic() + self.join_timeout
        while True:
            if self._forgotten(round_):
                return None  # (its tombstone says so at once: no wait for keys that are gone)
            try:
                self.store.wait([key], timedelta(seconds=min(1.0, max(1e-3, deadline - self.clock.monotonic()))))
                return json.loads(self.store.get(key))
            except dist.DistStoreError:
                if self.latest_round() >= round_ + KEPT_ROUNDS // 2:
                    return None  # this rank was stopped for a long while: it joins a later round
                if self.store.check([ended]):
                    raise TooFewReplicas(f"the job ended: {self.store.get(ended).decode()}") from None
                self.raise_if_finished()
                if self.clock.monotonic() > deadline:
                    raise TooFewReplicas(
                        f"round {round_}: no live rank decided its quorum within {self.join_timeout:g} s (is any "
                        "rank of the job still training?)"
                    ) from None

    def _decided(self, round_: int) -> list[int] | None:
        return decided_members(self.store, self.prefix, round_)

    def _forgotten(self, round_: int) -> bool:
        """Whether `round_` is long past: its keys are deleted (`forget_through` records the latest round it
        deletes before deleting anything: a tombstone), so deciding it now would make a quorum of this late rank
        alone. One request."""
        return forgotten_through(self.store, self.prefix) >= round_

    def _reachable(self, round_: int, arrived: list[int]) -> list[int]:
        """Of `arrived`, the ranks that can reach each other by what the previous round's failed members reported
        (`reachability.reachable_side`; one read, after a failed round only)."""
        last = self.last
        if last is None or last.round != round_ - 1 or last.committed is not False:
            return arrived
        key = self._key(round_ - 1, "unreached")
        if not self.store.check([key]):
            return arrived
        return reachable_side(arrived, parse_reports(self.store.get(key).decode()))

    def _report_unreached(self, quorum: Quorum) -> None:
        """After this member's part of `quorum` failed: the members it cannot reach on the data plane, reported for
        the next decision (`reach`; nothing when all answer)."""
        if self.reach is None or len(quorum.members) < 2:
            return
        unreached = self.reach.unreached(self.store, quorum.members)
        if unreached:
            self.store.append(self._key(quorum.round, "unreached"), format_report(self.rank, unreached))

    def _decide(self, round_: int, arrived: list[int]) -> list[int]:
        return json.loads(self.store.compare_set(self._key(round_, "members"), "", json.dumps(arrived)))

    def _group_for(self, quorum: Quorum, lane: int = 0) -> Any:
        """The round's process group: the previous round's when it committed with the same members, else a new
        one (None if a member vanished before connecting: the round then fails, see `commit`). `lane`: which of a
        replica's processes this group joins across the members (`ddpkit.fault_tolerance.replica_membership`)."""
        last = self.last
        same = last is not None and last.round == quorum.round - 1 and last.members == quorum.members
        if same and last.committed and last.group is not None:  # type: ignore[union-attr]
            return last.group  # type: ignore[union-attr]
        try:
            return self.connect(self._group_key(quorum.round, lane), quorum)
        except RuntimeError:
            return None

    def connect(self, key: str, quorum: Quorum) -> Any:
        """A new process group of `quorum`'s members (this rank at `quorum.index`), meeting in the store under
        `key`: gloo, whose calls fail after the round's timeout when a member is gone. Raises a RuntimeError when
        a member never connects. (The seam where a simulated transport goes: tests/test_protocol_fake_clock.py.)"""
        store = dist.PrefixStore(key + "/", self.store)
        return dist.ProcessGroupGloo(store, quorum.index, len(quorum.members), timedelta(seconds=self.timeout))

    def _group_key(self, round_: int, lane: int) -> str:
        return self._key(round_, "pg") if lane == 0 else self._key(round_, "pg", f"lane{lane}")

    def continue_at(self, quorum: Quorum, round_: int) -> None:
        """Makes this member's `quorum` (the first round of a job resumed from a checkpoint) stand for round
        `round_`, so that the job's rounds go on from there (numbered by step, as before the checkpoint). Its
        first member records it in the store (the members and the latest round, for ranks that join later);
        call it on every member before the quorum's commit, so nobody goes on before the record exists."""
        if quorum.index == 0:
            self.store.compare_set(self._key(round_, "members"), "", json.dumps(quorum.members))
            self.advance_latest(round_)
        quorum.round = round_
        self.last = quorum

    # -- commit ----------------------------------------------------------------------------------------------------

    def commit(self, quorum: Quorum, ok: bool) -> bool:
        """Module doc, step 4: the round's verdict, the same on every member. A member that failed writes "0" at
        once (compare-and-set: a dead member never reports). One that succeeded reports and counts the reports
        (`_reported_last`): the member whose report was the last proposes "1"; the others wait
        for the verdict, and one that waits `quorum_timeout` in vain (a member died or stalled without failing
        anywhere else) writes "0". The first verdict written is everyone's: 2-4 store round trips per member (one
        more on etcd or under a job secret), none of them retried under contention."""
        verdict_key = self._key(quorum.round, "verdict")
        if not ok:  # and no report of its own: nobody sees every report, nobody proposes "1"
            self._report_unreached(quorum)  # (before its verdict: the next decider reads it)
            return self._take_verdict(quorum, self._write_failed(quorum))
        started = self.clock.monotonic()
        if self._reported_last(quorum):
            # a member stopped between its report and its proposal longer than a round's timeout may find its round
            # over and forgotten (the others gave up waiting): it proposes nothing there (one look, on that path only)
            if self.clock.monotonic() - started > self.timeout and self._forgotten(quorum.round):
                return self._take_verdict(quorum, UNKNOWN)
            verdict = self.store.compare_set(verdict_key, "", self._success_verdict(quorum))
            if verdict == b"1+":  # this report's writer won the verdict: it writes the next round it promised
                self._decide_next(quorum)
        else:
            verdict = self._await_verdict(quorum)
        return self._take_verdict(quorum, verdict)

    def _reported_last(self, quorum: Quorum) -> bool:
        """Reports this member's success and says whether every member's report is in. Reports are counted in
        one request: etcd counts the round's report keys (nobody contends; a shared counter there is a
        compare-and-swap retried against every other member), another store adds to one counter (its server
        answers an add alone). Under a job secret the count, which anyone reaching the store could inflate, is only
        a trigger: the report keys themselves are waited for and their tags checked. A report key is written only
        where something reads it (etcd's count, a secret's check)."""
        n, round_ = len(quorum.members), quorum.round
        if _keeps_report_keys(self.store):
            self.store.set(self._key(round_, "report", self.rank), "1")
        if _counts_keys(self.store):
            seen = self.store.count_prefix(self._key(round_, "report") + "/")
        else:
            seen = self.store.add(self._key(round_, "reported"), 1)
        if seen < n:
            return False
        if secret_of(self.store) is None:
            return True
        reports = [self._key(round_, "report", r) for r in quorum.members]
        try:
            self.store.wait(reports, timedelta(seconds=self.timeout))
        except dist.DistStoreError:
            return False  # (a member never reported: the verdict waited for next says so)
        return all(value == b"1" for value in self.store.multi_get(reports))

    def read_verdict(self, quorum: Quorum) -> bool:
        """`quorum`'s verdict as the store holds it, for a member whose own report may or may not have landed (its
        connection broke in the commit): waited for as a member that reported waits for it."""
        return self._take_verdict(quorum, self._await_verdict(quorum))

    def _await_verdict(self, quorum: Quorum) -> bytes:
        """The round's verdict once written, waited for up to the round's timeout; after that this member writes
        "failed" (a member died or stalled without failing anywhere else; the first verdict written stands)."""
        key = self._key(quorum.round, "verdict")
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
        except dist.DistStoreError:
            return self._write_failed(quorum)
        return self.store.compare_set(key, NO_VALUE, NO_VALUE)  # its value in one request (`NO_VALUE`)

    def _write_failed(self, quorum: Quorum) -> bytes:
        """Writes "0" as the round's verdict unless one was written first, and returns the verdict; `UNKNOWN` when
        the round was forgotten (its tombstone covers it) before this member could learn it: this member was
        stopped while the others went on, so the verdict it would write (or read) is not the round's. Checked
        again after the write (a forget in between): what it wrote then goes."""
        if self._forgotten(quorum.round):
            return UNKNOWN
        verdict = self.store.compare_set(self._key(quorum.round, "verdict"), "", "0")
        if verdict == b"0" and self._forgotten(quorum.round):
            self.store.delete_key(self._key(quorum.round, "verdict"))
            return UNKNOWN
        return verdict

    def _take_verdict(self, quorum: Quorum, verdict: bytes) -> bool:
        """`quorum`'s verdict as this member takes it; an `UNKNOWN` one makes this rank hold no live state (it was
        stopped while the others went on: it joins again)."""
        quorum.verdict_unknown = verdict == UNKNOWN
        if quorum.verdict_unknown:
            self.last = None
        quorum.committed = None if quorum.verdict_unknown else verdict in (b"1", b"1+")
        quorum.next_decided = verdict == b"1+"
        if not quorum.committed and quorum.group is not None:
            quorum.group = None  # a failed round's group may hold a half-done collective: the next round makes anew
        return bool(quorum.committed)

    def _success_verdict(self, quorum: Quorum) -> str:
        """The verdict of a round that succeeded on every member, proposed by its last reporter: "1+" when it also
        decides the next round with the same members (nobody asked to join it: the members' next quorum needs no
        store round trip; `_decide_next` writes it once the verdict is won), else "1". Whether anyone joins or
        leaves at the next round is one look at its mark (`_mark_change`)."""
        if not self.predict_next or self.store.check([self._key(quorum.round + 1, "changes")]):
            return "1"
        return "1+"

    def _decide_next(self, quorum: Quorum) -> None:
        """Writes the round after `quorum` with the same members, as its verdict "1+" promised. Only the verdict's
        writer does, after winning it: a reporter that came too late (its round was decided without it) writes
        nothing, so it can never overwrite a later decision."""
        following = quorum.round + 1
        self.store.compare_set(self._key(following, "members"), "", json.dumps(quorum.members))
        self.advance_latest(following)

    def advance_latest(self, round_: int) -> None:
        """Records `round_` as the latest decided round unless a later one is recorded already: the record only
        moves forward, so a rank that was paused and writes late cannot move the job back. A compare-and-set from
        the value this rank saw last (one store round trip when nobody else moved it)."""
        self._latest_written = _advance_record(self.store, self.prefix + LATEST, round_, self._latest_written)

    def forget_through(self, round_: int) -> None:
        """Deletes the keys of every round up to `round_` not deleted yet by this rank (at most
        `2 * KEPT_ROUNDS` rounds a call: a rank that becomes the rounds' first member starts from there), so the
        store holds a bounded number of rounds however long the job runs. Run in the background
        (`Manager`): on a connection of its own (`store.clone()`), so that it never holds up the rounds."""
        start = max(self._forgotten_through + 1, round_ - 2 * KEPT_ROUNDS, 0)
        if start > round_:
            return
        store = self._cleaner_store()
        self._tombstone = _advance_record(store, self.prefix + FORGOTTEN, round_, self._tombstone)  # (first)
        for old in range(start, round_ + 1):
            self._erase(store, old)
        self._forgotten_through = max(self._forgotten_through, round_)

    def _cleaner_store(self) -> Any:
        """The connection old rounds are deleted through (`forget_through`, on the cleaner's thread)."""
        if self._forgetting is None:
            self._forgetting = side_connection(self.store)
        return self._forgetting

    def _erase(self, store: Any, round_: int) -> None:
        """Deletes round `round_`'s keys through `store`: its arrivals (those that arrived: O(members), not
        O(max_world)), joiners, members, reports, verdict and its group's rendezvous keys. A round decided ahead by
        the commit before it (nobody arrived at it) made no arrival and no group of its own: its few keys go in
        about five requests, not three times as many."""
        arrived_key, members_key = self._key(round_, "arrived"), self._key(round_, "members")
        arrived = store.get(arrived_key).decode().split(",") if store.check([arrived_key]) else []
        reports = _keeps_report_keys(store)
        members = json.loads(store.get(members_key)) if (arrived or reports) and store.check([members_key]) else []
        keys = [self._key(round_, "in", r) for r in arrived if r]
        keys += [self._key(round_, "report", r) for r in members] if reports else []
        parts = ("arrived", "joining") if arrived else ()
        parts += ("changes", "joiners", "members", "reported", "verdict", "unreached")
        keys += [self._key(round_, part) for part in parts]
        if arrived:  # (a round decided ahead uses the group of the round before)
            keys += [
                self._group_key(round_, lane) + f"//0/{i}" for lane in range(self.lanes) for i in range(len(members))
            ]
        for key in keys:
            store.delete_key(key)


def _counts_keys(store: Any) -> bool:
    """Whether `store` counts the keys under a prefix in one request (etcd: `EtcdStore.count_prefix`)."""
    return callable(getattr(store, "count_prefix", None))


def _keeps_report_keys(store: Any) -> bool:
    """Whether a round's members write a report key each (`Membership._reported_last`): where something reads
    them, a store that counts keys or a job secret that checks them."""
    return _counts_keys(store) or secret_of(store) is not None


def heal_source(quorum: Quorum) -> int | None:
    """The global rank of the member that sends live state to this round's joiners (the lowest member that
    holds it), or None when nobody joined (or nobody holds live state)."""
    if not quorum.is_member or not quorum.joined:
        return None
    sources = [r for r in quorum.members if r not in quorum.joined]
    return sources[0] if sources else None


def _heal_root(quorum: Quorum) -> int | None:
    """`heal_source` as an index into the round's members (its rank in the round's group)."""
    source = heal_source(quorum)
    return None if source is None else quorum.members.index(source)


def _broadcast(group: Any, index: int, size: int, tensor: torch.Tensor, root: int, label: str | None) -> None:
    if label is not None:
        sent = (size - 1) * nbytes(tensor) if index == root else 0.0
        comm_stats.record("broadcast", label, nbytes(tensor), float(sent))
    group.broadcast(tensor, root).wait()


def heal_object(quorum: Quorum, obj: Callable[[], Any] | None) -> Any:
    """The live state, sent by the heal source to this round's joiners alone: on the source, `obj()` is called
    and its value (tensors, numbers, strings and containers of them, encoded by `ddpkit.distributed.wire_format`,
    never pickled) sent to each joiner, point to point (its length, then its bytes); a joiner returns what it
    received; every other member sends and receives nothing and returns None (as does everyone when nobody
    joined). Bytes on the wire: the encoded state once per joiner."""
    root = _heal_root(quorum)
    if root is None or quorum.index is None:
        return None
    joiners = [quorum.members.index(r) for r in quorum.joined]
    tag = (quorum.round % (1 << 20)) + (1 << 21)  # (apart from `quorum_exchange`'s tags)
    if quorum.index == root:
        assert obj is not None, "heal_object: the heal source must give the live state"
        payload = seal(wire_format.encode(obj()), quorum.secret, f"heal of round {quorum.round}")
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        works = []
        for joiner in joiners:
            comm_stats.record("send", "heal", nbytes(length) + nbytes(payload), float(nbytes(length) + nbytes(payload)))
            works += [quorum.group.send([length], joiner, tag), quorum.group.send([payload], joiner, tag + 1)]
        for work in works:
            work.wait()
        return None
    if quorum.index not in joiners:
        return None
    length = torch.empty(1, dtype=torch.int64)
    quorum.group.recv([length], root, tag).wait()
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    quorum.group.recv([payload], root, tag + 1).wait()
    return wire_format.decode(unseal(payload, quorum.secret, f"heal of round {quorum.round}"))


def broadcast_object_from(quorum: Quorum, obj: Any, root: int) -> Any:
    """`obj` (what `wire_format` sends) as member index `root` has it, on every member (a collective of the members)."""
    assert quorum.index is not None
    return broadcast_object_over(
        quorum.group,
        quorum.index,
        len(quorum.members),
        obj,
        root,
        "quorum",
        (quorum.secret, f"broadcast of round {quorum.round}"),
    )


def broadcast_object_over(
    group: Any,
    index: int,
    size: int,
    obj: Any,
    root: int,
    label: str | None,
    signed: tuple[bytes | None, str] = (None, ""),
) -> Any:
    """`obj` (what `wire_format` sends) as rank `root` of `group` has it, on every rank of it: `group` is a ProcessGroup
    object of `size` ranks, this process its rank `index` (called directly, so it need not be registered). Two
    broadcasts, the length then the bytes, counted in `comm_stats` under `label` (None: not counted). `signed`: the
    job's secret and what the message is, to tag it (`job_secret.seal`; no secret: untagged)."""
    secret, context = signed
    payload = seal(wire_format.encode(obj), secret, context) if index == root else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    _broadcast(group, index, size, length, root, label)
    if index != root:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    _broadcast(group, index, size, payload, root, label)
    return wire_format.decode(unseal(payload, secret, context))  # (a copy on the root too)


def quorum_mean(quorum: Quorum, flat: torch.Tensor, counts: bool) -> None:
    """In place on every member: the mean of `flat` over the members whose `counts` is True (the others, such as
    ranks that just joined, send zeros and receive the mean). One all-reduce of `flat` with the count appended,
    over the round's group; counted in `comm_stats` under the group label ``quorum``."""
    assert quorum.is_member
    both = torch.cat(
        [
            flat.detach().reshape(-1) if counts else torch.zeros_like(flat).reshape(-1),
            torch.ones(1, dtype=flat.dtype) if counts else torch.zeros(1, dtype=flat.dtype),
        ]
    )
    n = len(quorum.members)
    comm_stats.record("all_reduce", "quorum", nbytes(both), wire_bytes("all_reduce", nbytes(both), n))
    quorum.group.allreduce([both]).wait()
    weight = both[-1].item()
    if weight < 0.5:
        raise TooFewReplicas(f"round {quorum.round}: no member holds live state (every member just joined)")
    flat.copy_(both[:-1].reshape(flat.shape).div_(weight))


def quorum_exchange(
    quorum: Quorum, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]
) -> None:
    """Sends each ``(tensor, member index)`` and receives into each ``(tensor, member index)`` over the round's
    group (gossip between the members), every receive posted before any send; waits for all of them. A member
    that never takes part makes it raise a RuntimeError within the group's timeout. Counted in `comm_stats` as
    ``send`` (its bytes on the wire) and ``recv`` (none) under the group label ``quorum``."""
    assert quorum.is_member
    tag = quorum.round % (1 << 20)
    works = []
    for tensor, src in recvs:
        comm_stats.record("recv", "quorum", nbytes(tensor), 0.0)
        works.append(quorum.group.recv([tensor], src, tag))
    for tensor, dst in sends:
        comm_stats.record("send", "quorum", nbytes(tensor), float(nbytes(tensor)))
        works.append(quorum.group.send([tensor], dst, tag))
    for work in works:
        work.wait()
