"""SGP (stochastic gradient push) as SlowMo's base algorithm: the state and the per-step work of one rank."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ddpkit.distributed import comm
from ddpkit.distributed.gossip import GossipRound, PushPull, PushSum, check_push_pull
from ddpkit.distributed.gossip_graphs import GraphManager, NPeerDynamicDirectedExponentialGraph
from ddpkit.distributed.gossip_mixing import MixingManager, UniformMixing
from ddpkit.distributed.groups import NodeGroups


class SGPEngine:
    """Push-sum gossip between the nodes of a hierarchical job (Assran et al., ICML 2019), one rank's part.

    State: one flat fp32 buffer ``[x, w]`` (parameter numerators, push-sum weight); the model is ``x / w``. Every
    rank of a node holds the same buffer. Each `step` (after the base optimizer's step):

    1. the optimizer's change of the model is applied to the numerator, as in SGP's algorithm:
       ``x += model - x / w`` (with w = 1 this is ``x = model``);
    2. on an exact step (decided by the caller: a slow-momentum step, or an average every `localsgd_frequency`
       steps with `slowmo_sgp_average_params`), the round in flight is mixed in, `combine` replaces x by the exact
       average over nodes (``sum x / nodes``, since the weights sum to the number of nodes) and whatever SlowMo
       does with it, and w becomes 1; no gossip that step;
    3. otherwise the node masters run a gossip round of the graph's next phase (PushSum or PushPull, see
       `ddpkit.distributed.gossip`). With `overlap`, a round is mixed `delay` = max(1, synch_freq) steps after it
       started, while the next steps compute, and the next round starts then; so a node gossips every `delay`
       steps and the staleness is exactly `delay`, on every run;
    4. when its master's buffer changed, every node master broadcasts it inside its node, and every rank sets its
       model to ``x / w``.

    Communication between nodes: only the gossip messages ((out-degree) x (P + 1) floats per round and node
    master) and the exact averages `combine` performs. Inside a node: a broadcast of P + 1 floats after a round.
    Memory: the buffer (P + 1 floats) on every rank; on node masters the gossip's message and receive buffers.
    """

    def __init__(
        self,
        flat_params: torch.Tensor,
        groups: NodeGroups,
        graph: GraphManager | None,
        mixing: MixingManager | None,
        push_sum: bool,
        overlap: bool,
        synch_freq: int,
    ) -> None:
        self.groups = groups
        self.buffer = torch.cat([flat_params.detach().float(), flat_params.new_ones(1, dtype=torch.float32)])
        self.overlap = overlap
        self.delay = max(1, synch_freq)
        self.phase = 0  # the graph phase of the next round
        self.age: int | None = None  # steps since the round in flight started; None when none is
        self._round: GossipRound | None = None
        self.gossiper: PushSum | PushPull | None = None
        if groups.num_nodes > 1 and groups.is_master:
            assert graph is not None
            self.gossiper = (PushSum if push_sum else PushPull)(graph, mixing, groups.master)

    @property
    def weight(self) -> float:
        """This node's push-sum weight w."""
        return float(self.buffer[-1])

    def step(self, flat: torch.Tensor, exact: bool, combine: Callable[[torch.Tensor], None]) -> None:
        """One step on the flat model `flat` (changed by the optimizer since the last step); writes the new model
        into `flat`. `combine(x)` must average x exactly over nodes, in place, on every rank."""
        x, w = self.buffer[:-1], self.buffer[-1:]
        x.add_(flat - x / w)
        if exact:
            self._flush()
            combine(x)
            self.buffer[-1] = 1.0
            flat.copy_(x)
            return
        if self._gossip() and self.groups.nprocs_per_node > 1:
            comm.broadcast(self.buffer, 0, self.groups.local)
        torch.div(x, w, out=flat)

    def _gossip(self) -> bool:
        """Runs this step's gossip; returns whether the node master's buffer changed."""
        if self.groups.num_nodes == 1:
            return False
        if self.age is not None:
            self.age += 1
            if self.age < self.delay:
                return False
            self._finish()
        if self.gossiper is not None:
            self._round = self.gossiper.start(self.buffer, self.phase)
        self.phase += 1
        self.age = 0
        if not self.overlap:
            self._finish()
        return True

    def _finish(self) -> None:
        if self._round is not None:
            self._round.finish(self.buffer)
        self._round, self.age = None, None

    def _flush(self) -> None:
        """Mixes the round in flight now (before an exact average), and shares the result inside the node."""
        if self.age is None:
            return
        self._finish()
        if self.groups.nprocs_per_node > 1:
            comm.broadcast(self.buffer, 0, self.groups.local)

    # -- checkpoints ------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The buffer, the graph's phase and a round in flight (its received sum: waited for, not mixed)."""
        state: dict[str, Any] = {"sgp_buffer": self.buffer.clone(), "sgp_phase": self.phase, "sgp_age": self.age}
        if self._round is not None:
            state["sgp_received"] = self._round.received().clone()
        return state

    def load(self, state: dict[str, Any]) -> None:
        """Restores `state()`'s output (on the same rank of a job of the same shape)."""
        if "sgp_buffer" not in state:
            raise ValueError("load_slowmo_state_dict: the checkpoint has no SGP state (it was saved with LOCALSGD)")
        buffer = state["sgp_buffer"]
        if buffer.numel() != self.buffer.numel():
            raise ValueError(
                f"load_slowmo_state_dict: the checkpoint's SGP buffer has {buffer.numel()} elements, this model "
                f"needs {self.buffer.numel()} (parameters + one weight)"
            )
        age = state["sgp_age"]
        if age is not None and self.gossiper is not None and "sgp_received" not in state:
            raise ValueError(
                "load_slowmo_state_dict: the checkpoint has a gossip round in flight but not its messages; load "
                "each node master's own checkpoint"
            )
        if self._round is not None:  # a live round of this run: complete its transfers before dropping it
            self._round.received()
        self.buffer.copy_(buffer)
        self.phase, self.age, self._round = int(state["sgp_phase"]), age, None
        if age is not None and self.gossiper is not None:
            received = state["sgp_received"].to(self.buffer.device, copy=True)
            self._round = GossipRound.from_received(received, self.gossiper.sends_weight)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"SlowMoDistributedDataParallel: {name} must be a bool, got {value!r}")


