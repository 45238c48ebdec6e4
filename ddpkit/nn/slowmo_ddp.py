"""SlowMoDistributedDataParallel: local SGD with slow momentum (Wang et al., ICLR 2020), hierarchical."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.algorithms import AveragingContext, AveragingOptions, NodeAverager, SlowPhase, averager_class
from ddpkit.algorithms.pseudo_gradient_settings import MERGE_ALPHA, OuterSyncSettings
from ddpkit.algorithms.slow_momentum import SlowBuffers, SlowMoRule
from ddpkit.distributed import ledger
from ddpkit.distributed.agreement import check_parameters_agree
from ddpkit.distributed.buckets import broadcast_coalesced, flatten, unflatten_into
from ddpkit.distributed.env import ProcessGroup, require_initialized
from ddpkit.distributed.groups import make_node_groups
from ddpkit.distributed.hooks import counting_allreduce_hook
from ddpkit.distributed.objects import gather_objects
from ddpkit.nn.slowmo_checks import (
    agreed_settings,
    check_positive_int,
    check_settings,
    check_slow_rule,
    check_step_inputs,
    master_params,
)
from ddpkit.nn.wrapper import ModuleWrapper

_DDP_BUFFER_FLAG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


class SlowMoBaseAlgorithm(str, Enum):
    """The base algorithm between slow steps: local SGD (parameter averaging) or SGP (`ddpkit.algorithms.gossip`)."""

    LOCALSGD = "localsgd"
    SGP = "sgp"


class SlowMoDistributedDataParallel(ModuleWrapper):
    """Local SGD with slow momentum for clusters whose nodes are joined by slow links.

    Algorithm (SlowMo, Wang et al., ICLR 2020): ranks ``[k*n, (k+1)*n)`` form node k (n = `nprocs_per_node`);
    inside a node gradients are averaged every backward (torch DDP), between nodes the parameters every
    `localsgd_frequency` calls of `perform_slowmo`. Every `slowmo_frequency` calls, with lr the base optimizer's
    learning rate, beta = `slowmo_momentum`, alpha = `slowmo_lr`, x0 the parameters at the last slow step and x the
    averaged ones: ``u = beta u + (x0 - x)/lr; x0 = x0 - alpha lr u; x = x0``. SlowMo is on iff ``slowmo_lr != 1``
    or ``slowmo_momentum != 0``, else this is local SGD. ``SGP`` gossips between node masters every step instead;
    `slowmo_compression`, `slowmo_fragments` or `slowmo_sync_delay` sync compressed pseudo-gradients (DiLoCo,
    Streaming DiLoCo). Each mode is a `ddpkit.algorithms.NodeAverager` (`averager`); docs/slow-links.md.

    Sends: every backward, DDP's all-reduce inside each node; every `localsgd_frequency` steps, the parameters
    among node masters (an all-reduce, or with `slowmo_memory_efficient` a reduce and a broadcast of slices), then a
    broadcast inside each node. Holds: x0 and u (fp32; sliced over the ranks when memory-efficient).

    Args:
        module: the model to train; the same parameters on every rank.
        nprocs_per_node: processes per node (gradients averaged inside it every step); divides the world size.
        broadcast_buffers: broadcast the module's buffers from rank 0 before each forward with grad enabled.
        slowmo_base_algorithm: ``SlowMoBaseAlgorithm.LOCALSGD`` (exact averages) or ``SGP`` (gossip every step).
        slowmo_momentum: beta, the slow momentum (0 with `slowmo_lr` 1: plain local SGD).
        slowmo_memory_efficient: keep x0 and u in slices over the ranks; False keeps them whole on every rank.
        slowmo_frequency: slow steps every this many `perform_slowmo` calls.
        slowmo_lr: alpha, the slow learning rate.
        slowmo_num_shards: the most slices x0 and u are split into (at most the world size).
        localsgd_frequency: exact averages between nodes every this many calls (SGP: with `slowmo_sgp_average_params`).
        graph: SGP's gossip graph, a `GraphManager` for this rank's node (None: one-peer directed exponential).
        mixing: SGP's mixing weights, a `MixingManager` on `graph` (None: uniform).
        push_sum: SGP with push-sum weights (any graph); False: PushPull, for regular graphs with uniform mixing.
        overlap: SGP: a gossip round travels while the next steps compute.
        synch_freq: SGP with `overlap`: the steps a round may travel before it is mixed in (0 and 1: one).
        use_streams: accepted for fairscale's signature (its CUDA streams for SGP); checked to be a bool, no effect.
        slowmo_sgp_average_params: SGP: also average exactly every `localsgd_frequency` steps.
        verbose: accepted for fairscale's signature; kept as an attribute.
        profile_mode: accepted for fairscale's signature; no effect.
        process_rank: this process's rank (None: torch.distributed's).
        process_world_size: the number of ranks (None: torch.distributed's).
        global_group: the group of every rank (None: made here, over the default group).
        master_group: the group of the node masters, the first rank of each node (None: made here).
        local_node_group: this node's group (None: made here).
        comm_device: the device the flat parameters are averaged on (None: where the parameters are).
        slowmo_nesterov: the slow step is Nesterov's (DiLoCo's outer optimizer).
        slowmo_compression: what a pseudo-gradient sync sends: "none" (fp32), "bf16", "int8" or "int4".
        slowmo_compression_block: values per fp32 scale for "int8" and "int4".
        slowmo_error_feedback: add what quantisation dropped from a rank's previous pseudo-gradient to its next.
        slowmo_fragments: the parameters sync as this many fragments, each at its own offset (Streaming DiLoCo).
        slowmo_sync_delay: steps a fragment's mean travels in the background before it is merged.
        slowmo_merge_alpha: a delayed mean is merged as ``x = a x + (1 - a) g``, a this value.
        averager: how nodes average, by registered name or class (None: chosen from the arguments above).

    Raises:
        ValueError: an argument out of range or contradicting another, an option that cannot act, ranks that differ.
        TypeError: an argument of the wrong type (a graph or mixing that is not ddpkit's, a switch not a bool).

    Example::

        model = SlowMoDistributedDataParallel(model, nprocs_per_node=8, slowmo_momentum=0.5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loss_fn(model(x), y).backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        model.perform_slowmo(optimizer)
    """

    def __init__(
        self,
        module: nn.Module,
        nprocs_per_node: int,
        broadcast_buffers: bool = True,
        slowmo_base_algorithm: SlowMoBaseAlgorithm = SlowMoBaseAlgorithm.LOCALSGD,
        slowmo_momentum: float = 0.5,
        slowmo_memory_efficient: bool = True,
        slowmo_frequency: int = 48,
        slowmo_lr: float = 1.0,
        slowmo_num_shards: int = 32,
        localsgd_frequency: int = 3,
        graph: Any = None,
        mixing: Any = None,
        push_sum: bool = True,
        overlap: bool = False,
        synch_freq: int = 0,
        use_streams: bool = True,
        slowmo_sgp_average_params: bool = False,
        verbose: bool = False,
        profile_mode: bool = False,
        process_rank: int | None = None,
        process_world_size: int | None = None,
        global_group: ProcessGroup | None = None,
        master_group: ProcessGroup | None = None,
        local_node_group: ProcessGroup | None = None,
        comm_device: torch.device | None = None,
        slowmo_nesterov: bool = False,
        slowmo_compression: str = "none",
        slowmo_compression_block: int = 64,
        slowmo_error_feedback: bool = False,
        slowmo_fragments: int = 1,
        slowmo_sync_delay: int = 0,
        slowmo_merge_alpha: float = MERGE_ALPHA,
        averager: str | type | None = None,
    ) -> None:
        super().__init__()
        require_initialized("SlowMoDistributedDataParallel")
        ledger.explain_uncaught_failures()  # a collective failure names each rank's last collective
        self.slowmo_base_algorithm = SlowMoBaseAlgorithm(slowmo_base_algorithm)
        self.process_rank = dist.get_rank() if process_rank is None else process_rank
        self.process_world_size = dist.get_world_size() if process_world_size is None else process_world_size
        check_settings(module, nprocs_per_node, self.process_world_size, localsgd_frequency, slowmo_frequency)
        check_positive_int("slowmo_num_shards", slowmo_num_shards)
        check_slow_rule(slowmo_momentum, slowmo_lr)
        self.module = module
        self.nprocs_per_node = nprocs_per_node
        self.broadcast_buffers = broadcast_buffers
        self.slowmo_momentum = slowmo_momentum
        self.slowmo_lr = slowmo_lr
        self.slowmo_frequency = slowmo_frequency
        self.localsgd_frequency = localsgd_frequency
        self.slowmo_memory_efficient = slowmo_memory_efficient
        self.slowmo_sgp_average_params = slowmo_sgp_average_params
        self.slowmo = slowmo_lr != 1.0 or slowmo_momentum != 0.0
        self.outer_settings = OuterSyncSettings(
            slowmo_compression,
            slowmo_compression_block,
            slowmo_error_feedback,
            slowmo_fragments,
            slowmo_sync_delay,
            slowmo_merge_alpha,
        )
        options = AveragingOptions(
            self.process_rank,
            self.process_world_size,
            nprocs_per_node,
            localsgd_frequency,
            slowmo_frequency if self.slowmo else None,
            sum(p.numel() for p in module.parameters()),
            self.sgp,
            {"graph": graph, "mixing": mixing, "push_sum": push_sum, "overlap": overlap, "synch_freq": synch_freq},
            {"use_streams": use_streams, "slowmo_sgp_average_params": slowmo_sgp_average_params},
            self.outer_settings,
        )
        kind = averager_class(averager, options)
        agreed, plan = kind.prepare(options)
        self.outer_settings.check(localsgd_frequency, options.slowmo_frequency, options.numel, self.sgp)
        self.rule = SlowMoRule(beta=slowmo_momentum, alpha=slowmo_lr, nesterov=slowmo_nesterov)
        self.comm_device = comm_device
        self.verbose = verbose
        self.num_updates = 0
        # one 8-byte all-gather, before any group is made
        agreed = {**agreed_settings(self, slowmo_num_shards), "averager": kind.name, **agreed}
        check_parameters_agree(module, global_group, "SlowMoDistributedDataParallel", agreed)
        self.groups = make_node_groups(
            nprocs_per_node, self.process_rank, self.process_world_size, global_group, local_node_group, master_group
        )
        self._check_one_node()
        broadcast_coalesced([p.detach() for p in module.parameters()] + list(module.buffers()), 0, self.global_group)
        # not a registered submodule: its parameters are the module's, and state_dict keys stay module.*
        object.__setattr__(self, "_node_ddp", self._wrap_for_node(module))
        sharded = slowmo_memory_efficient and kind.shards_slow_buffers
        self.num_shards = min(self.process_world_size, slowmo_num_shards) if sharded else None
        self.averager = self._build_averager(kind, options, plan)
        self._checked_optimizers: set[int] = set()

    def _build_averager(self, kind: type[NodeAverager], options: AveragingOptions, plan: Any) -> NodeAverager:
        """The slow buffers (x0, u; when slow momentum is on) and the averager, from the synchronised parameters."""
        flat = self._flat(list(self.module.parameters())).float()
        self.slow_buffers = SlowBuffers(flat, self.process_rank, self.num_shards) if self.slowmo else None
        slow = SlowPhase(self.rule, self.slow_buffers, options.slowmo_frequency)
        sizes = [p.numel() for p in self.module.parameters()]
        return kind(AveragingContext(flat, sizes, self.groups, slow, options, plan))

    @property
    def global_group(self) -> ProcessGroup:
        """The group of all ranks of the job."""
        return self.groups.world

    @property
    def local_node_group(self) -> ProcessGroup:
        """The group of this rank's node."""
        return self.groups.local

    @property
    def master_group(self) -> ProcessGroup | None:
        """The group of node masters (None on other ranks)."""
        return self.groups.master

    @property
    def logical_rank(self) -> int:
        """This rank's node."""
        return self.groups.node

    @property
    def logical_world_size(self) -> int:
        """The number of nodes."""
        return self.groups.num_nodes

    def _check_one_node(self) -> None:
        if self.logical_world_size == 1:
            warnings.warn(
                "SlowMoDistributedDataParallel: all ranks form one node, so there is nothing to average between "
                "nodes; gradients are all-reduced every step, as with DDP",
                stacklevel=3,
            )

    def _wrap_for_node(self, module: nn.Module) -> DistributedDataParallel | None:
        """torch DDP over the node's group averages the gradients inside a node (none needed for one process)."""
        if self.nprocs_per_node == 1:
            return None
        # buffers come from global rank 0 in forward; torch >= 2.13 renamed DDP's switch for its own broadcast
        no_buffer_sync = {_DDP_BUFFER_FLAG: False}
        ddp = DistributedDataParallel(module, process_group=self.local_node_group, **no_buffer_sync)
        ddp.register_comm_hook(self.local_node_group, counting_allreduce_hook)
        return ddp

    # -- forward ----------------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # As torch DDP: only a forward with grad enabled syncs buffers, so evaluating on some ranks cannot hang.
        if self.broadcast_buffers and self.process_world_size > 1 and torch.is_grad_enabled():
            broadcast_coalesced(list(self.module.buffers()), 0, self.global_group)
        runner = self._node_ddp if self._node_ddp is not None else self.module
        return runner(*inputs, **kwargs)

    # -- after the base optimizer's step ----------------------------------------------------------------------

    # -- fairscale's attributes ---------------------------------------------------------------------------------

    @property
    def process_group(self) -> ProcessGroup | None:
        """The group of all ranks (fairscale's name for `global_group`)."""
        return self.global_group

    @property
    def local_rank(self) -> int:
        """This process's index inside its node."""
        return self.process_rank % self.nprocs_per_node

    @property
    def localsgd(self) -> bool:
        """Whether the base algorithm is local SGD (parameter averaging between nodes)."""
        return self.slowmo_base_algorithm == SlowMoBaseAlgorithm.LOCALSGD

    @property
    def sgp(self) -> bool:
        """Whether the base algorithm is SGP (gossip between node masters)."""
        return self.slowmo_base_algorithm == SlowMoBaseAlgorithm.SGP

    @property
    def slowmo_num_shards(self) -> int:
        """Over how many ranks the slow buffers are split (1: every rank keeps them whole)."""
        return self.num_shards if self.num_shards is not None else 1

    @property
    def is_current_node_a_slowmo_shard(self) -> bool:
        """Whether this rank keeps (a slice of) the slow buffers."""
        return self.num_shards is None or self.process_rank < self.num_shards

    def train(self, mode: bool = True) -> SlowMoDistributedDataParallel:
        super().train(mode)
        if self._node_ddp is not None:
            self._node_ddp.train(mode)  # not a registered submodule: follows by hand
        return self

    @torch.no_grad()
    def perform_slowmo(
        self,
        optimizer: torch.optim.Optimizer,
        fp32_params: torch.Tensor | list[torch.Tensor] | dict[Any, torch.Tensor] | None = None,
    ) -> None:
        """Call after every ``optimizer.step()``: averages between nodes and applies slow momentum when due.

        `fp32_params`: the fp32 master copy when the module trains in fp16/bf16, as fairscale takes it: one flat
        tensor covering the module's parameters in order, a list of tensors, or a dict holding one flat tensor. It
        is averaged and stepped, then copied into the module's parameters.
        """
        params = master_params(fp32_params) if fp32_params is not None else list(self.module.parameters())
        if id(optimizer) not in self._checked_optimizers:
            check_step_inputs(self.module, optimizer, params, fp32_params is not None)
            self._checked_optimizers.add(id(optimizer))
        self.num_updates += 1
        if not self.averager.due(self.num_updates):
            return
        flat = self._flat(params)
        self.averager.step(flat, self.num_updates, float(optimizer.param_groups[0]["lr"]))
        unflatten_into(flat, params)
        if fp32_params is not None:
            unflatten_into(flat, list(self.module.parameters()))

    @torch.no_grad()
    def _init_global_momentum_buffers(self, optimizer: torch.optim.Optimizer) -> None:
        """fairscale's name, which its tests call before training: x0 (the slow buffers' anchor) becomes the current
        parameters and the slow momentum u zero. Construction does this already; it matters only after the
        parameters changed. `optimizer` is taken for fairscale's signature and not read. Not a collective."""
        buffers = self.slow_buffers
        if buffers is None or buffers.x0 is None or buffers.u is None:
            return
        start, end = self._my_bounds()
        buffers.x0.copy_(self._flat(list(self.module.parameters())).float()[start:end])
        buffers.u.zero_()

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Averages the module's parameters exactly over all nodes now (e.g. at the end of training), so every
        replica holds the same model; counters and slow buffers are left as they are. A collective. With SGP, the
        round in flight is mixed in first and the average is the push-sum one (numerators over nodes); with
        `slowmo_sync_delay`, the syncs in flight are merged first. The average is exact (fp32) in every case."""
        params = list(self.module.parameters())
        flat = self._flat(params)
        self.averager.average_now(flat)
        unflatten_into(flat, params)

    def _flat(self, params: list[torch.Tensor]) -> torch.Tensor:
        flat = flatten([p.detach() for p in params])
        return flat.to(self.comm_device) if self.comm_device is not None else flat

    # -- checkpoints ------------------------------------------------------------------------------------------

    def get_extra_state(self) -> dict[str, Any]:
        """What `state_dict()` carries besides the module's tensors (key ``_extra_state``): `num_updates`, this
        rank's slow buffers (x0, u: all of them, or its slice when sharded) and its averager's state (``averager``:
        with SGP the push-sum buffer and a round in flight; with pseudo-gradients the synchronised copy, the
        error-feedback residual, the syncs in flight). Not a collective: a node master waits for the messages in
        flight, which every rank sent when they started."""
        state: dict[str, Any] = {"num_updates": self.num_updates, "slow": None, "averager": self.averager.state()}
        buffers = self.slow_buffers
        if buffers is not None and buffers.x0 is not None and buffers.u is not None:
            bounds = self._my_bounds()
            state["slow"] = {"bounds": bounds, "numel": buffers.numel, "x0": buffers.x0.clone(), "u": buffers.u.clone()}
        return state

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """Restores what `get_extra_state` saved. Slow buffers load from this rank's own slice or from whole ones
        (a run without sharding, or `slowmo_state_dict`); another rank's slice is an error."""
        self.num_updates = int(state["num_updates"])
        saved = state.get("averager", state.get("outer"))  # "outer": as saved before the averagers had one seam
        if saved:
            self.averager.load(saved)
        slow, buffers = state.get("slow"), self.slow_buffers
        if slow is None or buffers is None or buffers.x0 is None or buffers.u is None:
            return
        start, end = self._my_bounds()
        saved_start, saved_end = slow["bounds"]
        if slow["numel"] != buffers.numel or not saved_start <= start <= end <= saved_end:
            raise ValueError(
                f"SlowMoDistributedDataParallel.load_state_dict: the checkpoint holds slow buffers [{saved_start}, "
                f"{saved_end}) of {slow['numel']} elements, this rank keeps [{start}, {end}) of {buffers.numel}; with "
                "sharded slow buffers load each rank's own state_dict(), or save slowmo_state_dict() (all of them)"
            )
        buffers.x0.copy_(slow["x0"][start - saved_start : end - saved_start])
        buffers.u.copy_(slow["u"][start - saved_start : end - saved_start])

    def _my_bounds(self) -> tuple[int, int]:
        buffers = self.slow_buffers
        assert buffers is not None
        return (0, buffers.numel) if self.num_shards is None else buffers.bounds[self.process_rank]

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """torch's, also accepting a state dict without ``_extra_state`` (fairscale's, or saved before it existed):
        the counters and slow buffers then stay as they are."""
        if "_extra_state" in state_dict:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if k != "_extra_state"]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing}, unexpected keys "
                f"{result.unexpected_keys}"
            )
        return type(result)(missing, result.unexpected_keys)

    def slowmo_state_dict(self) -> dict[str, Any]:
        """The counters and the whole slow buffers (x0, u), on every rank, and this rank's `OuterSync` state (see
        `get_extra_state`). A collective when the slow buffers are sharded."""
        state: dict[str, Any] = {"num_updates": self.num_updates, **self.averager.state()}
        if self.slow_buffers is None:
            return state
        if self.num_shards is None:
            state.update({k: v.clone() for k, v in self.slow_buffers.state().items() if v is not None})
            return state
        shards = gather_objects(self.slow_buffers.state(), -1, self.global_group)
        assert shards is not None
        kept = [s for s in shards if s["x0"] is not None]
        state["x0"] = torch.cat([s["x0"] for s in kept])
        state["u"] = torch.cat([s["u"] for s in kept])
        return state

    def load_slowmo_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `slowmo_state_dict` returned, so a resumed run continues exactly; does not change `state`."""
        self.averager.load(state)
        self.num_updates = int(state["num_updates"])
        if self.slow_buffers is not None:
            if "x0" not in state:
                raise ValueError("load_slowmo_state_dict: the checkpoint has no slow buffers (SlowMo was off)")
            self.slow_buffers.load_whole(state["x0"], state["u"])


SlowMoDDP = SlowMoDistributedDataParallel
