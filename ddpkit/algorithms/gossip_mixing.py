"""Mixing weights for gossip: the share of its message a node keeps and the share it sends to each out-peer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ddpkit.algorithms.gossip_graphs import GraphManager


class MixingManager(ABC):
    """Chooses, for a node sending to given out-peers, the fractions of its (parameters, weight) each receives.

    The fractions a node keeps and sends must sum to one (column-stochastic mixing), which is what keeps the
    push-sum average exact. Built from the graph it serves and, as fairscale's are, a device for the tensors
    `get_mixing_weights` returns. Holds no tensors of its own; communicates nothing.

    Args:
        graph: the `GraphManager` it serves.
        device: where `get_mixing_weights` puts its tensors (None: the CPU).

    Raises:
        TypeError: `graph` is not a ddpkit GraphManager.
    """

    def __init__(self, graph: GraphManager, device: torch.device | None = None) -> None:
        if not isinstance(graph, GraphManager):
            raise TypeError(f"{type(self).__name__}: graph must be a ddpkit GraphManager, got {type(graph).__name__}")
        self.graph_manager = graph
        self.device = device

    @abstractmethod
    def shares(self, out_peers: list[int]) -> tuple[float, list[float]]:
        """(the fraction kept, the fraction sent to each of `out_peers`), summing to one."""

    @abstractmethod
    def is_uniform(self) -> bool:
        """Whether every out-peer and the node itself get the same fraction."""

    def is_regular(self) -> bool:
        """Whether uniform weights on a regular graph make every round doubly stochastic (weights stay one)."""
        return self.graph_manager.is_regular_graph() and self.is_uniform()

    def get_mixing_weights(self, residual_adjusted: bool = True) -> dict[str | int, torch.Tensor]:
        """Weights at the graph's current phase, keyed ``"lo"`` (kept), ``"uniform"`` and by out-peer.

        With `residual_adjusted` the out-peer weights are divided by the kept one (fairscale's convention for
        messages that were already scaled by it).
        """
        out_peers, _ = self.graph_manager.get_peers()
        kept, sent = self.shares(out_peers)
        scale = kept if residual_adjusted else 1.0
        weights: dict[str | int, torch.Tensor] = {"lo": torch.tensor([kept], device=self.device)}
        if self.is_uniform():
            weights["uniform"] = torch.tensor([sent[0] / scale], device=self.device)
        for peer, share in zip(out_peers, sent, strict=True):
            weights[peer] = torch.tensor([share / scale], device=self.device)
        return weights


class UniformMixing(MixingManager):
    """Each out-peer and the node itself get ``1 / (out-degree + 1)`` of the node's parameters and weight."""

    def shares(self, out_peers: list[int]) -> tuple[float, list[float]]:
        share = 1.0 / (len(out_peers) + 1)
        return share, [share] * len(out_peers)

    def is_uniform(self) -> bool:
        return True