def resolve_sgp_arguments(
    graph: Any, mixing: Any, push_sum: Any, overlap: Any, synch_freq: Any, flags: dict[str, Any], layout: tuple
) -> tuple[GraphManager | None, MixingManager | None]:
    """Checks SGP's arguments before any collective and returns the (graph, mixing) to use.

    `layout` is (this node's index, the number of nodes, nprocs_per_node, the rank inside the node); `flags`
    holds the other switches by name (use_streams, slowmo_sgp_average_params). The default graph is
    `NPeerDynamicDirectedExponentialGraph` with one peer per round, the default mixing `UniformMixing`; a job of
    one node needs neither.
    """
    node, num_nodes, nprocs_per_node, local_rank = layout
    for name, value in {"push_sum": push_sum, "overlap": overlap, **flags}.items():
        _check_bool(name, value)
    if isinstance(synch_freq, bool) or not isinstance(synch_freq, int) or synch_freq < 0:
        raise ValueError(f"SlowMoDistributedDataParallel: synch_freq must be an int >= 0, got {synch_freq!r}")
    if graph is not None and not isinstance(graph, GraphManager):
        raise TypeError(f"SlowMoDistributedDataParallel: graph must be a ddpkit GraphManager, got {type(graph)}")
    if mixing is not None and not isinstance(mixing, MixingManager):
        raise TypeError(f"SlowMoDistributedDataParallel: mixing must be a ddpkit MixingManager, got {type(mixing)}")
    if synch_freq and not overlap:
        warnings.warn("SlowMoDistributedDataParallel: synch_freq only takes effect with overlap=True", stacklevel=3)
    if mixing is not None and graph is None:
        graph = mixing.graph_manager
    if mixing is not None and mixing.graph_manager is not graph:
        raise ValueError("SlowMoDistributedDataParallel: mixing was built for another graph object than `graph`")
    if graph is None and num_nodes > 1:
        graph = NPeerDynamicDirectedExponentialGraph(node, num_nodes, nprocs_per_node, local_rank, 1)
    if graph is not None and (graph.world_size, graph.rank) != (num_nodes, node):
        raise ValueError(
            f"SlowMoDistributedDataParallel: the graph was built for node {graph.rank} of {graph.world_size} "
            f"nodes, but this rank is on node {node} of {num_nodes} (world size / nprocs_per_node={nprocs_per_node}); "
            f"build it as {type(graph).__name__}({node}, {num_nodes}, ...)"
        )
    if graph is not None:
        mixing = mixing if mixing is not None else UniformMixing(graph)
        if not push_sum:
            check_push_pull(graph, mixing)
    return graph, mixing


def sgp_settings(graph: GraphManager | None, mixing: MixingManager | None) -> dict[str, Any]:
    """What every rank's graph and mixing must agree on (their type, size and peers per round)."""
    if graph is None:
        return {"sgp_graph": None}
    return {
        "sgp_graph": (type(graph).__name__, graph.world_size, graph.peers_per_itr),
        "sgp_mixing": type(mixing).__name__,
    }
