"""A fault-tolerant job's rounds as one library object: `Manager`, which any training loop runs its rounds through.

A fault-tolerant job has no process group spanning it: ranks ``0..max_world-1`` die and come back, and meet in
rounds through a store every rank reaches (`ddpkit.fault_tolerance.membership` forms each round's quorum). The manager
is what a training loop holds to take part. Per round it owns:

- **the quorum**: who takes part (`quorum_timeout`, `min_replicas`), formed on the training thread or in the
  background while the step computes (`start_round(background=True)`);
- **the round's group and averaging** over its members (`average`, `average_gradients`, `exchange`,
  `broadcast_object`): a collective that fails (a member died in it) marks the round failed instead of raising;
- **the commit** (`should_commit`): a round that failed on any member is dropped on every member;
- **the live state**: a registry of named state (`register_state`, `register`): the model, the optimizer, an
  averager's buffers, the data position, anything of the user's. The round's joiners receive it from the lowest
  member that holds it (`heal`), before the round's work;
- **agreement**: each rank's `settings` are compared at the job's first round (every member refuses, naming the
  setting and the ranks) and by every rank that joins later, against the job's (the joiner alone is refused,
  before it takes part);
- **what happened**: `events` (each round whose members changed or that failed, with the seconds it held this rank
  up), printed by every member as it happens, and `never_joined` (ranks missing from the first round);
- **staying up**: a heartbeat, so that a quorum stops waiting for ranks that are gone (`liveness`); the keys of
  old rounds deleted; gradients all-reduced in buckets while backward runs (`overlap_gradients`,
  `round_buckets`);
- **the store is the only judge**: every decision (who is a member, the verdict) is one compare-and-set in the
  job's store, never one rank's own conclusion. A rank that loses the store stops with `StoreLost` (it never
  goes on alone); with the embedded store (a TCPStore on machine 0) losing machine 0 ends the job, and with an
  etcd cluster (`ddpkit.fault_tolerance.etcd_store.EtcdStore`) any one machine may be lost.

A replica of several processes (a machine sharding the optimizer state over its processes: `replica`,
`ddpkit.fault_tolerance.replica_membership`): each process holds a manager with the machine's rank; one of them decides
the machine's rounds and the others follow, each averaging what it owns with the same process of the other members
(`average_tensors`).

Counting: `average` counts every member by default. A joiner healed at the start of the round holds the live
state, so a gradient it computes from there is as good as anyone's (DDP counts it); an averager whose joiner holds
nothing of its own to add (local SGD's parameters) passes ``counts=False`` for it: it receives the mean.

Your own loop (a complete version runs as a test: tests/test_manager.py)::

    manager = Manager(store, rank, max_world=3, min_replicas=1, quorum_timeout=5, settings={"lr": lr})
    manager.register("model", model)
    manager.register("optimizer", optimizer)
    manager.register_state("step", lambda: step, set_step)
    while step < total_steps:
        manager.start_round()            # a rank that (re)joins receives the live state here
        loss_fn(model(x), y).backward()
        manager.average_gradients(model.parameters())
        if manager.should_commit():      # False on every member when the round failed anywhere
            optimizer.step()
        optimizer.zero_grad()
        step += 1

What it sends per round: the quorum's store round trips (about ten, no new connection while the members stay the
same); each `average` an all-reduce of the tensor and a count over the round's group; a heal the registered state,
serialised once by the heal source and sent to each joiner alone. What it holds: references to the registered
state, the current quorum, the events; `average_gradients` a flat copy of the gradients during the call.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.rank_guard import say
from ddpkit.fault_tolerance import job_secret, job_store, store_agreement, store_identity
from ddpkit.fault_tolerance.connections import side_connection
from ddpkit.fault_tolerance.etcd_store import EtcdStore, StoreReplaced
from ddpkit.fault_tolerance.failures import is_peer_failure, is_store_loss
from ddpkit.fault_tolerance.job_secret import unsigned
from ddpkit.fault_tolerance.liveness import STALE_AFTER, Heartbeat, Liveness
from ddpkit.fault_tolerance.membership import (
    DEFAULT_PREFIX,
    ENDED,
    KEPT_ROUNDS,
    Membership,
    Quorum,
    broadcast_object_from,
    heal_object,
    quorum_exchange,
    quorum_mean,
)
from ddpkit.fault_tolerance.reachability import Reachability
from ddpkit.fault_tolerance.replica_membership import Replica, ReplicaMembership
from ddpkit.fault_tolerance.round_buckets import RoundBuckets

PROBE_SECONDS = 5.0  # how long a rank whose store connection broke waits for the store to answer a call


class StoreLost(RuntimeError):
    """This rank lost the job's store (its machine is gone, or this rank is cut off from it): it stops, since a
    rank that cannot reach the store can take part in no decision."""


class FellBehind(Exception):
    """This rank was left out of a round (it stalled or fell too far behind): it must take the live state again
    (`Manager.rejoin`)."""


@dataclass
class MembershipEvent:
    """A round whose members changed, or that failed.

    Attributes:
        step: the client's step count when it happened (the round number unless the client sets `Manager.step`).
        round: the round's number.
        members: its members' ranks.
        joined: the members that joined in it.
        left: the ranks of the previous round that are not members.
        committed: its verdict (None: not committed yet).
        waited_seconds: the seconds this rank waited for the quorum (partly in the background when formed so).
        blocked_seconds: the seconds the round held up this rank's training: every manager call of the round on
            the training thread, the wait it did not hide, the heal, the averages and the commit.
    """

    step: int
    round: int
    members: list[int]
    joined: list[int]
    left: list[int]
    committed: bool | None
    waited_seconds: float
    blocked_seconds: float = 0.0


@dataclass
class _Entry:
    save: Callable[[], Any]
    load: Callable[[Any], None]


def _store_address(store: Any) -> str | None:
    """Where the job's store is, for messages: an etcd client's URL, a TCPStore's host:port; None for another
    store (a user's own)."""
    if isinstance(store, EtcdStore):
        return store.url
    return f"{store.host}:{store.port}" if hasattr(store, "host") else None


def _store_lost(manager: Manager, exc: BaseException) -> StoreLost | None:
    """`StoreLost`, naming the store and what to do, when `exc` (raised by a store call of the rounds) says the
    store's connection broke; None otherwise."""
    if not is_store_loss(exc):
        return None
    store = unsigned(manager.store)
    where = _store_address(store)
    if isinstance(exc, StoreReplaced):
        advice = (
            "the job's coordination is gone from it, and this rank stops (it would otherwise take decisions of "
            "another run's); a new run takes a new job name"
        )
    elif isinstance(store, EtcdStore):
        advice = (
            "this rank is cut off from the etcd cluster's majority and stops (it takes part in no "
            "decision it cannot reach); start its command again to rejoin once it reaches the cluster"
        )
    else:
        advice = (
            "machine 0, which hosts it, was lost, or the job ended while this rank was stalled (its outputs are "
            "then written by the others); "
            "the embedded store lives on machine 0, so the job cannot outlive that machine; "
            "keep the job's coordination in an etcd cluster (--store etcd://HOST:PORT,... or "
            "Manager(EtcdStore(...))) to survive the loss of any one machine"
        )
    return StoreLost(
        f"rank {manager.rank}: the fault-tolerant job's store{' at ' + str(where) if where else ''} "
        f"is gone ({exc}); {advice}"
    )


def _stops_if_store_lost(method: Callable[..., Any]) -> Callable[..., Any]:
    """A `Manager` method for when the store's connection breaks in one of its store calls. If a new connection
    to the store can be made (the store lives, only this rank's connection broke: a paused rank whose connection
    the store closed), this rank has lost track of the rounds and takes the live state again: a commit returns
    False, any other call raises `FellBehind` (its callers rejoin). Otherwise it raises `StoreLost` (naming the
    store and what to do) instead of the transport's own error: this rank stops, deciding nothing alone."""

    @functools.wraps(method)
    def wrapped(self: Manager, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            lost = _store_lost(self, exc)
            if lost is None:
                raise
            if not self._reconnect():
                raise lost from exc
            self._say(
                f"its connection to the job's store broke ({exc}) and was made again: it takes the live state again"
            )
            self._lost_track = True
            if method.__name__ == "should_commit":
                return False
            raise FellBehind(
                f"rank {self.rank} lost its connection to the store and takes the live state again"
            ) from exc

    return wrapped


class Manager:
    """The rounds of a fault-tolerant job, for any training loop: quorum, averaging, commit, live state.

    Ranks meet in rounds through a store instead of a job-wide process group (torchft's approach): each round's
    members are decided in the store (one compare-and-set), average over a gloo group of their own, heal a joiner
    from a member's live state, and commit only if the round went well on every member. The module doc has more.

    Sends per round the quorum's store round trips and what the round's work sends (`average`: an all-reduce of the
    tensor and a count); a heal sends the registered state once per joiner. Holds references to the registered
    state, the current quorum and the membership events.

    Args:
        store: a client of the job's store: a ``torch.distributed`` Store (TCPStore; HashStore for thread ranks)
            or an `EtcdStore` (any one machine may be lost); signed with ``DDPKIT_JOB_SECRET`` when that is set.
        rank: this rank's id, in ``[0, max_world)``, the same when it is started again.
        max_world: the job's largest number of ranks.
        min_replicas: the fewest members a round may have; with fewer, every rank stops with `TooFewReplicas`.
        quorum_timeout: seconds a round, its collectives and its commit wait for a rank before leaving it out.
        start_timeout: seconds the job's first round waits for every rank (None: `quorum_timeout`).
        join_timeout: seconds a rank that joins waits for a round to take it in.
        prefix: the store keys' prefix (jobs sharing a store need different ones).
        settings: what every rank must share (name -> value), compared at the first round (every member is
            refused, naming the setting) and at every join (the joiner alone is refused).
        report: where each membership change is written as it happens (default: a line on stderr; None: nowhere).
        replica: this process's place in a replica of several processes (`replica_membership`; None: alone).

    Raises:
        ValueError: `rank`, `min_replicas` or `quorum_timeout` out of range, or the job's secret is malformed.

    Example:
        A rank of three on the job's TCPStore::

            store = torch.distributed.TCPStore(host, port, is_master=False)
            manager = Manager(store, rank, max_world=3, quorum_timeout=5, settings={"lr": lr})
            manager.register("model", model)
            manager.register("optimizer", optimizer)
            manager.start_round()
            model(x).sum().backward()
            manager.average_gradients(model.parameters())
            if manager.should_commit():
                optimizer.step()
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        max_world: int,
        *,
        min_replicas: int = 1,
        quorum_timeout: float = 5.0,
        start_timeout: float | None = None,
        join_timeout: float = 300.0,
        prefix: str = DEFAULT_PREFIX,
        settings: Mapping[str, Any] | Iterable[tuple[str, Any]] = (),
        report: Callable[[str], None] | None = say,
        replica: Replica | None = None,
    ) -> None:
        store = job_secret.protect(store)  # (with the job's secret: its values tagged)
        membership = Membership(
            store,
            rank,
            max_world,
            min_replicas,
            quorum_timeout,
            prefix,
            start_timeout=start_timeout,
            join_timeout=join_timeout,
        )
        membership.liveness = Liveness(prefix, min(quorum_timeout, STALE_AFTER))
        membership.first_round_check = self._agree
        self.membership: Membership | ReplicaMembership = membership
        if replica is not None:
            self.membership = ReplicaMembership(membership, replica)
        self.leads = replica is None or replica.leads  # this process speaks for its rank in the store
        self.store, self.rank, self.max_world, self.prefix = store, rank, max_world, prefix
        self.incarnation = self._hold_incarnation()
        if self.leads:  # (the data plane's reports: who reaches whom)
            membership.reach = Reachability(store, prefix, rank)
        # what the quorum itself depends on agrees too (a rank given another world size waited for ranks that
        # never come, or was left in a connection the others abandoned)
        shape = {"max_world": max_world, "min_replicas": min_replicas}
        self.settings = {**store_agreement.settings_texts(shape), **store_agreement.settings_texts(settings)}
        self.report = report if self.leads else None
        self._registry: dict[str, _Entry] = {}
        self.quorum: Quorum | None = None
        self.ok = True  # whether the current round went well on this rank so far
        self.next_round = 0  # the round this rank takes part in next
        self.step: int | None = None  # the client's step, recorded with each event (None: the round number)
        self.events: list[MembershipEvent] = []
        self.never_joined: list[int] = []  # ranks missing from the job's first round (and not back by its end)
        self.rejoined = 0  # times this process took the live state from a member
        self._blocked = 0.0  # seconds the current round held up the training thread so far
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpkit-quorum")
        self._pending: Future[Quorum] | None = None  # a quorum being formed in the background
        self._joining: Quorum | None = None  # a round decided with this rank as a joiner, for `rejoin` to enter
        self._lost_track = False  # its store connection broke and was made anew: it must take the live state again
        self._cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpkit-forget")  # old rounds' keys
        self._forgetting: Future[None] | None = None  # the deletion running in the background (`_forget`)
        self._heartbeat: Heartbeat | None = None
        self._buckets: RoundBuckets | None = None  # gradients averaged while backward runs (`overlap_gradients`)

    # -- the live state ----------------------------------------------------------------------------------------

    def register_state(self, name: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """Adds `name` to the live state a joiner receives: `state_dict()` gives it on the member that sends it
        (tensors, numbers, strings, bytes and containers of them: `ddpkit.distributed.wire_format`; never
        pickled), `load_state_dict(value)` takes it on the joiner."""
        if name in self._registry:
            raise ValueError(f"Manager.register_state: the name {name!r} is registered already")
        self._registry[name] = _Entry(state_dict, load_state_dict)

    def register(self, name: str, obj: Any) -> None:
        """`register_state` for an object with ``state_dict()`` and ``load_state_dict()`` (a module, an
        optimizer, a scheduler, a wrapper).

        Raises:
            TypeError: `obj` lacks either method, or is a sharded optimizer (OSS), whose state no one process
                holds whole."""
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise TypeError(f"Manager.register: {name!r} has no {method}(); use register_state(name, save, load)")
        if callable(getattr(obj, "consolidate_state_dict", None)):  # an OSS (this layer does not import optim)
            raise TypeError(
                f"Manager.register: {name!r} is a sharded optimizer (OSS): its state is split over a process group "
                "and cannot be sent whole to a joiner. A replica of one process holds a plain torch optimizer; a "
                "replica of several processes registers each process's shard (`optimizer.optim`) with `replica=`"
            )
        self.register_state(name, obj.state_dict, obj.load_state_dict)

    def live_state(self) -> dict[str, Any]:
        """Every registered entry's state, by name."""
        return {name: entry.save() for name, entry in self._registry.items()}

    def load_live_state(self, state: Mapping[str, Any]) -> None:
        """Loads `live_state()`'s output into the registered entries (in registration order)."""
        missing = [name for name in self._registry if name not in state]
        if missing:
            raise ValueError(f"Manager: the live state received lacks {missing} (ranks registered different state)")
        for name, entry in self._registry.items():
            entry.load(state[name])

    def require_same(self, settings: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Adds `settings` (name -> value) to those every rank must share, compared by value as the constructor's
        (the optimizer's hyper-parameters, once the optimizer exists). Only before this process's first round.

        Raises:
            RuntimeError: this process took part in a round already (its settings were compared).
            ValueError: a name is given twice.
            CannotCompare: a value cannot be compared by value (`ddpkit.distributed.agreement.canonical`).
        """
        if self.quorum is not None or self._pending is not None:
            raise RuntimeError(
                "Manager.require_same: call it before the first start_round (settings are compared there)"
            )
        texts = store_agreement.settings_texts(settings)
        again = sorted(set(texts) & set(self.settings))
        if again:
            raise ValueError(f"Manager.require_same: {again} given already")
        self.settings.update(texts)

    # -- the job's first round -----------------------------------------------------------------------------------

    def under_way(self) -> bool:
        """Whether the job has decided a round already (a process starting now joins it: `rejoin`)."""
        return self.membership.latest_round() >= 0

    @_stops_if_store_lost
    def start(self, share_state: bool = True) -> Quorum:
        """The job's first round (round 0): the quorum of the ranks that start within `start_timeout`, the
        settings agreement (`RanksDisagree` on every member, naming the settings and ranks), the ranks that never
        joined (written to `report`), and with `share_state` every member loading the first member's live state
        (one model for all, as DDP's broadcast from rank 0). Not committed: the caller does the round's work and
        `should_commit`."""
        if self.leads:
            store_agreement.offer(self.store, self.prefix, self.rank, self.settings)
        self._beat()
        quorum = self.round(0)  # (the settings were compared as its members were decided: `_agree`)
        self.never_joined = [r for r in range(self.max_world) if r not in quorum.members]
        if self.never_joined:
            self._say(
                f"{_ranks(self.never_joined)} never joined: training with {len(quorum.members)} of {self.max_world}"
            )
        if share_state:
            state = self.broadcast_object(self.live_state() if quorum.index == 0 else None, 0)
            if self.ok and quorum.index != 0:
                self.load_live_state(state)
        return quorum

    # -- a round ---------------------------------------------------------------------------------------------------

    @_stops_if_store_lost
    def start_round(self, *, background: bool = False) -> Quorum | None:
        """Your loop's round: forms the next round's quorum (in the background with `background`: taken by the
        next call that needs it) and, as a rank that joins or was left out, takes the live state first (`rejoin`).
        Returns the quorum (None with `background`)."""
        if self._pending is not None:
            self.take()
        self._blocked = 0.0
        if self.quorum is None:  # this process's first round
            self.membership.raise_if_finished()
            if self.under_way():
                return self.rejoin()
            try:
                self.start()
            except FellBehind:  # left out of the first round: join from live state
                return self.rejoin()
            if not self.should_commit():
                raise RuntimeError("the fault-tolerant job's first round failed (a rank was lost while it started)")
            self._blocked = 0.0
        if background:
            if self.membership.decided_ahead(self.next_round):  # formed here at once: no thread switch per step
                self._pending = Future()
                self._pending.set_result(self.membership.quorum(self.next_round))
            else:
                self._pending = self._pool.submit(self.membership.quorum, self.next_round)
            return None
        try:
            quorum = self.round(self.next_round)
        except FellBehind:
            quorum = self.rejoin()
        return quorum

    @property
    def forming(self) -> bool:
        """Whether the next round's quorum is being formed in the background (`start_round(background=True)`),
        not yet taken."""
        return self._pending is not None

    @_stops_if_store_lost
    def take(self) -> Quorum:
        """The quorum formed in the background (`start_round(background=True)`), entered (`round`)."""
        assert self._pending is not None, "Manager.take: no round is being formed"
        since = time.monotonic()
        future, self._pending = self._pending, None
        formed = future.result()  # re-raises what forming it raised (TooFewReplicas)
        blocked = self._blocked + time.monotonic() - since
        quorum = self.round(formed.round, formed)
        self._blocked += blocked
        return quorum

    @_stops_if_store_lost
    def round(self, round_: int, formed: Quorum | None = None) -> Quorum:
        """Forms round `round_` (or enters `formed`, formed in the background) as a rank that holds live state,
        and sends the live state to its joiners. Raises `FellBehind` if this rank is not a member, or is one of
        its joiners (its state is not the others': `rejoin`)."""
        if self._lost_track:
            raise FellBehind(f"rank {self.rank} lost track of the rounds and takes the live state again")
        since = time.monotonic()
        quorum = formed if formed is not None else self.membership.quorum(round_)
        self.next_round = quorum.next_round
        if not quorum.is_member:
            raise FellBehind(f"rank {self.rank} was left out of round {quorum.round}")
        if self.rank in quorum.joined:  # its last round failed as it joined: it joins this one, where it is expected
            self._joining = quorum
            raise FellBehind(f"rank {self.rank} takes the live state again in round {quorum.round}")
        self._enter(quorum)
        if quorum.joined and self.ok:
            self._guarded(heal_object, quorum, self.live_state)  # (the source alone serialises it)
        self._blocked = time.monotonic() - since
        return quorum

    def _agree(self, members: list[int]) -> None:
        """The first round's settings agreement among its `members` (`store_agreement.agree`), run as soon as they
        are decided: `RanksDisagree` on every member, the differing one included, before any connection."""
        if self.leads:
            store_agreement.agree(self.store, self.prefix, self.rank, members, self.prefix + ENDED)

    def _enter(self, quorum: Quorum) -> None:
        self.quorum, self.ok = quorum, quorum.group is not None  # None: a member vanished before it connected

    @_stops_if_store_lost
    def rejoin(self) -> Quorum:
        """Takes part as a joiner: checks this rank's settings against the job's, announces itself, and enters
        the next round decided with it in it, receiving the live state there (loaded into the registry). Returns
        that round's quorum: do its work and `should_commit` as every member does (a joiner of a round that
        fails joins again at the next `start_round`)."""
        self._lost_track, self._joining = False, None if self._lost_track else self._joining
        if self._buckets is not None:
            self._buckets.reset()  # a backward that raised FellBehind half-way is abandoned
        if self.leads:
            store_agreement.check_joiner(
                self.store, self.prefix, self.rank, self.settings, self.membership.join_timeout
            )
        self._beat()
        decided, self._joining = self._joining, None  # a round decided with this rank as a joiner already
        round_ = self.membership.announce_join() if decided is None else decided.round
        while True:
            since = time.monotonic()
            quorum = decided or self.membership.quorum(round_)
            decided = None
            round_ = self.next_round = quorum.next_round
            if not quorum.is_member:
                continue  # too late for it: the next round expects this rank
            self._enter(quorum)
            state = self._guarded(heal_object, quorum, None)
            if not self.ok:
                quorum.commit(False)
                round_ = self.membership.announce_join()
                continue
            self.load_live_state(state)
            self.rejoined += 1
            self._blocked = time.monotonic() - since
            return quorum

    # -- the round's work ------------------------------------------------------------------------------------------

    def _guarded(self, work: Callable[..., Any], *args: Any) -> Any:
        """Runs a collective of the round unless the round failed already; a peer's failure in it (a member died
        or stalled: `is_peer_failure`) marks the round failed. Any other error (`TooFewReplicas`, a bug, a shape
        that differs) is raised: retrying the round could never make it pass. Counted in the round's blocked
        seconds."""
        if not self.ok:
            return None
        since = time.monotonic()
        try:
            return work(*args)
        except RuntimeError as exc:
            if not is_peer_failure(exc):
                raise
            self.ok = False
            return None
        finally:
            self._blocked += time.monotonic() - since

    def current(self) -> Quorum:
        """The open round's quorum (taking the one formed in the background, if any)."""
        if self._pending is not None:
            self.take()
        if self.quorum is None:
            raise RuntimeError("Manager: no round is open (call start_round first)")
        return self.quorum

    def collective(self, work: Callable[..., Any], *args: Any) -> Any:
        """Runs ``work(quorum, *args)``, a collective of the open round's members over its group (`quorum.group`;
        `ddpkit.fault_tolerance.round_channel.RoundChannel(quorum)` for a job such as the compressed mean), unless the
        round failed already; a RuntimeError (a member died or stalled in it) marks the round failed instead of
        raising. Returns what `work` returned (None where the round failed)."""
        return self._guarded(work, self.current(), *args)

    def average(self, tensor: torch.Tensor, counts: bool = True) -> None:
        """In place on every member: the mean of `tensor` over the members whose `counts` is True (the others
        receive it). One all-reduce of the tensor and a count over the round's group."""
        self._guarded(quorum_mean, self.current(), tensor, counts)

    def overlap_gradients(self, params: Iterable[torch.nn.Parameter], bucket_mb: float = 25.0) -> None:
        """Makes `average_gradients(params)` start while backward runs: buckets of about `bucket_mb` MB of
        gradients are all-reduced over the round's members as soon as backward has produced them (as DDP
        does; `ddpkit.fault_tolerance.round_buckets`). Every backward then needs an open round: with gradient
        accumulation, call `average_gradients` without it (the hooks would send every micro-batch)."""
        if self._buckets is not None:
            self._buckets.remove()
        self._buckets = RoundBuckets(
            params, int(bucket_mb * 2**20), self._round_group, lambda: len(self.current().members), self.fail
        )

    def _round_group(self) -> Any:
        quorum = self.current()
        return quorum.group if self.ok else None

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Every gradient of `params` replaced by its mean over the round's members (a parameter without a
        gradient sends zeros): the buckets sent while backward ran (`overlap_gradients`) are waited for, or one
        flat all-reduce after backward. On a failed round the gradients are left alone: `should_commit` is False
        everywhere, so do not step."""
        params = [p for p in params if p.requires_grad]
        if self._buckets is not None and params == self._buckets.params:
            since = time.monotonic()
            self._buckets.finish()
            self._blocked += time.monotonic() - since
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.average_tensors([p.grad for p in params])

    def average_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Each of `tensors` replaced in place by its mean over the round's members (one flat all-reduce): the
        gradients a shard owns, for example (`OSS.owned_grads`). Left alone on a failed round."""
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors] or [torch.zeros(0)])
        self.average(flat)
        if not self.ok:
            return
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Point-to-point messages between the round's members (`quorum_exchange`: indices in the round)."""
        self._guarded(quorum_exchange, self.current(), sends, recvs)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """`obj` as member index `root` holds it, on every member (None where the round failed)."""
        return self._guarded(broadcast_object_from, self.current(), obj, root)

    def fail(self) -> None:
        """Marks the current round failed on this rank (the commit then drops it on every member)."""
        self.ok = False

    @_stops_if_store_lost
    def should_commit(self) -> bool:
        """The round's verdict, the same on every member: True only if it went well on every member. A joiner of a
        round that failed joins again (its state is not the others')."""
        quorum = self.current()
        since = time.monotonic()
        committed = self._verdict(quorum)
        if quorum.verdict_unknown:  # stopped while the others went on: it takes the live state again
            self._say(
                f"round {quorum.round} was over and forgotten before this rank learned its verdict (it was "
                "stopped meanwhile): it takes the live state again"
            )
            self._lost_track = True
        if quorum.index == 0 and quorum.round >= KEPT_ROUNDS:  # the store keeps a bounded number of rounds
            self._forget(quorum.round - KEPT_ROUNDS)
        self._blocked += time.monotonic() - since
        self._note(quorum)
        if not committed and self.rank in quorum.joined:
            self.membership.announce_join()
            self.next_round = max(self.next_round, self.membership.latest_round() + 1)
        return committed

    def _verdict(self, quorum: Quorum) -> bool:
        """`quorum`'s verdict with this rank's report. When the store's connection breaks in it and a new one can
        be made (the store lives), the verdict is read anew there (`Membership.read_verdict`), so this rank ends
        the round as every other member does."""
        try:
            return quorum.commit(self.ok)
        except Exception as exc:
            reader = getattr(self.membership, "read_verdict", None)  # (a replica's processes follow their leader)
            if _store_lost(self, exc) is None or reader is None or not self._reconnect():
                raise
            self._say(
                f"its connection to the job's store broke in round {quorum.round}'s commit ({exc}) and was made again"
            )
            return reader(quorum)

    def _hold_incarnation(self) -> str:
        """The incarnation of the job's store (`store_identity.claim`), which this rank holds from now on; on etcd
        every transaction of this rank's then compares it (`EtcdStore.require`). `StoreLost` if the store is gone."""
        try:
            incarnation = store_identity.claim(self.store)
            bare = unsigned(self.store)
            if isinstance(bare, EtcdStore):
                bare.require(store_identity.INCARNATION_KEY, bare.get(store_identity.INCARNATION_KEY))
        except Exception as exc:
            lost = _store_lost(self, exc)
            if lost is None:
                raise
            raise lost from exc
        return incarnation

    def _reconnect(self) -> bool:
        """A new connection to the job's store in place of one that broke (`store.clone()`); False when none can be
        made (the store is gone, or cut off)."""
        if not hasattr(self.store, "clone") or isinstance(unsigned(self.store), EtcdStore):
            return False  # (an etcd client tried every member for its whole timeout already)
        try:  # a TCPStore's clone retries a refused connection for the store's whole timeout: first the store must
            # answer a call on a side connection (a machine that is going down may still accept a connection)
            side_connection(self.store, timeout=PROBE_SECONDS).check([self.prefix + "latest"])
            fresh = self.store.clone()
            found = store_identity.read(fresh)
        except Exception:
            return False
        if found != self.incarnation:  # the same address, another store: the job's store is gone
            where = _store_address(unsigned(self.store))
            raise StoreLost(
                f"rank {self.rank}: the job's store{' at ' + where if where else ''} came back as another "
                f"store (incarnation {found or 'none'}, this job's is {self.incarnation}): it was restarted, and "
                "the job's rounds are gone from it. This rank stops rather than start a job of its own beside the "
                "others; keep the job's coordination in an etcd cluster to survive the loss of its host"
            )
        self.store = fresh
        rounds = getattr(self.membership, "inner", self.membership)  # (a replica's leader: its own membership)
        rounds.store, rounds._forgetting = fresh, None
        self._beat()
        return True

    def _forget(self, round_: int) -> None:
        """Deletes the old rounds' keys through `round_` in the background, one deletion at a time (a call while
        the previous one runs is skipped: the next covers its rounds), and reports a deletion that failed."""
        previous = self._forgetting
        if previous is not None:
            if not previous.done():
                return
            error = previous.exception()
            if error is not None:
                self._say(
                    f"could not delete old rounds' keys from the store ({type(error).__name__}: {error}); "
                    "the store keeps them"
                )
        self._forgetting = self._cleaner.submit(self.membership.forget_through, round_)

    # -- a lost store ----------------------------------------------------------------------------------------------

    # -- what happened ---------------------------------------------------------------------------------------------

    def _note(self, quorum: Quorum) -> None:
        if not (quorum.changed or quorum.committed is False):
            return
        step = quorum.round if self.step is None else self.step
        event = MembershipEvent(
            step,
            quorum.round,
            quorum.members,
            quorum.joined,
            quorum.left,
            quorum.committed,
            round(quorum.waited, 3),
            round(self._blocked, 3),
        )
        self.events.append(event)
        self.never_joined = [r for r in self.never_joined if r not in quorum.members]
        parts = [f"{_ranks(quorum.left)} left"] if quorum.left else []
        parts += [f"{_ranks(quorum.joined)} joined"] if quorum.joined else []
        parts += [] if quorum.committed else ["the round failed and was dropped everywhere"]
        parts.append(f"training with {len(quorum.members)} of {self.max_world} ({self._blocked:.1f} s held up)")
        self._say(f"round {quorum.round} (step {step}): " + "; ".join(parts))

    def _say(self, line: str) -> None:
        if self.report is not None:
            self.report(f"ddpkit: rank {self.rank}: {line}")

    def _beat(self) -> None:
        """(Re)starts this rank's heartbeat on the current store (`ddpkit.fault_tolerance.liveness`); a replica's
        leader beats for it."""
        if not self.leads:
            return
        if self._heartbeat is not None:
            self._heartbeat.stop()
        try:
            connection = side_connection(self.store)
        except (RuntimeError, dist.DistError, OSError) as exc:  # the store is gone: the round that needs it says so
            self._heartbeat_failed(exc)
            return
        self._heartbeat = Heartbeat(connection, self.prefix, self.rank, on_error=self._heartbeat_failed)

    def _heartbeat_failed(self, error: BaseException) -> None:
        self._say(
            f"its heartbeat failed ({type(error).__name__}: {error}): it keeps trying; while it fails the "
            "others may count this rank gone and go on without it, and it rejoins when its next round finds "
            "the store"
        )

    def leave(self) -> None:
        """This rank takes part in no further round (its loop ends before the others', or it is told to stop): the
        others' next quorum does not wait for it. Called while a round is open (before its `should_commit`), it
        costs the others nothing: commit that round as usual, then `close`. Called after the commit, when that
        commit already decided the next round with this rank in it, it closes this rank's connections, so the
        others' next round fails at once instead of at its timeout, and the one after goes on without it. A rank
        that left may join again later (`rejoin`)."""
        open_round = self.quorum is not None and self.quorum.committed is None
        if self.leads:
            self.membership.announce_leave(self.quorum.round + 1 if self.quorum is not None else self.next_round)
        if open_round:
            return
        self.close()
        if self.quorum is not None:
            self.quorum.group = None  # (its connections close: a round decided with this rank fails at once)
        self.membership.last = None
        self.quorum = None

    def finish(self) -> None:
        """Says that the job is over for this rank, after its last committed round: when every member of that
        round has said so, the job's store (`ddpkit store`) knows the job finished and stops, and a rank started
        later is told so (`JobFinished`) instead of joining. Then `close`. Call it on every rank that ends with the
        job; a rank whose loop ends before the others' calls `leave` instead.

        Raises:
            RuntimeError: this rank has no committed round to finish after."""
        quorum = self.quorum
        if quorum is None or not quorum.committed:
            raise RuntimeError("Manager.finish: call it after the job's last committed round (should_commit)")
        if self.leads:
            job_store.finish(self.store, self.rank, quorum.members, {}, prefix=self.prefix)
            job_store.done(self.store, self.rank, prefix=self.prefix)
        self.close()

    def close(self) -> None:
        """Stops the background quorum thread (a round being formed is abandoned) and the heartbeat."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._cleaner.shutdown(wait=False, cancel_futures=True)
        reach = getattr(self.membership, "inner", self.membership).reach
        if reach is not None:
            reach.close()
        if self._heartbeat is not None:
            self._heartbeat.stop(wait=True)
        if self._buckets is not None:
            self._buckets.remove()


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
