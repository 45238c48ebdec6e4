"""Local SGD's exact average between nodes, and slow momentum on top of it (SlowMo's own averaging mode)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddpkit.algorithms.averager import AveragingContext, AveragingOptions, register_averager
from ddpkit.algorithms.gossip_checks import warn_sgp_only
from ddpkit.algorithms.slow_momentum import SlowBuffers, SlowMoRule
from ddpkit.distributed import comm
from ddpkit.distributed.groups import NodeGroups


def average_between_nodes(flat: torch.Tensor, groups: NodeGroups) -> None:
    """In place, on every rank: the exact mean of `flat` over nodes (an all-reduce among node masters, divided
    by the number of nodes, then a broadcast inside each node). Ranks of one node hold the same `flat`."""
    if groups.num_nodes == 1:
        return
    if groups.master is not None:
        comm.all_reduce(flat, groups.master)
        flat.div_(groups.num_nodes)
    if groups.nprocs_per_node > 1:
        comm.broadcast(flat, 0, groups.local)


def average_and_slow_step(flat: torch.Tensor, ctx: AveragingContext, slow_step: bool, lr: float) -> None:
    """The exact average, then on a slow step slow momentum: with sharded slow buffers the two are one reduce
    to each slice's keeper and one broadcast back (`SlowBuffers.sharded_step`); else all-reduce, then the rule
    on every rank."""
    buffers = ctx.slow.buffers
    if slow_step and buffers is not None and buffers.num_shards is not None:
        buffers.sharded_step(flat, lr, ctx.slow.rule, ctx.world, ctx.options.world_size)
        return
    slow = (buffers, ctx.slow.rule) if slow_step and buffers is not None else None
    mean_then_slow_step(flat, lambda t: average_between_nodes(t, ctx.groups), slow, lr)


def mean_then_slow_step(
    flat: torch.Tensor,
    mean: Callable[[torch.Tensor], None],
    slow: tuple[SlowBuffers, SlowMoRule] | None,
    lr: float,
) -> None:
    """Local SGD's sync on the flat fp32 parameters `flat`, in place: `mean(flat)` makes them the exact mean over
    the replicas (a plain job's nodes: `average_between_nodes`; a fault-tolerant round's members:
    `ddpkit.algorithms.fault_tolerant.RoundLink.mean`), then with `slow` (the buffers x0, u whole on this rank, and
    the rule) slow momentum moves the mean at base learning rate `lr`. Sends what `mean` sends."""
    mean(flat)
    if slow is not None:
        buffers, rule = slow
        buffers.local_step(flat, lr, rule)


@register_averager("exact")
class ExactAverager:
    """Local SGD: every `localsgd_frequency` steps the nodes' parameters are replaced by their exact mean, and
    every `slowmo_frequency` steps slow momentum moves that mean (SlowMo, Wang et al. 2020).

    Communication on an averaging step: an all-reduce of the P fp32 parameters among node masters and a
    broadcast inside each node; on a slow step with sharded slow buffers a reduce + broadcast of slices over all
    ranks instead. Memory: nothing beyond the slow buffers SlowMo keeps.
    """

    name = "exact"
    shards_slow_buffers = True

    def __init__(self, ctx: AveragingContext) -> None:
        self.ctx = ctx
        self.frequency = ctx.options.localsgd_frequency

    @classmethod
    def prepare(cls, options: AveragingOptions) -> tuple[dict[str, Any], Any]:
        warn_sgp_only(**options.sgp_args)
        return {}, None

    def due(self, step: int) -> bool:
        return self.ctx.slow.due(step) or step % self.frequency == 0

    def step(self, flat: torch.Tensor, step: int, lr: float) -> None:
        average_and_slow_step(flat, self.ctx, self.ctx.slow.due(step), lr)

    def average_now(self, flat: torch.Tensor) -> None:
        average_between_nodes(flat, self.ctx.groups)

    def state(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any]) -> None:
        return None
