"""SGP's arguments to SlowMoDistributedDataParallel: checked and resolved before any collective."""

from __future__ import annotations

import warnings
from typing import Any

from ddpkit.algorithms.gossip_graphs import GraphManager, NPeerDynamicDirectedExponentialGraph
from ddpkit.algorithms.gossip_mixing import MixingManager, UniformMixing
from ddpkit.algorithms.push_sum import check_push_pull


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
        warnings.warn("SlowMoDistributedDataParallel: synch_freq only takes effect with overlap=True", stacklevel=4)
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


def warn_sgp_only(**settings: Any) -> None:
    """Warns, naming them, about SGP's arguments given to a run that does not gossip."""
    defaults = {"graph": None, "mixing": None, "overlap": False, "synch_freq": 0}
    changed = [name for name, value in settings.items() if name in defaults and value != defaults[name]]
    if changed:
        warnings.warn(
            f"SlowMoDistributedDataParallel: {', '.join(changed)} only affect the SGP base algorithm and have no "
            "effect with LOCALSGD; pass slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP to gossip",
            stacklevel=4,
        )
