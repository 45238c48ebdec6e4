"""One quorum for a replica of several processes: the shape of sharding inside a fault-tolerant job (HSDP).

A replica here is a group of processes that live and die together (a machine's processes, sharding the model's
optimizer state among themselves with `OSS` / `ShardedDataParallel` over a local process group of their own).
Fault tolerance runs across replicas: each process holds a `Manager` whose rank is its replica's index, and
process ``k`` of a replica (its *lane*) averages what it owns (shard ``k``'s gradients) with process ``k`` of the
other members, over a round group of its own (`Membership._group_for(quorum, lane)`).

The members of every round must be the same for all the lanes of a replica (a replica that joins must receive
every shard's state at the same round). So one process decides for the replica: lane 0, the *leader*, takes part
in the job's `Membership` (arrival, quorum, commit through the store); `ReplicaMembership` sends each of its
decisions to the other lanes over the replica's control group (a gloo group of the replica's processes, apart
from the one sharding uses, so that a quorum formed in the background never interleaves with the training's
collectives), and each lane makes the round's group for its own lane. A commit is the replica's: the lanes'
verdicts are combined first (one all-reduce of a flag; a lane whose collective failed fails the round for the
whole replica), then the leader's commit decides for the job, and its verdict goes back to the lanes. An error the
leader meets (too few replicas, a lost store) is sent to the lanes and raised there too.

What it sends per round, on the control group: the decision (two broadcasts of a few hundred bytes), the
replica's flag (one all-reduce of 8 bytes) and the verdict (two small broadcasts). What it holds: the last
quorum of its lane. The leader's store traffic is `Membership`'s; the other lanes send nothing to the store but
their round groups' rendezvous.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.fault_tolerance.job_secret import secret_of
from ddpkit.fault_tolerance.membership import Membership, Quorum, broadcast_object_over


@dataclass
class Replica:
    """This process's place in its replica: `lane` (its index among the replica's `lanes` processes; lane 0
    leads) and `control`, a process group of the replica's processes (a ``torch.distributed`` ProcessGroup
    object: collectives are called on it directly, so it need not be registered with a default group), and the
    job's `secret` its messages are tagged with (`ddpkit.fault_tolerance.job_secret`; None: untagged)."""

    lane: int
    lanes: int
    control: Any
    secret: bytes | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.lane < self.lanes:
            raise ValueError(f"Replica: lane must be in [0, lanes={self.lanes}), got {self.lane}")

    @property
    def leads(self) -> bool:
        return self.lane == 0

    def share(self, obj: Any) -> Any:
        """The leader's `obj` on every lane (`broadcast_object_over` the control group: its length, its bytes; the
        machine's own control traffic, not counted with the rounds' bytes)."""
        return broadcast_object_over(
            self.control, self.lane, self.lanes, obj, 0, None, (self.secret, "replica control")
        )

    def all_ok(self, ok: bool) -> bool:
        """Whether every lane's `ok` is True (one all-reduce of a flag over the control group)."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        self.control.allreduce([flag]).wait()
        return int(flag.item()) == 0


def join_replica(
    store: Any, prefix: str, replica: int, lane: int, lanes: int, timeout: float, control_timeout: float
) -> Replica:
    """Makes this process lane `lane` of replica `replica` (a machine's `lanes` processes): the default process
    group becomes the replica's own (what sharding runs over; `timeout` seconds), beside a control group (its
    collectives wait up to `control_timeout` seconds: the leader's longest wait for a quorum). Both meet in the
    job's `store` under a prefix of this start of the replica: the n-th start of each lane counts n, so a machine
    started again makes fresh groups (its processes start and end together)."""
    launch = store.add(f"{prefix}replica{replica}/lane{lane}/starts", 1)
    where = f"{prefix}replica{replica}/start{launch}/"
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(where + "local", store),
        rank=lane,
        world_size=lanes,
        timeout=timedelta(seconds=timeout),
    )
    control = dist.ProcessGroupGloo(
        dist.PrefixStore(where + "control", store), lane, lanes, timedelta(seconds=control_timeout)
    )
    return Replica(lane, lanes, control, secret_of(store))


class ReplicaMembership:
    """`Membership` as each lane of a replica sees it (module doc): the leader's `inner` decides, the lanes
    follow. Everything not overridden here is the inner membership's (on a lane other than the leader, its
    settings: timeouts, the prefix, the last quorum of that lane)."""

    def __init__(self, inner: Membership, replica: Replica) -> None:
        self.inner, self.replica = inner, replica
        self._decided: Quorum | None = None  # the leader's: the quorum its inner membership returned last
        if replica.leads:
            inner.lanes = replica.lanes  # the leader's `forget_through` deletes every lane's group keys

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _lead(self, work: Any, *args: Any) -> Any:
        """`work(*args)` on the leader; its result (or the exception it raised) on every lane."""
        if self.replica.leads:
            try:
                outcome: tuple[str, Any] = ("value", work(*args))
            except Exception as exc:  # the lanes raise it too, then the leader does
                self.replica.share(("error", exc))  # (as its type name and message: wire_format)
                raise
            return self.replica.share(outcome)[1]
        kind, value = self.replica.share(None)
        if kind == "error":
            raise value
        return value

    def announce_join(self) -> int:
        return self._lead(self.inner.announce_join)

    def latest_round(self) -> int:
        return self._lead(self.inner.latest_round)

    def decided_ahead(self, round_: int) -> bool:
        """False: even a round decided ahead reaches the lanes through the leader (a collective of the replica),
        so it is formed where a round is formed in the background."""
        return False

    def quorum(self, round_: int) -> Quorum:
        """The leader's quorum for `round_`, on every lane with the lane's own group (a member's)."""
        decided = self._lead(self._decision, round_)
        if self.replica.leads:
            assert self._decided is not None
            quorum = self._decided
        else:
            quorum = Quorum(**decided)
            if quorum.is_member:
                quorum.group = self.inner._group_for(quorum, self.replica.lane)
                self.inner.last = quorum
        quorum._membership = self  # type: ignore[assignment]  (its commit is the replica's)
        return quorum

    def _decision(self, round_: int) -> dict[str, Any]:
        q = self._decided = self.inner.quorum(round_)
        return {
            "round": q.round,
            "members": q.members,
            "joined": q.joined,
            "left": q.left,
            "previous": q.previous,
            "index": q.index,
            "waited": q.waited,
            "resume_at": q.resume_at,
        }

    def commit(self, quorum: Quorum, ok: bool) -> bool:
        """The replica's verdict: every lane's `ok` combined, the leader's commit, its verdict on every lane."""
        ok = self.replica.all_ok(ok)
        verdict = self._lead(self._commit, quorum, ok)
        quorum.committed, quorum.next_decided, quorum.verdict_unknown = verdict
        if not quorum.committed:
            quorum.group = None  # (as `Membership.commit`: a failed round's group is made anew)
        return bool(quorum.committed)

    def _commit(self, quorum: Quorum, ok: bool) -> tuple[bool | None, bool, bool]:
        self.inner.commit(quorum, ok)
        return quorum.committed, quorum.next_decided, quorum.verdict_unknown

    def forget_through(self, round_: int) -> None:
        if self.replica.leads:
            self.inner.forget_through(round_)
