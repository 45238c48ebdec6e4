"""Gossip rounds among node masters: PushSum (weights travel) and PushPull (doubly stochastic, weights stay one).

Each node master holds one flat fp32 buffer ``[x, w]``: P parameter numerators and one push-sum weight; the
model it trains on is ``x / w``. A round at phase t (the graph's schedule):

1. the node sends ``share * [x, w]`` to each out-peer of phase t (`mixing` gives the shares; PushPull sends
   ``share * x`` only) and keeps ``kept * [x, w]``, with kept + sum(shares) = 1, so no mass is lost;
2. it receives the in-peers' messages and adds their sum (taken in increasing node order) to its buffer.

`start` does step 1 and posts the receives; the returned `GossipRound` completes step 2 in `finish`, which may
come later (overlap SGP): ``x / w`` is already right after step 1, since x and w were scaled alike. The weights
of all nodes, counting what is in flight, always sum to the number of nodes.

PushPull needs every round to be doubly stochastic (a regular graph and uniform mixing): then the received
weight is exactly what the node gave away, its weight is one after every round, and only x travels.

Communication per round: each node master sends (out-degree) messages of ``P + 1`` floats (PushPull: ``P``) and
receives (in-degree) of them, point to point on `group` (the node masters). Memory: one message buffer per
distinct share (one with uniform mixing) and one receive buffer per in-peer, each ``P + 1`` floats, kept for
the next round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ddpkit.algorithms.gossip_graphs import GraphManager
from ddpkit.algorithms.gossip_mixing import MixingManager, UniformMixing
from ddpkit.distributed.comm import next_p2p_tag
from ddpkit.distributed.env import ProcessGroup
from ddpkit.distributed.p2p import Exchange, exchange


class Pending(Protocol):
    """Posted sends and receives; `wait()` completes them (the receive tensors hold the messages after it)."""

    def wait(self) -> None: ...


Messages = list[tuple[torch.Tensor, int]]
Transport = Callable[[Messages, Messages], Pending]
"""Posts one round's ``(tensor, peer)`` sends and receives (peers as indices among the gossiping nodes)."""


class GossipRound:
    """One round's receives: `received()` waits for them (once) and returns their sum; `finish` adds it."""

    def __init__(self, pending: Pending | None, buffers: list[torch.Tensor], size: int, sends_weight: bool) -> None:
        self._pending, self._buffers, self.size, self.sends_weight = pending, buffers, size, sends_weight
        self._sum: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        """Whether the messages were waited for (`received()` or `finish` ran)."""
        return self._sum is not None

    @classmethod
    def from_received(cls, total: torch.Tensor, sends_weight: bool) -> GossipRound:
        """A round whose messages arrived already (restored from a checkpoint)."""
        out = cls(None, [], total.numel(), sends_weight)
        out._sum = total
        return out

    def received(self) -> torch.Tensor:
        """The sum of the in-peers' messages, in increasing node order (waits for them the first time)."""
        if self._sum is None:
            if self._pending is not None:
                self._pending.wait()
            total = self._buffers[0]
            for part in self._buffers[1:]:
                total.add_(part)
            self._sum, self._pending = total, None
        return self._sum

    def finish(self, buffer: torch.Tensor) -> None:
        """Adds the received messages to `buffer` ([x, w]); PushPull's weight is one again afterwards."""
        total = self.received()
        buffer[: total.numel()].add_(total)
        if not self.sends_weight:
            buffer[-1] = 1.0


