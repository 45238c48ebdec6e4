"""Local SGD, DiLoCo's outer sync and SGP whose nodes may come and go: each round is over the ranks that reached
its quorum.

The averaging itself is the plain job's (`ddpkit.algorithms`): local SGD's mean and slow step
(`ddpkit.algorithms.exact.mean_then_slow_step`), DiLoCo's `OuterSync`, SGP's `PushSum` rounds. What changes under
fault tolerance is whom they average with: not the job's fixed node groups but each round's members, given per call
as a `RoundLink` (the round's group, and which members count). Every class here takes its rounds from a
`ddpkit.fault_tolerance.manager.Manager` (quorum, group, live state, commit) and holds no group of its own;
`ddpkit train --fault-tolerant` and your own loop run the same classes.

**Commit or roll back** (`run_committed`, one implementation for every mode): a round's work runs on its members;
if it failed on any member (a member died mid-round, a collective timed out), every member puts back what the
round changed (the parameters, the slow buffers, the push-sum buffer, the pseudo-gradient sync's state), so
replicas never diverge. A rank left out of a round (late, stalled) rejoins at its next round (its steps since the
last round are lost). Nothing waits on a dead rank for longer than `quorum_timeout`.

**Local SGD** (`FaultTolerantLocalSGD`): each round replaces the parameters by their mean over the members that
were already in step (joiners count zero: they take the mean, they do not move it), then slow momentum when due.
Per round: the quorum's store round trips, an all-reduce of the P parameters and a count among the members (plus
the live state to joiners). Memory: one copy of the parameters (and slow buffers) during a round.

**DiLoCo's pseudo-gradients** (`FaultTolerantOuterSync`): the plain job's `OuterSync` (compressed with error
feedback, in fragments), each sync over a round's members (its class doc).

**SGP** (push-sum gossip): `FaultTolerantGossip` (its class doc): a lost peer drops out of the graph, which is
rebuilt over each round's members.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from ddpkit.algorithms.compressed_mean import MeanWay, PendingMean, start_mean_on
from ddpkit.algorithms.exact import mean_then_slow_step
from ddpkit.algorithms.gossip_graphs import GRAPHS, GraphManager, NPeerDynamicDirectedExponentialGraph
from ddpkit.algorithms.pseudo_gradient import OuterSync
from ddpkit.algorithms.pseudo_gradient_settings import OuterSyncSettings
from ddpkit.algorithms.push_sum import Messages, PushSum
from ddpkit.algorithms.slow_momentum import SlowBuffers, SlowMoRule
from ddpkit.fault_tolerance.manager import Manager
from ddpkit.fault_tolerance.membership import Quorum, heal_source, quorum_exchange, quorum_mean
from ddpkit.fault_tolerance.round_channel import RoundChannel

Slow = tuple[SlowBuffers, SlowMoRule]
"""Slow momentum's buffers (x0, u: whole on this rank) and its rule."""


def run_committed(manager: Manager, held: list[torch.Tensor], work: Callable[..., Any], *args: Any) -> bool:
    """The open round's `work(quorum, *args)` on every member (`Manager.collective`), then its commit: where the
    round failed on any member, every tensor of `held` (what `work` may change) is put back as it was before.
    Returns the verdict, the same on every member. Holds a copy of `held` during the round."""
    before = [t.clone() for t in held]
    manager.collective(work, *args)
    committed = manager.should_commit()
    if not committed:
        for now, then in zip(held, before, strict=True):
            now.copy_(then)
    return committed


def slow_held(slow: Slow | None) -> list[torch.Tensor]:
    """The slow buffers a round may move (none without slow momentum)."""
    if slow is None:
        return []
    return [t for t in (slow[0].x0, slow[0].u) if t is not None]


