"""The slow-momentum step of SlowMo, on a flat vector of parameters, held whole or sharded over ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddpkit.distributed import comm
from ddpkit.distributed.env import ProcessGroup


@dataclass
class SlowMoRule:
    """`beta` (slow momentum), `alpha` (slow learning rate) and whether the outer step is Nesterov's."""

    beta: float
    alpha: float
    nesterov: bool = False

    def apply(self, x0: torch.Tensor, u: torch.Tensor, x: torch.Tensor, lr: float) -> None:
        """In place: ``u = beta u + (x0 - x)/lr``, ``x0 -= alpha lr u`` (Nesterov: alpha lr (d + beta u)), x = x0."""
        d = (x0 - x).div_(lr)
        u.mul_(self.beta).add_(d)
        step = d.add_(u, alpha=self.beta) if self.nesterov else u
        x0.sub_(step, alpha=self.alpha * lr)
        x.copy_(x0)


def shard_bounds(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges splitting `numel` elements into `num_shards` nearly equal parts."""
    base, extra = divmod(numel, num_shards)
    bounds, start = [], 0
    for s in range(num_shards):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class SlowBuffers:
    """x0 (parameters at the last slow step) and u (slow momentum) for the flat parameter vector.

    Whole (`num_shards` None): every rank keeps both for all P elements (2P floats) and applies the rule to
    parameters that were averaged beforehand. Sharded: rank s < num_shards keeps x0 and u for the s-th of
    `num_shards` contiguous slices (2P/num_shards floats); `sharded_step` averages each slice onto its keeper
    with one reduce, applies the rule there and broadcasts the result: the averaging of that step is folded into
    the reduce + broadcast, so no all-reduce is needed.
    """

    def __init__(self, flat_params: torch.Tensor, rank: int, num_shards: int | None) -> None:
        self.numel = flat_params.numel()
        self.num_shards = num_shards
        self.rank = rank
        self.bounds = shard_bounds(self.numel, num_shards) if num_shards else [(0, self.numel)]
        mine = self._my_slice()
        self.x0 = flat_params[mine[0] : mine[1]].detach().clone() if mine else None
        self.u = torch.zeros_like(self.x0) if self.x0 is not None else None

    def _my_slice(self) -> tuple[int, int] | None:
        if self.num_shards is None:
            return self.bounds[0]
        return self.bounds[self.rank] if self.rank < self.num_shards else None

    def local_step(self, flat_params: torch.Tensor, lr: float, rule: SlowMoRule) -> None:
        """The slow step on already averaged parameters, all elements on this rank."""
        assert self.x0 is not None and self.u is not None and self.num_shards is None
        rule.apply(self.x0, self.u, flat_params, lr)

    def sharded_step(
        self, flat_params: torch.Tensor, lr: float, rule: SlowMoRule, world: ProcessGroup | None, world_size: int
    ) -> None:
        """Average each slice onto its keeper (reduce), slow step there, send it back to every rank (broadcast)."""
        assert self.num_shards is not None
        slices = [flat_params[start:end] for start, end in self.bounds]
        comm.wait_all([comm.reduce(s, keeper, world, async_op=True) for keeper, s in enumerate(slices)])
        if self.x0 is not None and self.u is not None:
            mine = slices[self.rank]
            mine.div_(world_size)
            rule.apply(self.x0, self.u, mine, lr)
        comm.wait_all([comm.broadcast(s, keeper, world, async_op=True) for keeper, s in enumerate(slices)])

    def state(self) -> dict[str, torch.Tensor | None]:
        return {"x0": self.x0, "u": self.u}

    def load_whole(self, x0: torch.Tensor, u: torch.Tensor) -> None:
        """Takes this rank's part of whole-vector x0 and u (from a checkpoint)."""
        if x0.numel() != self.numel or u.numel() != self.numel:
            raise ValueError(
                f"load_slowmo_state_dict: the checkpoint's slow buffers have {x0.numel()} elements, this model "
                f"has {self.numel} parameters"
            )
        mine = self._my_slice()
        if mine is not None and self.x0 is not None and self.u is not None:
            self.x0.copy_(x0[mine[0] : mine[1]])
            self.u.copy_(u[mine[0] : mine[1]])