class Gossiper:
    """Runs gossip rounds of a flat ``[x, w]`` buffer on the node-master group (see the module doc).

    One round may be in flight at a time.

    Args:
        graph: this node's view of the graph (its `rank` is this node's index in `group`).
        mixing: the shares sent and kept (None: `UniformMixing`).
        group: the node masters' process group the messages travel on (`ddpkit.distributed.p2p.exchange`).
        transport: posts a round's sends and receives instead of `group` (a fault-tolerant round's members:
            `ddpkit.algorithms.fault_tolerant.RoundLink.exchange`).

    Raises:
        TypeError: `graph` or `mixing` is not ddpkit's.
    """

    sends_weight = True

    def __init__(
        self,
        graph: GraphManager,
        mixing: MixingManager | None = None,
        group: ProcessGroup | None = None,
        transport: Transport | None = None,
    ) -> None:
        if not isinstance(graph, GraphManager):
            raise TypeError(f"{type(self).__name__}: graph must be a ddpkit GraphManager, got {type(graph).__name__}")
        self.graph = graph
        self.mixing = mixing if mixing is not None else UniformMixing(graph)
        if not isinstance(self.mixing, MixingManager):
            raise TypeError(f"{type(self).__name__}: mixing must be a MixingManager, got {type(mixing).__name__}")
        self.group = group
        self.transport = transport if transport is not None else self._on_group
        self._messages: list[torch.Tensor] = []
        self._receives: list[torch.Tensor] = []
        self._round: GossipRound | None = None

    def start(self, buffer: torch.Tensor, phase: int) -> GossipRound:
        """Sends this node's shares of `buffer` for round `phase`, keeps its own share in place, posts receives."""
        if self._round is not None and not self._round.done:
            raise RuntimeError(f"{type(self).__name__}: a gossip round is still in flight; finish it first")
        out_peers, in_peers = self.graph.out_peers(phase), self.graph.in_peers(phase)
        kept, shares = self.mixing.shares(out_peers)
        size = buffer.numel() if self.sends_weight else buffer.numel() - 1
        distinct = sorted(set(shares))
        messages = self._take(self._messages, len(distinct), size, buffer)
        for message, share in zip(messages, distinct, strict=True):
            torch.mul(buffer[:size], share, out=message)
        buffer.mul_(kept)
        receives = self._take(self._receives, len(in_peers), size, buffer)
        sends = [(messages[distinct.index(share)], peer) for peer, share in zip(out_peers, shares, strict=True)]
        pending = self.transport(sends, list(zip(receives, in_peers, strict=True)))
        if not in_peers:  # nobody sends to this node in this round (possible on irregular graphs)
            receives = [torch.zeros(size, dtype=buffer.dtype, device=buffer.device)]
        self._round = GossipRound(pending, receives, size, self.sends_weight)
        return self._round

    def _on_group(self, sends: Messages, recvs: Messages) -> Exchange:
        return exchange(sends, recvs, self.group, next_p2p_tag(self.group))

    def mix(self, buffer: torch.Tensor, phase: int) -> None:
        """A whole round, waited for: `buffer` holds this node's mixed [x, w] afterwards."""
        self.start(buffer, phase).finish(buffer)

    @staticmethod
    def _take(pool: list[torch.Tensor], count: int, size: int, like: torch.Tensor) -> list[torch.Tensor]:
        """`count` buffers of `size` elements from `pool` (kept between rounds; grown or replaced as needed)."""
        for i in range(count):
            if i == len(pool):
                pool.append(torch.empty(size, dtype=like.dtype, device=like.device))
            elif pool[i].numel() != size or pool[i].device != like.device:
                pool[i] = torch.empty(size, dtype=like.dtype, device=like.device)
        return pool[:count]


class PushSum(Gossiper):
    """Push-sum gossip: messages carry ``[x, w]``; the model ``x / w`` is unbiased on any column-stochastic
    graph (directed, irregular, time-varying)."""


class PushPull(Gossiper):
    """Gossip without weights on doubly stochastic rounds (regular graph, uniform mixing): messages carry x only.

    Args:
        graph: as `Gossiper`'s; a regular graph.
        mixing: as `Gossiper`'s; uniform.
        group: as `Gossiper`'s.
        transport: as `Gossiper`'s.

    Raises:
        ValueError: a graph or mixing whose rounds are not doubly stochastic (use `PushSum`).
        TypeError: as `Gossiper`'s.
    """

    sends_weight = False

    def __init__(
        self,
        graph: GraphManager,
        mixing: MixingManager | None = None,
        group: ProcessGroup | None = None,
        transport: Transport | None = None,
    ) -> None:
        super().__init__(graph, mixing, group, transport)
        check_push_pull(self.graph, self.mixing)


def check_push_pull(graph: GraphManager, mixing: MixingManager) -> None:
    """Raises a ValueError unless every round of `graph` with `mixing` is doubly stochastic (PushPull is exact)."""
    if not mixing.is_uniform():
        raise ValueError(
            f"push_sum=False (PushPull) needs uniform mixing, got {type(mixing).__name__}: with unequal shares the "
            "weights drift from one and must travel; use push_sum=True"
        )
    if graph.needs_push_sum():
        raise ValueError(
            f"push_sum=False (PushPull) needs a regular graph (every node hears from as many nodes as it sends to, "
            f"every round); {type(graph).__name__} at {graph.world_size} nodes is not, so its weights drift from one "
            "and must travel: use push_sum=True"
        )
