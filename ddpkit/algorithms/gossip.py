"""SGP (stochastic gradient push) as SlowMo's base algorithm: the state and the per-step work of one rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddpkit.algorithms.averager import AveragingContext, AveragingOptions, register_averager
from ddpkit.algorithms.exact import average_and_slow_step, average_between_nodes
from ddpkit.algorithms.gossip_checks import resolve_sgp_arguments, sgp_settings
from ddpkit.algorithms.gossip_graphs import GraphManager
from ddpkit.algorithms.gossip_mixing import MixingManager
from ddpkit.algorithms.push_sum import GossipRound, PushPull, PushSum
from ddpkit.distributed import comm
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
       `ddpkit.algorithms.push_sum`). With `overlap`, a round is mixed `delay` = max(1, synch_freq) steps after it
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


@register_averager("gossip")
class GossipAverager:
    """SGP as SlowMo's averaging mode: `SGPEngine` gossips among node masters after every step; the nodes are
    averaged exactly (and slow momentum applied) on slow steps, and every `localsgd_frequency` steps with
    `slowmo_sgp_average_params`. Communication and memory: `SGPEngine`'s, plus the exact averages."""

    name = "gossip"
    shards_slow_buffers = True

    def __init__(self, ctx: AveragingContext) -> None:
        graph, mixing = ctx.plan
        args = ctx.options.sgp_args
        self.ctx = ctx
        self.average_params = bool(ctx.options.sgp_flags.get("slowmo_sgp_average_params", False))
        self.engine = SGPEngine(
            ctx.flat, ctx.groups, graph, mixing, args["push_sum"], args["overlap"], args["synch_freq"]
        )

    @classmethod
    def prepare(cls, options: AveragingOptions) -> tuple[dict[str, Any], Any]:
        args = options.sgp_args
        order = ("graph", "mixing", "push_sum", "overlap", "synch_freq")
        graph, mixing = resolve_sgp_arguments(*(args[k] for k in order), options.sgp_flags, options.layout)
        agreed = {**sgp_settings(graph, mixing), "sgp_args": tuple(args[k] for k in order[2:])}
        return {**agreed, "sgp_flags": options.sgp_flags}, (graph, mixing)

    @property
    def weight(self) -> float:
        """This node's push-sum weight."""
        return self.engine.weight

    def due(self, step: int) -> bool:
        return True  # gossip every step

    def step(self, flat: torch.Tensor, step: int, lr: float) -> None:
        slow_step = self.ctx.slow.due(step)
        exact = slow_step or (self.average_params and step % self.ctx.options.localsgd_frequency == 0)
        self.engine.step(flat, exact, lambda x: average_and_slow_step(x, self.ctx, slow_step, lr))

    def average_now(self, flat: torch.Tensor) -> None:
        self.engine.step(flat, True, lambda x: average_between_nodes(x, self.ctx.groups))

    def state(self) -> dict[str, Any]:
        return self.engine.state()

    def load(self, state: dict[str, Any]) -> None:
        self.engine.load(state)
