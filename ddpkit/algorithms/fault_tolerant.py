"""Local SGD and SGP whose nodes may come and go: each round is over the ranks that reached its quorum.

Both take the round from a `ddpkit.fault_tolerance.manager.Manager` (quorum, group, live state, commit) and hold no
group of their own; `ddpkit train --fault-tolerant` and your own loop run the same classes.

**Local SGD** (`FaultTolerantLocalSGD`): each round replaces the parameters by their mean over the members that
were already in step (joiners count zero: they take the mean, they do not move it) and commits: if the round
failed on any member (a member died mid-round, a collective timed out), every member restores its parameters as
they were before the round, so replicas never diverge. A rank left out of a round (late, stalled) rejoins at its
next round (its steps since the last round are lost). Nothing waits on a dead rank for longer than
`quorum_timeout`.

Communication per round: the quorum's store round trips, an all-reduce of the P parameters and a count among the
members (plus the live state to joiners). Memory: one copy of the parameters during a round.

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
from ddpkit.algorithms.gossip_graphs import GRAPHS, GraphManager, NPeerDynamicDirectedExponentialGraph
from ddpkit.algorithms.gossip_mixing import UniformMixing
from ddpkit.algorithms.pseudo_gradient import OuterSync
from ddpkit.algorithms.pseudo_gradient_settings import OuterSyncSettings
from ddpkit.algorithms.slow_momentum import SlowBuffers, SlowMoRule
from ddpkit.fault_tolerance.manager import Manager
from ddpkit.fault_tolerance.membership import Quorum, heal_source
from ddpkit.fault_tolerance.round_channel import RoundChannel


class FaultTolerantLocalSGD:
    """Exact averaging of a flat parameter vector among the live ranks of a fault-tolerant job (module doc).
    Register the state a joiner needs beside the parameters (optimizer, data position) with the manager."""

    def __init__(self, manager: Manager) -> None:
        self.manager = manager

    def sync(self, flat: torch.Tensor) -> Quorum:
        """One round on the flat fp32 parameters `flat` (in place): `Manager.start_round` (a rank that joins
        takes the live state there), then `average`. Returns the round's quorum; raises `TooFewReplicas` on every
        rank when fewer than `min_replicas` made it."""
        quorum = self.manager.start_round()
        assert quorum is not None
        self.average(flat, counts=self.manager.rank not in quorum.joined)
        return quorum

    def average(self, flat: torch.Tensor, counts: bool = True) -> bool:
        """The open round's work: `flat` replaced by the mean over the counted members, committed (restored if
        the round failed anywhere). Returns the verdict."""
        before = flat.clone()
        self.manager.average(flat, counts)
        committed = self.manager.should_commit()
        if not committed:
            flat.copy_(before)
        return committed


class RoundLink:
    """A fault-tolerant round as `OuterSync`'s `OuterLink`: each member is a replica; the members that joined in
    this round do not count (they hold nothing of their own to add); the mean goes over the round's group."""

    def __init__(self, quorum: Quorum) -> None:
        assert quorum.index is not None
        self.quorum = quorum
        self.replicas = len(quorum.members)
        self.counted = [m not in quorum.joined for m in quorum.members]
        self.counts = self.counted[quorum.index]

    def start(self, d: torch.Tensor, settings: OuterSyncSettings) -> PendingMean:
        quorum, index = self.quorum, self.quorum.index
        assert index is not None
        way = MeanWay(self.replicas, index, "quorum", lambda: RoundChannel(quorum), self.counted)
        return start_mean_on(d, way, settings.compression, settings.block)  # done when it returns

    def share(self, mean: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
        assert mean is not None  # every member is its own replica: it has the mean already
        return mean


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
    """

    def __init__(
        self,
        manager: Manager,
        flat: torch.Tensor,
        sizes: list[int],
        settings: OuterSyncSettings,
        slow: tuple[SlowBuffers, SlowMoRule] | None,
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
        before = [t.clone() for t in self._held(flat)]
        self.manager.collective(self._sync, flat, step, lr)
        committed = self.manager.should_commit()
        if not committed:
            for now, then in zip(self._held(flat), before, strict=True):
                now.copy_(then)
            self.outer.in_flight.clear()  # (none stays in flight with sync_delay 0; a failed one may have)
        return committed

    def _sync(self, quorum: Quorum, flat: torch.Tensor, step: int, lr: float) -> None:
        self.outer.step(flat, step, lr, RoundLink(quorum))

    def _held(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """What a round changes: the parameters, g, the residual, the slow buffers."""
        held = [flat, self.outer.synced]
        held += [self.outer.residual] if self.outer.residual is not None else []
        if self.outer.slow is not None:
            buffers = self.outer.slow[0]
            held += [t for t in (buffers.x0, buffers.u) if t is not None]
        return held

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
    - **gossip** (most rounds): each member keeps ``1/(d+1)`` of ``[x, w]`` and sends ``1/(d+1)`` to each of its
      d out-peers of graph `graph` rebuilt over the members (`members_graph`) at the current phase, then adds
      what its in-peers sent (in increasing order); the phase advances;
    - **exact** rounds (slow-momentum steps, or every few steps on request): ``x = sum x / sum w`` over the
      members (one all-reduce of ``[x, w]`` and a count), ``w = 1``.

    A member that is lost takes its mass with it: the others' ``x / w`` is then a weighted average of the
    survivors' contributions. Every round is committed (`Quorum.commit`): if it failed on any member, each
    restores its buffer as it was before the round (a joiner of a failed round must join again).

    Communication per gossip round: d messages of P + 1 floats sent and as many received per member; per exact
    round an all-reduce of P + 2 floats. Memory: the buffer (P + 1), a copy during a round, one message per peer.
    """

    def __init__(
        self,
        flat: torch.Tensor,
        graph: str = "npeer-exponential",
        peers_per_itr: int = 1,
        manager: Manager | None = None,
    ) -> None:
        if graph not in GRAPHS:
            raise ValueError(f"FaultTolerantGossip: graph must be one of {sorted(GRAPHS)}, got {graph!r}")
        if peers_per_itr < 1:
            raise ValueError(f"FaultTolerantGossip: peers_per_itr must be >= 1, got {peers_per_itr}")
        self.graph, self.peers_per_itr = graph, peers_per_itr
        self.buffer = torch.cat([flat.detach().reshape(-1).float(), torch.ones(1)])
        self.phase = 0
        self.manager = manager
        if manager is not None:
            manager.register("push_sum", self)

    def sync(self, flat: torch.Tensor, exact: bool | Callable[[int], bool]) -> Quorum:
        """One round of the job as a library call: `absorb` of `flat` (the model after this rank's local steps),
        `Manager.start_round` (a joiner receives the buffer there), `run`; `flat` then holds ``x / w``. `exact`:
        whether the round is an exact average, or a function of the round's number that says so (every member
        must decide alike, a joiner too). A joiner of a round that failed joins again at its next round."""
        assert self.manager is not None, "FaultTolerantGossip.sync needs the manager"
        self.absorb(flat)  # before the live state goes to a joiner (a joiner's own buffer is replaced there)
        quorum = self.manager.start_round()
        assert quorum is not None
        if self.run(exact(quorum.round) if callable(exact) else exact) or self.manager.rank not in quorum.joined:
            flat.copy_(self.model().reshape(flat.shape))
        return quorum

    def model(self) -> torch.Tensor:
        """The de-biased model ``x / w`` (a new tensor)."""
        return self.buffer[:-1] / self.buffer[-1]

    def absorb(self, flat: torch.Tensor) -> None:
        """Adds the local optimizer's change of the model (`flat` against ``x / w``) to the numerators."""
        x = self.buffer[:-1]
        x.add_(flat.reshape(-1).float() - x / self.buffer[-1])

    def run(self, exact: bool) -> bool:
        """The manager's open round on the buffer (class doc), committed; returns the verdict."""
        assert self.manager is not None
        quorum, before = self.manager.current(), self.buffer.clone()
        if self.manager.ok:
            self._share_with_joiners(quorum)
            self._exact() if exact else self._gossip(quorum)
        if not exact:
            self.phase += 1
        committed = self.manager.should_commit()
        if not committed:
            self.buffer.copy_(before)
        return committed

    def _share_with_joiners(self, quorum: Quorum) -> None:
        source, me = heal_source(quorum), quorum.members[quorum.index or 0]
        if source is not None and (me == source or me in quorum.joined):
            self.buffer.div_(len(quorum.joined) + 1)

    def _exact(self) -> None:
        assert self.manager is not None
        self.manager.average(self.buffer)  # (sum x, sum w) / members: their ratio is unchanged
        self.buffer[:-1].div_(self.buffer[-1])
        self.buffer[-1] = 1.0

    def _gossip(self, quorum: Quorum) -> None:
        n = len(quorum.members)
        if n == 1:
            return
        assert quorum.index is not None
        graph = members_graph(self.graph, quorum.index, n, self.peers_per_itr)
        out_peers, in_peers = graph.out_peers(self.phase), graph.in_peers(self.phase)
        kept, shares = UniformMixing(graph).shares(out_peers)
        messages = [self.buffer * share for share in shares]
        received = [torch.empty_like(self.buffer) for _ in in_peers]
        self.buffer.mul_(kept)
        assert self.manager is not None
        self.manager.exchange(list(zip(messages, out_peers, strict=True)), list(zip(received, in_peers, strict=True)))
        if received:
            total = received[0]
            for message in received[1:]:
                total.add_(message)
            self.buffer.add_(total)

    def state_dict(self) -> dict[str, Any]:
        """What a joiner needs: the buffer and the phase."""
        return {"buffer": self.buffer.clone(), "phase": self.phase}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.copy_(state["buffer"])
        self.phase = int(state["phase"])
