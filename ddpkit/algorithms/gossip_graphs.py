"""Communication graphs for gossip (SGP): which node masters a node sends to, and hears from, at each step.

A graph is built on every node master from (this node's index among the node masters, the number of node masters,
peers per iteration), with fairscale's constructor arguments ``(rank, world_size, nprocs_per_node=1,
local_rank=0, peers_per_itr=1)``; `rank` and `world_size` count nodes, not processes. Each node r has a list of
candidate peers (its "phone book", built by the subclass). At gossip round t a dynamic graph sends to the
`peers_per_itr` consecutive entries that start at ``t * peers_per_itr`` (modulo the list's length); a static
graph always sends to the first `peers_per_itr`. Peers are node indices. Everything here is plain Python: no
tensor, no process group.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod


def _floor_log(value: int, base: int) -> int:
    """The largest i >= 0 with ``base**i <= value`` (exact integer arithmetic, `value` >= 1)."""
    i, power = 0, base
    while power <= value:
        i, power = i + 1, power * base
    return i


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"gossip graph: {name} must be an int {bound}, got {value!r}")
    return value


class GraphManager(ABC):
    """A directed, possibly time-varying communication graph over `world_size` nodes.

    Subclasses build each node's peer list in `_make_graph` with `_add_peers`; the base class validates it (every
    round must reach `peers_per_itr` distinct peers) and answers, for any round, a node's out-peers (whom it
    sends to) and in-peers (who sends to it, in increasing node order). `get_peers(rotate)` is the stateful view
    fairscale offers (`rotate=True` advances this object's own phase first). The graph itself sends nothing.
    Memory: one peer list per node, ``O(world_size * peers)`` integers.

    Args:
        rank: this node's index among the nodes (the node masters' ranks in their group).
        world_size: the number of nodes (at least 2).
        nprocs_per_node: processes per node (fairscale's argument; the graph is over nodes).
        local_rank: this process's rank inside its node.
        peers_per_itr: the out-peers of each node per round.

    Raises:
        ValueError: an argument out of its range, or a graph that cannot give every node `peers_per_itr` distinct
            peers per round at this size.
    """

    def __init__(
        self, rank: int, world_size: int, nprocs_per_node: int = 1, local_rank: int = 0, peers_per_itr: int = 1
    ) -> None:
        self.world_size = _check_int("world_size (the number of nodes)", world_size, 2)
        self.rank = _check_int("rank (this node's index)", rank, 0, world_size)
        self.nprocs_per_node = _check_int("nprocs_per_node", nprocs_per_node, 1)
        self.local_rank = _check_int("local_rank", local_rank, 0, nprocs_per_node)
        self._peers_per_itr = _check_int("peers_per_itr", peers_per_itr, 1)
        self.phase = 0
        self.phone_book: list[list[int]] = [[] for _ in range(world_size)]
        self._make_graph()
        self._check_peers(self._peers_per_itr)

    # -- building ---------------------------------------------------------------------------------------------

    @abstractmethod
    def _make_graph(self) -> None:
        """Fills `phone_book[r]` for every node r with `_add_peers`."""

    def _add_peers(self, rank: int, peers: list[int]) -> None:
        """Appends `peers` to node `rank`'s list, skipping the node itself.

        A peer met twice stays twice (r+2 and r-2 at four nodes): the rotation then visits it twice per cycle,
        which keeps each graph's schedule the one fairscale's graph of the same name follows.
        """
        self.phone_book[rank].extend(peer for peer in peers if peer != rank)

    def _forward(self, rank: int, hops: int) -> int:
        return (rank + hops) % self.world_size

    def _backward(self, rank: int, hops: int) -> int:
        return (rank - hops) % self.world_size

    def _check_peers(self, peers_per_itr: int) -> None:
        """Every round must send to `peers_per_itr` distinct peers; raises a ValueError naming the first round that
        would not (the list is too short, or the rotation meets one peer twice)."""
        empty = [rank for rank, book in enumerate(self.phone_book) if not book]
        if empty:
            raise ValueError(f"{type(self).__name__}: node(s) {empty} have no peer at world_size={self.world_size}")
        saved, self._peers_per_itr = self._peers_per_itr, peers_per_itr
        try:
            for phase in range(self.period()):
                for rank in range(self.world_size):
                    peers = self.out_peers(phase, rank)
                    if len(set(peers)) < len(peers):
                        raise ValueError(
                            f"{type(self).__name__}: peers_per_itr={peers_per_itr} cannot be served at "
                            f"world_size={self.world_size} nodes: node {rank}'s peer list {self.phone_book[rank]} "
                            f"gives round {phase} the peers {peers}, not {peers_per_itr} distinct ones"
                        )
        finally:
            self._peers_per_itr = saved

    @property
    def peers_per_itr(self) -> int:
        return self._peers_per_itr

    @peers_per_itr.setter
    def peers_per_itr(self, value: int) -> None:
        self._check_peers(_check_int("peers_per_itr", value, 1))
        self._peers_per_itr = value

    # -- queries ----------------------------------------------------------------------------------------------

    def out_peers(self, phase: int, rank: int | None = None) -> list[int]:
        """The nodes that node `rank` (default: this node) sends to at gossip round `phase`."""
        book = self.phone_book[self.rank if rank is None else rank]
        start = phase * self._peers_per_itr if self.is_dynamic_graph() else 0
        return [book[(start + j) % len(book)] for j in range(self._peers_per_itr)]

    def in_peers(self, phase: int, rank: int | None = None) -> list[int]:
        """The nodes that send to node `rank` (default: this node) at gossip round `phase`, in increasing order."""
        me = self.rank if rank is None else rank
        return [r for r in range(self.world_size) if r != me and me in self.out_peers(phase, r)]

    def get_peers(self, rotate: bool = False) -> tuple[list[int], list[int]]:
        """(out-peers, in-peers) of this node at this object's phase, advanced by one first if `rotate`."""
        if rotate and self.is_dynamic_graph():
            self.phase += 1
        return self.out_peers(self.phase), self.in_peers(self.phase)

    def period(self) -> int:
        """The number of distinct rounds: round t and round t + period() use the same edges."""
        if not self.is_dynamic_graph():
            return 1
        out = 1
        for book in self.phone_book:
            cycle = len(book) // math.gcd(len(book), self._peers_per_itr)
            out = out * cycle // math.gcd(out, cycle)
        return out

    def computed_regular(self) -> bool:
        """Checks every round: each node receives from as many nodes as it sends to, the same count everywhere."""
        for phase in range(self.period()):
            in_degree = [0] * self.world_size
            for r in range(self.world_size):
                for peer in self.out_peers(phase, r):
                    in_degree[peer] += 1
            if any(d != self._peers_per_itr for d in in_degree):
                return False
        return True

    def is_regular_graph(self) -> bool:
        """Whether every node has as many in-peers as out-peers (the same number for all) at every round."""
        return self.computed_regular()

    def needs_push_sum(self) -> bool:
        """Whether uniform mixing on this graph is not doubly stochastic, so weights must travel (push-sum)."""
        return not self.is_regular_graph()

    @abstractmethod
    def is_bipartite_graph(self) -> bool:
        """Whether nodes split into two sets (passive, active) that only send across."""

    def is_passive(self, rank: int | None = None) -> bool:
        """Whether node `rank` is on the passive side of a bipartite graph (never, for the others)."""
        return False

    @abstractmethod
    def is_dynamic_graph(self) -> bool:
        """Whether the edges change from one round to the next."""


class _Circulant(GraphManager):
    """Every node uses the same offsets, so in- and out-degrees are equal everywhere: regular by construction."""

    def is_regular_graph(self) -> bool:
        return True

    def is_bipartite_graph(self) -> bool:
        return False

    def is_dynamic_graph(self) -> bool:
        return True


class DynamicDirectedExponentialGraph(_Circulant):
    """Node r cycles through r+1, r-1, r+2, r-2, r+4, r-4, ... (powers of two up to world_size - 1)."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(_floor_log(self.world_size - 1, 2) + 1):
                self._add_peers(rank, [self._forward(rank, 2**i), self._backward(rank, 2**i)])


class NPeerDynamicDirectedExponentialGraph(_Circulant):
    """With p = peers_per_itr, node r cycles through r + j (p+1)^i for j = 1..p, i = 0, 1, ... (forward only).

    At ``(p+1)**k`` nodes and uniform mixing, k rounds average all nodes exactly. With p = 1 this is SGP's
    directed exponential graph (r+1, r+2, r+4, ...); fairscale's SlowMo uses it as its default graph.
    """

    def _make_graph(self) -> None:
        base = self._peers_per_itr + 1
        for rank in range(self.world_size):
            for i in range(_floor_log(self.world_size - 1, base) + 1):
                self._add_peers(rank, [self._forward(rank, j * base**i) for j in range(1, base)])


class DynamicDirectedLinearGraph(_Circulant):
    """Node r cycles through r+1, r-1, r+3, r-3, ... (every odd distance below world_size)."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(1, self.world_size, 2):
                self._add_peers(rank, [self._forward(rank, i), self._backward(rank, i)])


class RingGraph(_Circulant):
    """Static: node r always sends to r+1 (and also r-1 with peers_per_itr=2)."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            self._add_peers(rank, [self._forward(rank, 1), self._backward(rank, 1)])

    def is_dynamic_graph(self) -> bool:
        return False


class _Bipartite(_Circulant):
    """Even nodes are passive, odd nodes active; every edge joins the two sides (needs an even node count).

    Args:
        rank: as `GraphManager`'s.
        world_size: the number of nodes, even.
        nprocs_per_node: as `GraphManager`'s.
        local_rank: as `GraphManager`'s.
        peers_per_itr: as `GraphManager`'s.

    Raises:
        ValueError: an odd `world_size`, or as `GraphManager`'s.
    """

    def __init__(
        self, rank: int, world_size: int, nprocs_per_node: int = 1, local_rank: int = 0, peers_per_itr: int = 1
    ) -> None:
        if isinstance(world_size, int) and world_size % 2:
            raise ValueError(
                f"{type(self).__name__}: a bipartite graph needs an even number of nodes, got world_size={world_size}"
            )
        super().__init__(rank, world_size, nprocs_per_node, local_rank, peers_per_itr)

    def _add_across(self, rank: int, hops: int) -> None:
        pair = [self._forward(rank, hops), self._backward(rank, hops)]
        if all(self.is_passive(peer) != self.is_passive(rank) for peer in pair):
            self._add_peers(rank, pair)

    def is_bipartite_graph(self) -> bool:
        return True

    def is_passive(self, rank: int | None = None) -> bool:
        return (self.rank if rank is None else rank) % 2 == 0


class DynamicBipartiteExponentialGraph(_Bipartite):
    """Node r cycles through r+1, r-1, r+3, r-3, r+5, r-5, r+9, r-9, ... (distances 1 and 1 + 2^i)."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(_floor_log(self.world_size - 1, 2) + 1):
                self._add_across(rank, 1 if i == 0 else 1 + 2**i)


class DynamicBipartiteLinearGraph(_Bipartite):
    """Node r cycles through r+1, r-1, r+3, r-3, ... (every distance that crosses to the other side)."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(1, self.world_size):
                self._add_across(rank, i)


GRAPHS: dict[str, type[GraphManager]] = {
    "exponential": DynamicDirectedExponentialGraph,
    "npeer-exponential": NPeerDynamicDirectedExponentialGraph,
    "bipartite-exponential": DynamicBipartiteExponentialGraph,
    "linear": DynamicDirectedLinearGraph,
    "bipartite-linear": DynamicBipartiteLinearGraph,
    "ring": RingGraph,
}
"""Short names of the graphs (the ``ddpkit train --graph`` choices)."""
