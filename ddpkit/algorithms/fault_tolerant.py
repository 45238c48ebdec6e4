"""Local SGD and SGP whose nodes may come and go: each round is over the ranks that reached its quorum.

Fault-tolerant training (issue 24) at the library level. **Local SGD**: `FaultTolerantLocalSGD.sync`, called
every `localsgd_frequency` steps, forms the round's quorum (`ddpkit.distributed.membership`), sends the live state
to ranks that joined since the previous round (`heal`), replaces the parameters by their mean over the members
that were already in step (joiners count zero: they take the mean, they do not move it) and commits: if any step
of the round failed on any member (a member died mid-round, a collective timed out), every member restores its
parameters as they were before the round, so replicas never diverge. A rank left out of a round (late, stalled)
skips to the next round to be decided (its steps since the last round are lost) and is healed when it gets in.
Nothing waits on a dead rank for longer than `quorum_timeout`.

Communication per round: the quorum's store round trips, one gloo group, an all-reduce of the P parameters among
the members (plus a broadcast of the state to joiners). Memory: one copy of the parameters during a round.

**SGP** (push-sum gossip): `FaultTolerantGossip` (module doc of its class): a lost peer drops out of the graph,
which is rebuilt over each round's members.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from ddpkit.algorithms.gossip_graphs import GRAPHS, GraphManager, NPeerDynamicDirectedExponentialGraph
from ddpkit.algorithms.gossip_mixing import UniformMixing
from ddpkit.distributed.membership import Membership, Quorum, heal, heal_source, quorum_exchange, quorum_mean


class FaultTolerantLocalSGD:
    """Exact averaging of a flat parameter vector among the live ranks of a fault-tolerant job (module doc).

    `rejoining`: this process replaces a rank that was lost (or starts late); it announces itself and takes part
    from the next round on, receiving `state` tensors (optimizer state, data position, ...) from a live member.
    """

    def __init__(self, membership: Membership, rejoining: bool = False) -> None:
        self.membership = membership
        self.round = membership.announce_join() if rejoining else 0
        self.history: list[Quorum] = []

    def sync(self, flat: torch.Tensor, state: list[torch.Tensor] | None = None) -> Quorum:
        """One round on the flat fp32 parameters `flat` (in place). Returns the round's quorum; raises
        `TooFewReplicas` on every rank when fewer than `min_replicas` made it."""
        quorum = self.membership.quorum(self.round)
        self.round += 1
        self.history.append(quorum)
        if not quorum.is_member:  # left behind (late, stalled): skip to the next round to be decided, and get healed
            self.round = max(self.round, self.membership.announce_join())
            return quorum
        before = flat.clone()
        ok = quorum.group is not None  # None: a member vanished before the round's group was made
        try:
            if not ok:
                raise RuntimeError("the round's group could not be made")
            heal(quorum, list(state or []))
            quorum_mean(quorum, flat, counts=self.membership.rank not in quorum.joined)
        except RuntimeError:  # a member died or stalled during the round
            ok = False
        if not quorum.commit(ok):
            flat.copy_(before)
        return quorum


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
        membership: Membership | None = None,
        rejoining: bool = False,
    ) -> None:
        if graph not in GRAPHS:
            raise ValueError(f"FaultTolerantGossip: graph must be one of {sorted(GRAPHS)}, got {graph!r}")
        if peers_per_itr < 1:
            raise ValueError(f"FaultTolerantGossip: peers_per_itr must be >= 1, got {peers_per_itr}")
        self.graph, self.peers_per_itr = graph, peers_per_itr
        self.buffer = torch.cat([flat.detach().reshape(-1).float(), torch.ones(1)])
        self.phase = 0
        self.membership = membership  # for `sync` (the trainer forms its quorums itself and calls `run`)
        self.round = membership.announce_join() if membership is not None and rejoining else 0
        self.joining = rejoining

    def sync(self, flat: torch.Tensor, exact: bool) -> Quorum:
        """One round of the job as a library call: the quorum, the live state to joiners, `absorb` of `flat` (the
        model after this rank's local steps), `run`; `flat` then holds ``x / w``. A rank left out of a round, or
        a joiner of a round that failed, joins again from the next one (its local steps since are lost)."""
        assert self.membership is not None, "FaultTolerantGossip.sync needs the membership"
        quorum = self.membership.quorum(self.round)
        self.round += 1
        if not quorum.is_member:
            self.round, self.joining = max(self.round, self.membership.announce_join()), True
            return quorum
        if not self.joining:
            self.absorb(flat)
        ok = quorum.group is not None
        live = [self.buffer.clone(), torch.tensor([float(self.phase)])]  # every member's buffer is its own
        try:
            if ok:
                heal(quorum, live)
        except RuntimeError:
            ok = False
        if self.joining:
            self.load({"buffer": live[0], "phase": live[1].item()})
        if not self.run(quorum, ok, exact) and self.joining:
            self.round = max(self.round, self.membership.announce_join())
            return quorum
        self.joining = False
        flat.copy_(self.model().reshape(flat.shape))
        return quorum

    def model(self) -> torch.Tensor:
        """The de-biased model ``x / w`` (a new tensor)."""
        return self.buffer[:-1] / self.buffer[-1]

    def absorb(self, flat: torch.Tensor) -> None:
        """Adds the local optimizer's change of the model (`flat` against ``x / w``) to the numerators."""
        x = self.buffer[:-1]
        x.add_(flat.reshape(-1).float() - x / self.buffer[-1])

    def run(self, quorum: Quorum, ok: bool, exact: bool) -> bool:
        """One round on the buffer (class doc), committed; returns the verdict. `ok`: whether all went well on
        this member so far (the quorum's group, the heal)."""
        before = self.buffer.clone()
        try:
            if ok:
                self._share_with_joiners(quorum)
                self._exact(quorum) if exact else self._gossip(quorum)
        except RuntimeError:  # a member died or stalled during the round
            ok = False
        if not exact:
            self.phase += 1
        committed = quorum.commit(ok)
        if not committed:
            self.buffer.copy_(before)
        return committed

    def _share_with_joiners(self, quorum: Quorum) -> None:
        source, me = heal_source(quorum), quorum.members[quorum.index or 0]
        if source is not None and (me == source or me in quorum.joined):
            self.buffer.div_(len(quorum.joined) + 1)

    def _exact(self, quorum: Quorum) -> None:
        quorum_mean(quorum, self.buffer, counts=True)  # (sum x, sum w) / members: their ratio is unchanged
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
        quorum_exchange(quorum, list(zip(messages, out_peers, strict=True)), list(zip(received, in_peers, strict=True)))
        if received:
            total = received[0]
            for message in received[1:]:
                total.add_(message)
            self.buffer.add_(total)

    def state(self) -> dict[str, Any]:
        """What a joiner needs: the buffer and the phase."""
        return {"buffer": self.buffer.clone(), "phase": self.phase}

    def load(self, state: dict[str, Any]) -> None:
        self.buffer.copy_(state["buffer"])
        self.phase = int(state["phase"])