class RoundLink:
    """Whom one round of a fault-tolerant job averages with: its members over the round's gloo group (indices in
    the round, not ranks). Serves as `OuterSync`'s `OuterLink` (each member is a replica), as local SGD's mean and
    as SGP's transport. Sends what its calls send over the round's group; holds nothing.

    Args:
        quorum: the open round, on a member (its group and index).
        joiners_count: whether the members that joined in this round count in a mean. They hold nothing of their
            own by default (they take the mean); SGP's push-sum buffer is the exception: a joiner holds a share of
            its healer's.
    """

    def __init__(self, quorum: Quorum, joiners_count: bool = False) -> None:
        assert quorum.index is not None
        self.quorum = quorum
        self.replicas = len(quorum.members)
        self.counted = [joiners_count or m not in quorum.joined for m in quorum.members]
        self.counts = self.counted[quorum.index]

    def mean(self, flat: torch.Tensor) -> None:
        """`flat` replaced in place by its mean over the counted members (`quorum_mean`)."""
        quorum_mean(self.quorum, flat, self.counts)

    def exchange(self, sends: Messages, recvs: Messages) -> _Done:
        """Point-to-point messages between the members, done when it returns (`quorum_exchange`)."""
        quorum_exchange(self.quorum, sends, recvs)
        return _Done()

    def start(self, d: torch.Tensor, settings: OuterSyncSettings) -> PendingMean:
        quorum, index = self.quorum, self.quorum.index
        assert index is not None
        way = MeanWay(self.replicas, index, "quorum", lambda: RoundChannel(quorum), self.counted)
        return start_mean_on(d, way, settings.compression, settings.block)  # done when it returns

    def share(self, mean: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
        assert mean is not None  # every member is its own replica: it has the mean already
        return mean


class _Done:
    """An exchange that completed already."""

    def wait(self) -> None:
        return None


class FaultTolerantLocalSGD:
    """Local SGD (and SlowMo's slow momentum on it) among the live ranks of a fault-tolerant job (module doc):
    `ddpkit.algorithms.exact.mean_then_slow_step` over each round's members, committed. Register the state a
    joiner needs beside the parameters (optimizer, data position, slow buffers) with the manager.

    Args:
        manager: the job's `Manager` (its rounds).
        slow: slow momentum's buffers and rule (None: plain local SGD).
    """

    def __init__(self, manager: Manager, slow: Slow | None = None) -> None:
        self.manager, self.slow = manager, slow

    def sync(self, flat: torch.Tensor) -> Quorum:
        """One round on the flat fp32 parameters `flat` (in place): `Manager.start_round` (a rank that joins
        takes the live state there), then `step`. Returns the round's quorum; raises `TooFewReplicas` on every
        rank when fewer than `min_replicas` made it."""
        quorum = self.manager.start_round()
        assert quorum is not None
        self.step(flat)
        return quorum

    def step(self, flat: torch.Tensor, slow_step: bool = False, lr: float = 0.0) -> bool:
        """The open round's work: `flat` replaced by the mean over the members in step (a joiner takes it), then
        on a `slow_step` slow momentum at base learning rate `lr`; committed (on a failed round `flat` and the
        slow buffers are as they were). Returns the verdict."""
        slow = self.slow if slow_step else None
        return run_committed(self.manager, [flat, *slow_held(slow)], self._round, flat, slow, lr)

    @staticmethod
    def _round(quorum: Quorum, flat: torch.Tensor, slow: Slow | None, lr: float) -> None:
        mean_then_slow_step(flat, RoundLink(quorum).mean, slow, lr)


class FaultTolerantOuterSync:
    """DiLoCo's outer sync (Douillard et al. 2023) by pseudo-gradients, compressed with error feedback and in
    fragments (Streaming DiLoCo): the plain job's `OuterSync`, run over the members of each round of a
    fault-tolerant job (one round per step at which some fragment syncs).

    The round's work, on the flat fp32 parameters x of each member, for the fragments due after the step: the
    pseudo-gradient ``d = g - x + e`` goes to the compressed mean over the round's group (`RoundLink`: quantised
    all-to-all to chunk owners, fp32 mean, quantised all-gather); the members that joined in this round send
    their part but are left out of the mean (its divisor counts the others); each counted member's residual
    becomes ``e = d - dequantize(quantize(d))``; then ``g -= mean``, on a slow step SlowMo's or Nesterov's rule
    moves g from the anchor x0, and ``x = g``. A round of one member averages nothing: it applies its d whole.

    Committed like every round: where it failed on any member, every member puts back its parameters, g, the
    residual and the slow buffers (x0, u) as they were before the round. A joiner receives g here (registered as
    ``outer_sync``) beside the model, the optimizer and the slow buffers (registered by the caller), and its
    residual starts at zero: a residual is what this rank's own quantisation dropped, so a copy of the healer's
    would add the healer's error twice; the error a lost rank held is lost with it. `sync_delay` must be 0: a sync
    in flight over the next steps would cross a change of members (refused by ``ddpkit train``).

    Sends per round what `OuterSync` sends for the fragments due (about 2 (N-1)/N of their quantised size per
    member), plus the quorum's store round trips. Holds `OuterSync`'s state (g, the residual) and, during a round,
    a copy of the parameters, g, the residual and the slow buffers (up to 5P fp32).

    Args:
        manager: the job's `Manager` (its rounds); g is registered with it as live state (``outer_sync``).
        flat: the flat fp32 parameters g starts from.
        sizes: the element counts of the tensors `flat` holds, in order (fragments follow their bounds).
        settings: the sync's compression, fragments and error feedback (`sync_delay` must be 0).
        slow: slow momentum's buffers and rule (None: no slow step).
        frequencies: (`localsgd_frequency`, `slowmo_frequency` or None): when fragments sync and slow steps come.

    Raises:
        ValueError: a `sync_delay` other than 0.
    """

    def __init__(
        self,
        manager: Manager,
        flat: torch.Tensor,
        sizes: list[int],
        settings: OuterSyncSettings,
        slow: Slow | None,
        frequencies: tuple[int, int | None],
    ) -> None:
        if settings.sync_delay:
            raise ValueError("FaultTolerantOuterSync: sync_delay must be 0 (a delayed sync would cross the next round)")
        self.manager = manager
        self.outer = OuterSync(flat, sizes, settings, None, slow, frequencies)
        manager.register_state("outer_sync", self.state_dict, self.load_state_dict)

    def due(self, step: int) -> bool:
        """Whether a fragment syncs after step `step`."""
        return bool(self.outer.starting(step))

    def run(self, flat: torch.Tensor, step: int, lr: float) -> bool:
        """The open round's work (class doc) for the syncs due after step `step` (base learning rate `lr`), in place
        on `flat`, committed; returns the verdict (on False everything is as it was before)."""
        committed = run_committed(self.manager, self._held(flat), self._sync, flat, step, lr)
        if not committed:
            self.outer.in_flight.clear()  # (none stays in flight with sync_delay 0; a failed one may have)
        return committed

    def _sync(self, quorum: Quorum, flat: torch.Tensor, step: int, lr: float) -> None:
        self.outer.step(flat, step, lr, RoundLink(quorum))

    def _held(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """What a round changes: the parameters, g, the residual, the slow buffers."""
        held = [flat, self.outer.synced]
        held += [self.outer.residual] if self.outer.residual is not None else []
        return held + slow_held(self.outer.slow)

    def state_dict(self) -> dict[str, Any]:
        """What a joiner receives: g and the fragments' bounds (the residual stays this rank's)."""
        return {"synced": self.outer.synced.clone(), "bounds": list(self.outer.bounds)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes a member's g; the residual starts at zero (class doc)."""
        if [tuple(b) for b in state["bounds"]] != self.outer.bounds:
            raise ValueError(f"FaultTolerantOuterSync: fragments {state['bounds']} differ from {self.outer.bounds}")
        self.outer.synced.copy_(state["synced"])
        if self.outer.residual is not None:
            self.outer.residual.zero_()
        self.outer.in_flight.clear()


@cache
def members_graph(name: str, index: int, members: int, peers_per_itr: int) -> GraphManager:
    """Member `index`'s view of gossip graph `name` over a round's `members` (renumbered 0..members-1), with at
    most members - 1 peers per round; a graph that cannot serve that many nodes (a bipartite one at an odd
    count) gives way to the one-peer directed exponential graph, which serves any count."""
    try:
        return GRAPHS[name](index, members, peers_per_itr=min(peers_per_itr, members - 1))
    except ValueError:
        return NPeerDynamicDirectedExponentialGraph(index, members, peers_per_itr=1)


class FaultTolerantGossip:
    """SGP's push-sum gossip (Assran et al., 2019) among the members of each round of a fault-tolerant job.

    State: one flat fp32 buffer ``[x, w]`` (numerators, push-sum weight) and the graph's phase; the model is
    ``x / w``. Before each round the optimizer's change is `absorb`-ed into x (``x += model - x / w``, as SGP
    does). A round then, over its members only (indices in the round's members, not global ranks):

    - **joiners**: the member that heals them (the lowest one holding live state) sends them its buffer; it and
      its k joiners then each keep 1/(k+1) of it, so the total mass is unchanged by a join;
    - **gossip** (most rounds): the plain job's `PushSum` round (`ddpkit.algorithms.push_sum`) on graph `graph`
      rebuilt over the members (`members_graph`) at the current phase, its messages sent over the round's group
      (`RoundLink.exchange`): each member keeps ``1/(d+1)`` of ``[x, w]``, sends ``1/(d+1)`` to each of its d
      out-peers and adds what its in-peers sent (in increasing order); the phase advances;
    - **exact** rounds (slow-momentum steps, or every few steps on request): ``x = sum x / sum w`` over the
      members (one all-reduce of ``[x, w]`` and a count), ``w = 1``; on a slow step slow momentum then moves x.

    A member that is lost takes its mass with it: the others' ``x / w`` is then a weighted average of the
    survivors' contributions. Every round is committed (`run_committed`): if it failed on any member, each
    restores its buffer and slow buffers as they were before the round (a joiner of a failed round must join
    again).

    Communication per gossip round: d messages of P + 1 floats sent and as many received per member; per exact
    round an all-reduce of P + 2 floats. Memory: the buffer (P + 1), a copy during a round, one message per peer.

    Args:
        flat: the flat parameters the buffer starts from.
        graph: the gossip graph's name (`ddpkit.algorithms.gossip_graphs.GRAPHS`).
        peers_per_itr: out-peers per gossip round (at most the round's members - 1).
        manager: the job's `Manager` (its rounds; None: only the buffer's arithmetic, `absorb` and `model`).
        slow: slow momentum's buffers and rule (None: no slow step).

    Raises:
        ValueError: an unknown `graph`, or `peers_per_itr` below 1.
    """

    def __init__(
        self,
        flat: torch.Tensor,
        graph: str = "npeer-exponential",
        peers_per_itr: int = 1,
        manager: Manager | None = None,
        slow: Slow | None = None,
    ) -> None:
        if graph not in GRAPHS:
            raise ValueError(f"FaultTolerantGossip: graph must be one of {sorted(GRAPHS)}, got {graph!r}")
        if peers_per_itr < 1:
            raise ValueError(f"FaultTolerantGossip: peers_per_itr must be >= 1, got {peers_per_itr}")
        self.graph, self.peers_per_itr = graph, peers_per_itr
        self.buffer = torch.cat([flat.detach().reshape(-1).float(), torch.ones(1)])
        self.phase = 0
        self.manager, self.slow = manager, slow
        if manager is not None:
            manager.register("push_sum", self)

    def sync(self, flat: torch.Tensor, exact: bool | Callable[[int], bool]) -> Quorum:
        """One round of the job as a library call: `absorb` of `flat` (the model after this rank's local steps),
        `Manager.start_round` (a joiner receives the buffer there), `finish_round`. `exact`: whether the round is
        an exact average, or a function of the round's number that says so (every member must decide alike, a
        joiner too)."""
        assert self.manager is not None, "FaultTolerantGossip.sync needs the manager"
        self.absorb(flat)  # before the live state goes to a joiner (a joiner's own buffer is replaced there)
        quorum = self.manager.start_round()
        assert quorum is not None
        self.finish_round(flat, exact(quorum.round) if callable(exact) else exact)
        return quorum

    def finish_round(self, flat: torch.Tensor, exact: bool, slow_step: bool = False, lr: float = 0.0) -> bool:
        """The open round (`run`), then the model ``x / w`` into `flat`, except on a joiner whose round failed (the
        state it took is not the others': it joins again at its next round and keeps what it had). Returns the
        verdict."""
        assert self.manager is not None
        joined = self.manager.rank in self.manager.current().joined
        committed = self.run(exact, slow_step, lr)
        if committed or not joined:
            flat.copy_(self.model().reshape(flat.shape))
        return committed

    def model(self) -> torch.Tensor:
        """The de-biased model ``x / w`` (a new tensor)."""
        return self.buffer[:-1] / self.buffer[-1]

    def absorb(self, flat: torch.Tensor) -> None:
        """Adds the local optimizer's change of the model (`flat` against ``x / w``) to the numerators."""
        x = self.buffer[:-1]
        x.add_(flat.reshape(-1).float() - x / self.buffer[-1])

    def run(self, exact: bool, slow_step: bool = False, lr: float = 0.0) -> bool:
        """The manager's open round on the buffer (class doc), committed (`run_committed`: a failed round leaves
        the buffer and the slow buffers as they were); on an exact round with `slow_step`, slow momentum then moves
        the average at base learning rate `lr`. Returns the verdict."""
        assert self.manager is not None
        slow = self.slow if exact and slow_step else None
        committed = run_committed(self.manager, [self.buffer, *slow_held(slow)], self._round, exact, slow, lr)
        if not exact:
            self.phase += 1
        return committed

    def _round(self, quorum: Quorum, exact: bool, slow: Slow | None, lr: float) -> None:
        link = RoundLink(quorum, joiners_count=True)  # a joiner holds its share of its healer's mass
        self._share_with_joiners(quorum)
        if exact:
            link.mean(self.buffer)  # (sum x, sum w) / members: their ratio is unchanged
            self.buffer[:-1].div_(self.buffer[-1])
            self.buffer[-1] = 1.0
            if slow is not None:
                slow[0].local_step(self.buffer[:-1], lr, slow[1])
        elif link.replicas > 1:
            graph = members_graph(self.graph, link.quorum.index or 0, link.replicas, self.peers_per_itr)
            PushSum(graph, transport=link.exchange).mix(self.buffer, self.phase)

    def _share_with_joiners(self, quorum: Quorum) -> None:
        source, me = heal_source(quorum), quorum.members[quorum.index or 0]
        if source is not None and (me == source or me in quorum.joined):
            self.buffer.div_(len(quorum.joined) + 1)

    def state_dict(self) -> dict[str, Any]:
        """What a joiner needs: the buffer and the phase."""
        return {"buffer": self.buffer.clone(), "phase": self.phase}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.copy_(state["buffer"])
        self.phase = int(state["phase"])
