"""OSS: optimizer state sharding (ZeRO stage 1)."""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ddpkit.distributed import comm, launch, ledger, shared_memory
from ddpkit.distributed.agreement import check_parameters_agree
from ddpkit.distributed.env import ProcessGroup, comm_device, group_rank, group_size, require_initialized
from ddpkit.distributed.objects import broadcast_object, gather_objects
from ddpkit.optim.param_messages import ParamBroadcaster, Plan
from ddpkit.optim.param_pieces import MIN_SPLIT_NUMEL, SPLITTABLE, ParamPiece, can_split, cut_state, join_states
from ddpkit.optim.partition import assign_owners, choose_splits, even_spans
from ddpkit.optim.state_dict import (
    check_compatible,
    clone_state,
    group_hyperparameters,
    indexed_param_groups,
    shard_of,
)

_PLACEMENT_KEYS = ("fused", "foreach")
_BALANCE_TOLERANCE = 0.1  # split_params=None cuts large parameters until the largest shard is within 10% of 1/N


class OSS(Optimizer):
    """Shards the state of any torch optimizer over the ranks of a process group (ZeRO stage 1, Rajbhandari et al.).

    Each trainable parameter gets one owner, placed greedily by size the same way on every rank (a large one may be
    cut into a piece per rank, `split_params`); each rank builds `optim` on what it owns. `step()` copies
    `param_groups`' hyper-parameters (where schedulers write) into that local optimizer, updates the shard, and
    every owner broadcasts its updated parameters. Gradients are left alone: pair it with DDP or
    `ShardedDataParallel`. Placement, pieces, shared memory and hosts: docs/oss.md.

    Sends: at construction, one all-gather of two 8-byte digests of the ranks' parameters and settings (ranks that
    differ are named); per step, every trainable parameter once from its owner (fp16 with `broadcast_fp16`; on one
    host through shared memory, nothing on the wire; across hosts once per other host with `hierarchical`).
    Holds: optimizer state for about 1/N of the parameters; with `shared_parameters`, P/N of the parameters.

    Args:
        params: the parameters or param groups (dicts with ``params``), as for a torch optimizer; alike on all ranks.
        optim: the torch optimizer class each rank builds on the parameters it owns (e.g. ``torch.optim.Adam``).
        group: the process group to shard over (default: the whole job).
        broadcast_buffer_size: accepted for fairscale's signature; unused (messages are the owners' flat buffers).
        broadcast_fp16: send the updated parameters in fp16 (half the bytes; the owner keeps its fp32 values).
        force_broadcast_object: `consolidate_state_dict` broadcasts each shard in turn instead of one gather.
        split_params: cut large parameters into one piece per rank (None: where it pays; True: every parameter of
            at least `min_split_numel` elements; False: one owner per parameter, as fairscale).
        min_split_numel: the smallest parameter, in elements, that `split_params` cuts.
        hierarchical: across hosts of equal rank counts, send once per host and hand on inside it (None: where the
            layout allows; True: refuse another layout; False: one broadcast over the group).
        check_agreement: compare the ranks' parameters and settings at construction; False skips the all-gather.
        shared_parameters: on one host, map the owners' shared-memory segments as the other ranks' parameters.
        **defaults: the optimizer's own arguments (``lr``, ``momentum``, ``betas``, ...), as `optim` takes them.

    Raises:
        TypeError: `optim` is not a torch optimizer class.
        ValueError: an argument out of range, a setting that cannot act in the run's layout, or ranks that differ.

    Example::

        model = DDP(model)  # or ShardedDataParallel(model, optimizer) for sharded gradients too
        optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
        loss_fn(model(x), y).backward()
        optimizer.step()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optim: type[Optimizer] = torch.optim.SGD,
        group: ProcessGroup | None = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        split_params: bool | None = None,
        min_split_numel: int = MIN_SPLIT_NUMEL,
        hierarchical: bool | None = None,
        check_agreement: bool = True,
        shared_parameters: bool = False,
        **defaults: Any,
    ) -> None:
        require_initialized("OSS")
        ledger.explain_uncaught_failures()  # a collective failure names each rank's last collective
        launch.quiesce_at_exit()  # gloo's threads done before the interpreter's teardown (its docstring)
        if not (inspect.isclass(optim) and issubclass(optim, Optimizer)):
            raise TypeError(
                f"OSS: optim must be a torch.optim.Optimizer subclass (e.g. torch.optim.Adam), got {optim!r}"
            )
        _check_split_params(split_params, optim)
        if not isinstance(min_split_numel, int) or isinstance(min_split_numel, bool):
            raise TypeError(f"OSS: min_split_numel must be an int (a number of elements), got {min_split_numel!r}")
        if min_split_numel < 1:
            raise ValueError(
                f"OSS: min_split_numel must be an int >= 1 (the fewest elements of a parameter that may be cut over "
                f"the ranks), got {min_split_numel!r}"
            )
        _check_numeric_hyperparameters(defaults)
        if not isinstance(shared_parameters, bool):
            raise TypeError(f"OSS: shared_parameters must be True or False, got {shared_parameters!r}")
        if hierarchical not in (None, True, False):
            raise TypeError(f"OSS: hierarchical must be None (where it pays), True or False, got {hierarchical!r}")
        self.hierarchical = hierarchical
        self._optim_class = optim
        self.split_params = split_params
        self.min_split_numel = min_split_numel
        self._pieces: dict[torch.Tensor, list[ParamPiece]] = {}
        shared_memory_on = shared_memory.enabled_by_environment()  # a bad value fails here, before any collective
        if shared_parameters:
            _check_can_share(broadcast_fp16, shared_memory_on)
        self._ready = False
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = group_size(self.group)
        self.rank = group_rank(self.group)
        self.broadcast_buffer_size = broadcast_buffer_size  # accepted for fairscale compatibility; unused
        self.broadcast_fp16 = broadcast_fp16
        self.force_broadcast_object = force_broadcast_object
        self._owner: dict[torch.Tensor, int] = {}
        self._holder_while_frozen: dict[torch.Tensor, int] = {}  # never-trainable tensors: whose optimizer holds them
        self._loads = [0] * self.world_size
        self._consolidated: dict[str, Any] | None = None
        self.shared_parameters = shared_parameters
        self._broadcaster = ParamBroadcaster(self.rank, self.group, broadcast_fp16, hierarchical, shared_parameters)
        super().__init__(params, defaults)
        _check_one_device_type(self._all_params())
        if shared_parameters and any(p.device.type != "cpu" for p in self._all_params()):
            raise ValueError(
                "OSS: shared_parameters shares the CPU pages of the parameters between the processes of one host; "
                "these parameters are on a GPU, where it cannot act. Leave shared_parameters off"
            )
        if check_agreement:  # before any collective that needs it
            known = hyperparameter_names(optim)
            sharding = {
                "optim": optim.__qualname__,
                "split_params": split_params,
                "min_split_numel": min_split_numel,
                "broadcast_fp16": broadcast_fp16,
                "shared_parameters": shared_parameters,
            }
            check_parameters_agree(self.param_groups, self.group, what="OSS", extra=sharding, known_keys=known)
        self._assign_new_trainable()
        self._auto_fused = _may_use_fused(optim, self.param_groups)
        inner_defaults = {**defaults, "fused": True} if self._auto_fused else defaults
        self.optim = optim(self._local_groups(), **inner_defaults)
        measure_whole_model = getattr(self.optim, "_measure_whole_model_of", None)  # an AdaScale (optim/adascale.py)
        if measure_whole_model is not None:
            measure_whole_model(self)
        self._pull_hyperparameters()
        self._ready = True

    # -- ownership -----------------------------------------------------------------------------------------------

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _assign_new_trainable(self) -> set[torch.Tensor]:
        """Gives owners to trainable parameters that have none yet (cutting large ones into pieces, see
        `split_params`), after giving a holder to each new frozen one (`_hold_frozen`); returns the tensors this rank
        now optimizes (parameters and pieces)."""
        new = [p for p in self._all_params() if p.requires_grad and p not in self._owner and p not in self._pieces]
        for p in new:
            self._holder_while_frozen.pop(p, None)  # placed again by its size, now that it has state to come
        self._hold_frozen()
        sizes = [p.numel() * p.element_size() for p in new]
        split = self._choose_splits(new, sizes)
        for index in sorted(split):
            param = new[index]
            spans = even_spans(param.numel(), self.world_size)
            self._pieces[param] = [ParamPiece.cut(param, a, b, rank) for rank, (a, b) in enumerate(spans)]
            for rank, (a, b) in enumerate(spans):
                self._loads[rank] += (b - a) * param.element_size()
        whole = [p for i, p in enumerate(new) if i not in split]
        owners = assign_owners([sizes[i] for i in range(len(new)) if i not in split], self._loads)
        self._owner.update(zip(whole, owners, strict=True))
        mine = {p for p, owner in zip(whole, owners, strict=True) if owner == self.rank}
        return mine | {self._pieces[new[i]][self.rank].tensor for i in split}

    def _hold_frozen(self) -> None:
        """Places each frozen parameter that has no owner in one rank's local optimizer, as fairscale does (every
        tensor of a group is in exactly one rank's partition), each counting one byte of load so that the shards
        still balance the state that exists: a frozen tensor has none. They are placed before the new trainable
        ones, in their order, so frozen tensors at the front of a model go to ranks 0, 1, ... as in fairscale,
        whose partition goes in order. It is placed again by its size, and gets state, when it becomes trainable;
        until then it is not broadcast: an optimizer that changes it (fairscale's tests scale every tensor it
        holds by a per-rank factor) changes it on its holder only."""
        frozen = [
            p
            for p in self._all_params()
            if not p.requires_grad
            and p not in self._owner
            and p not in self._pieces
            and p not in self._holder_while_frozen
        ]
        self._holder_while_frozen.update(zip(frozen, assign_owners([1] * len(frozen), self._loads), strict=True))

    def _choose_splits(self, params: list[torch.Tensor], sizes: list[int]) -> set[int]:
        if self.world_size == 1 or self.split_params is False:
            return set()
        smallest = max(self.min_split_numel, self.world_size)  # every piece at least one element
        candidates = [p.numel() >= smallest and can_split(self._optim_class, p) for p in params]
        if self.split_params:
            return {i for i, candidate in enumerate(candidates) if candidate}
        return choose_splits(sizes, candidates, self.world_size, _BALANCE_TOLERANCE)

    def _local_groups(self) -> list[dict[str, Any]]:
        return [self._local_group(group) for group in self.param_groups]

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        return {**group_hyperparameters(group), "params": self._optimized_by(self.rank, group["params"])}

    def _optimized_by(self, rank: int, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors `rank`'s local optimizer holds for `params`: those it owns, and its pieces of split ones."""
        out = []
        for p in params:
            if p in self._pieces:
                out.append(self._pieces[p][rank].tensor)
            elif self._owner.get(p, self._holder_while_frozen.get(p)) == rank:
                out.append(p)
        return out

    def partition_parameters(self) -> list[list[dict[str, Any]]]:
        """Per rank, the param groups (hyper-parameters and the parameters it owns) that rank optimizes; for a
        parameter cut into pieces, that rank's piece (see `pieces_of`)."""
        return [
            [
                {**group_hyperparameters(group), "params": self._optimized_by(rank, group["params"])}
                for group in self.param_groups
            ]
            for rank in range(self.world_size)
        ]

    @property
    def _per_device_params(self) -> dict[torch.device, list[list[torch.Tensor]]]:
        """fairscale's private view of the partition, which its tests read: per device, per rank, the tensors that
        rank's local optimizer holds."""
        out: dict[torch.device, list[list[torch.Tensor]]] = {}
        for rank, groups in enumerate(self.partition_parameters()):
            for t in (t for group in groups for t in group["params"]):
                out.setdefault(t.device, [[] for _ in range(self.world_size)])[rank].append(t)
        return out

    @property
    def buckets(self) -> dict[torch.device, dict[int, Any]]:
        """fairscale's private view of the broadcast buffers, which its tests read: per device, per owner rank, its
        first message (``.buffer``: the flat fp32 buffer the parameters are views of); empty before the first
        step."""
        out: dict[torch.device, dict[int, Any]] = {}
        for message in self._broadcaster.messages:
            out.setdefault(message.flat.device, {}).setdefault(message.owner, message)
        return out

    def owner_of(self, param: torch.Tensor) -> int | None:
        """The rank that optimizes `param`; None for a parameter that has never been trainable (one rank's local
        optimizer holds it meanwhile: `partition_parameters`), or one cut into pieces over the ranks (see
        `pieces_of`)."""
        return self._owner.get(param)

    def pieces_of(self, param: torch.Tensor) -> list[ParamPiece]:
        """The pieces of a parameter cut over the ranks (piece k: rank k's elements ``[start, end)`` of the
        flattened parameter); an empty list for a parameter that is optimized whole."""
        return list(self._pieces.get(param, []))

    def owned_grads(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients (or gradient slices, for split parameters) of `params` that this rank accounts for, so
        that every element is counted by exactly one rank: its owner's, or rank 0's for a parameter without one
        (a frozen parameter that still holds a gradient)."""
        out = []
        for p in params:
            if p in self._pieces:
                piece_grad = self._pieces[p][self.rank].grad_slice()
                if piece_grad is not None:
                    out.append(piece_grad)
            elif p.grad is not None and self._owner.get(p, 0) == self.rank:
                out.append(p.grad)
        return out

    def held_piece_grads(self, params: Iterable[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The gradients this rank's pieces of split parameters (of `params`, or all) hold apart from their
        parameter: ShardedDataParallel lets a split parameter's full-size gradient go after the reduce
        (``param.grad`` is None) and the piece keeps its share. Code that unscales, clips or divides gradients
        must reach these besides the ``.grad`` of the parameters."""
        wanted = self._pieces.keys() if params is None else [p for p in params if p in self._pieces]
        pieces = [self._pieces[p][self.rank] for p in wanted]
        return [piece.tensor.grad for piece in pieces if piece.held and piece.tensor.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' gradients and those that this rank's pieces of split parameters hold apart."""
        super().zero_grad(set_to_none=set_to_none)
        for pieces in self._pieces.values():
            pieces[self.rank].clear_grad(set_to_none)

    def refresh_trainable(self) -> None:
        """Takes `requires_grad` changes into account: newly trainable parameters get an owner.

        Parameters keep their owner (and optimizer state) when they are frozen; frozen parameters are simply not
        broadcast. One never trainable before moves from the local optimizer that held it (`_hold_frozen`) to its
        new owner's. `step()` calls this itself when it sees a trainable parameter without an owner.
        """
        _check_one_device_type(self._all_params())
        self._assign_new_trainable()
        for group, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            mine = self._optimized_by(self.rank, group["params"])
            kept = [t for t in local["params"] if t in set(mine)]  # less a frozen tensor now owned elsewhere
            held = set(kept)
            local["params"][:] = kept + [t for t in mine if t not in held]

    # -- torch.optim.Optimizer interface ----------------------------------------------------------------------------

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The local optimizer's state: only the parameters this rank owns."""
        return self.optim.state if self._ready else self._state_during_init

    @state.setter
    def state(self, value: Any) -> None:  # torch's Optimizer.__init__ assigns an empty dict here
        self._state_during_init = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group; its trainable parameters are placed on the least-loaded ranks, others stay put."""
        if self._ready:  # validate before changing anything, so a rejected group leaves the optimizer usable
            new = param_group["params"]
            new = [new] if isinstance(new, torch.Tensor) else list(new)
            param_group = {**param_group, "params": new}
            _check_one_device_type(self._all_params() + new)
        super().add_param_group(param_group)
        if self._ready:
            self._assign_new_trainable()
            self.optim.add_param_group(self._local_group(self.param_groups[-1]))
            self._pull_hyperparameters()

    def _own_new_trainable(self) -> None:
        """Refreshes ownership when a parameter became trainable since (no collective: all ranks see the same)."""
        if any(p.requires_grad and p not in self._owner and p not in self._pieces for p in self._all_params()):
            self.refresh_trainable()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Updates this rank's shard with the local optimizer, then receives every other shard from its owner.

        A `closure` is evaluated here, once, before the gradients are handed to the local optimizer (its pieces of
        split parameters, its fused kernel's layout), where the optimizer is element-wise and so evaluates it once
        first anyway; other optimizers (LBFGS, which evaluates it several times) get it as it is."""
        self._own_new_trainable()
        self._push_hyperparameters()
        if self.world_size > 1:  # the parameters move into their messages' buffers before any state is made
            self._broadcaster.prepare(self._broadcast_plan())
        loss = None
        if closure is not None and self._optim_class in SPLITTABLE:
            with torch.enable_grad():
                loss = closure()
            closure = None
        self._refresh_pieces()
        self._match_fused_layouts()
        with _unfused_where_state_is_mixed(self.optim):
            if closure is not None:
                with torch.enable_grad():
                    loss = self.optim.step(closure, **kwargs)
            else:
                stepped = self.optim.step(**kwargs)
                loss = stepped if loss is None else loss
        self._pull_hyperparameters()
        self._broadcast_params()
        for pieces in self._pieces.values():
            if not pieces[self.rank].held:
                pieces[self.rank].tensor.grad = None  # hold no reference to a gradient the user may free
        return loss

    def _refresh_pieces(self) -> None:
        for pieces in self._pieces.values():
            for piece in pieces:
                piece.refresh()

    def _match_fused_layouts(self) -> None:
        """Gives gradients and state the memory layout of their parameter where the local optimizer is fused.

        torch's fused CPU kernels walk parameter, gradient and state memory in step and silently compute a wrong
        update when their strides differ (CUDA raises); that happens when a parameter's layout changes after its
        state was created (``channels_last``, a transposed copy) or a gradient arrives in another layout.
        """
        for local in self.optim.param_groups:
            if not local.get("fused"):
                continue
            for p in local["params"]:
                if p.grad is not None and not _same_layout(p, p.grad):
                    p.grad = _copy_in_layout_of(p, p.grad)
                state = self.optim.state.get(p, {})
                for key, value in state.items():
                    if torch.is_tensor(value) and value.shape == p.shape and not _same_layout(p, value):
                        state[key] = _copy_in_layout_of(p, value)

    def _push_hyperparameters(self) -> None:
        for group, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            local.update(group_hyperparameters(group))

    def _pull_hyperparameters(self) -> None:
        """Copies back what the local optimizer added to or changed in its groups (new keys, per-group values it
        updates itself); `_push_hyperparameters` ran just before, so every difference is the local optimizer's."""
        for group, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            group.update(group_hyperparameters(local))

    def _broadcast_params(self) -> None:
        if self.world_size > 1:
            self._broadcaster.broadcast(self._broadcast_plan())

    def _broadcast_plan(self) -> Plan:
        """(owner, tensors, in place) per message, in a fixed order: trainable whole parameters by owner, device
        and dtype; then each piece of a trainable split parameter alone, sent from the parameter's own storage."""
        messages: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
        pieces = []
        for p in self._all_params():
            if not p.requires_grad:
                continue
            if p in self._pieces:
                pieces += [(piece.owner, [piece.tensor], True) for piece in self._pieces[p]]
            else:
                messages.setdefault((self._owner[p], p.device, p.dtype), []).append(p)
        return [(key[0], params, False) for key, params in messages.items()] + pieces

    # -- gradient clipping -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm(
        self,
        max_norm: float,
        norm_type: float | str = 2.0,
        filter_params_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Clips gradients by their norm over the whole model (all shards); returns that norm.

        Equal to ``torch.nn.utils.clip_grad_norm_`` on the full model: each rank takes the norm of the gradients
        of the parameters it owns, one all-reduce combines them, and every present gradient is scaled by
        ``min(1, max_norm / (norm + 1e-6))``.
        """
        norm_type = float(norm_type)
        params = [p for p in self._all_params() if p.grad is not None or self.held_piece_grads([p])]
        if filter_params_fn is not None:
            params = list(filter_params_fn(params))
        self._own_new_trainable()
        counted = self.owned_grads(params)  # every element by exactly one rank
        grads = [p.grad for p in params if p.grad is not None] + self.held_piece_grads(params)
        data = params[0].device if params else None
        total = _local_norm_term(counted, norm_type, comm_device(self.group, data))
        if norm_type == float("inf"):
            comm.all_reduce(total, self.group, op=dist.ReduceOp.MAX)
        else:
            comm.all_reduce(total, self.group)
            total = total ** (1.0 / norm_type)
        total = total.reshape(())  # a 0-d tensor, like torch.nn.utils.clip_grad_norm_
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        coef_on = {d: clip_coef.to(d) for d in {g.device for g in grads}}  # one copy per device, not per gradient
        for grad in grads:
            grad.mul_(coef_on[grad.device].to(grad.dtype))
        return total

    # -- checkpoints ---------------------------------------------------------------------------------------------------

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Collects every shard's state on `recipient_rank` (-1: on every rank), for `state_dict()`.

        A collective: call it on every rank. By default one gather of the encoded shards; with
        `force_broadcast_object` each rank broadcasts its shard in turn as a uint8 tensor.
        """
        valid = isinstance(recipient_rank, int) and not isinstance(recipient_rank, bool)
        if not valid or not -1 <= recipient_rank < self.world_size:
            raise ValueError(
                f"consolidate_state_dict: recipient_rank must be -1 (every rank) or a rank in "
                f"[0, {self.world_size}), got {recipient_rank!r}"
            )
        index = {p: i for i, p in enumerate(self._all_params())}
        index.update({pieces[self.rank].tensor: index[p] for p, pieces in self._pieces.items()})
        shard = {index[p]: clone_state(s, torch.device("cpu")) for p, s in self.optim.state.items() if s}
        shards = self._collect(shard, recipient_rank)
        self._consolidated = None
        if shards is not None:
            merged = self._join_pieces(shards, index)
            groups = indexed_param_groups(self.param_groups)  # as OSS.param_groups are, key for key (fairscale's)
            self._consolidated = {"state": dict(sorted(merged.items())), "param_groups": groups}

    def _join_pieces(self, shards: list[dict[int, Any]], index: dict[torch.Tensor, int]) -> dict[int, Any]:
        """Every rank's shard merged into torch's format; a split parameter's state joined from its pieces'."""
        merged: dict[int, Any] = {}
        for part in shards:
            merged.update(part)
        for p, pieces in self._pieces.items():
            states = [shard.get(index[p]) for shard in shards]
            if all(states):
                merged[index[p]] = join_states(p, states, [(piece.start, piece.end) for piece in pieces])
            else:
                merged.pop(index[p], None)  # a piece that never stepped: the parameter has no state yet
        return merged

    def _collect(self, shard: dict[int, Any], recipient_rank: int) -> list[dict[int, Any]] | None:
        if not self.force_broadcast_object:
            return gather_objects(shard, recipient_rank, self.group)
        received = [broadcast_object(shard, src, self.group) for src in range(self.world_size)]
        return received if recipient_rank in (-1, self.rank) else None

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """The whole optimizer's state in torch's format (loadable by OSS at any world size or a torch optimizer).

        Needs `consolidate_state_dict()` first; ``all_ranks=True`` consolidates onto every rank itself (a
        collective, so every rank must call it).
        """
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        if self._consolidated is None:
            raise RuntimeError(
                f"OSS.state_dict() on rank {self.rank}: the state is sharded and was not consolidated on this rank. "
                "Call optimizer.consolidate_state_dict(recipient_rank) on every rank first and read state_dict() on "
                "that rank, or use state_dict(all_ranks=True) on every rank."
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict saved by OSS at any world size, or by a plain torch optimizer; never changes it."""
        check_compatible(state_dict, self.param_groups)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(copy.deepcopy(group_hyperparameters(saved)))  # share nothing (e.g. a tensor lr) with it
            if self._auto_fused and all(group.get(k) in (None, False) for k in _PLACEMENT_KEYS):
                group["fused"] = True  # a checkpoint from an unfused optimizer: keep the faster kernel
        # The local optimizer's own groups, in its order: `refresh_trainable` appends parameters at the end of a
        # local group, so that order can differ from the order of `self.param_groups`.
        local = shard_of(state_dict, self.param_groups, self.optim.param_groups, self._cut_for_pieces())
        for local_group, group in zip(local["param_groups"], self.param_groups, strict=True):
            local_group.update(group_hyperparameters(group))
        self.optim.load_state_dict(local)
        self._consolidated = None

    def _cut_for_pieces(self) -> dict[torch.Tensor, tuple[torch.Tensor, Callable[[dict[str, Any]], dict[str, Any]]]]:
        """Per piece this rank optimizes: its parameter, and how to cut that parameter's saved state to it."""
        out = {}
        for p, pieces in self._pieces.items():
            piece = pieces[self.rank]
            out[piece.tensor] = (p, lambda state, p=p, a=piece.start, b=piece.end: cut_state(state, p, a, b))
        return out


@contextlib.contextmanager
def _unfused_where_state_is_mixed(optim: Optimizer) -> Iterator[None]:
    """Steps a fused group without its fused kernel when some of its parameters with a gradient have optimizer
    state and others none yet (a parameter made trainable after the others stepped: gradual unfreezing).

    torch's fused kernels take all or none of a state list (e.g. SGD's momentum buffers) and reject a mix; the
    per-tensor path computes the same update and creates the missing state. The next step is fused again.
    """
    switched = []
    for group in optim.param_groups:
        if group.get("fused"):
            with_grad = [bool(optim.state.get(p)) for p in group["params"] if p.grad is not None]
            if any(with_grad) and not all(with_grad):
                group["fused"] = False
                switched.append(group)
    try:
        yield
    finally:
        for group in switched:
            group["fused"] = True


_NUMERIC_HYPERPARAMETERS = ("lr", "momentum", "dampening", "weight_decay", "eps", "alpha", "lr_decay", "rho")


def hyperparameter_names(optim: type[Optimizer]) -> set[str]:
    """The param-group keys `optim` reads, on which ranks must agree: the constructor arguments of the torch
    optimizer it derives from (torch's SGD, Adam, ...: lr, momentum, betas, weight_decay, fused, ...), or, for one
    that derives from none, its constructors' named arguments up its class chain while they pass the rest on through
    ``**kwargs``; plus what torch's schedulers add (initial_lr). Other keys only warn when they differ: a per-rank
    ``rank`` that a subclass takes, as fairscale's own tests pass it."""
    chain = [cls for cls in optim.__mro__ if "__init__" in vars(cls) and cls not in (Optimizer, object)]
    from_torch = [cls for cls in chain if cls.__module__.startswith("torch.optim")]
    names: set[str] = set()
    for cls in from_torch[:1] or chain:
        parameters = inspect.signature(cls.__init__).parameters.values()
        names |= {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break
    return (names - {"self", "params", "defaults"}) | {"initial_lr"}


def _check_numeric_hyperparameters(defaults: dict[str, Any]) -> None:
    """A number where torch's optimizers expect one (``lr="0.1"`` from a config file would otherwise fail inside
    torch with a comparison error that names nothing), raised before any collective."""
    for name in _NUMERIC_HYPERPARAMETERS:
        value = defaults.get(name)
        if value is None or torch.is_tensor(value):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"OSS: {name} must be a number, got {value!r} ({type(value).__name__})")
    betas = defaults.get("betas")
    if betas is not None and not (
        isinstance(betas, tuple | list) and all(isinstance(b, int | float) or torch.is_tensor(b) for b in betas)
    ):
        raise TypeError(f"OSS: betas must be a pair of numbers, got {betas!r}")


def _check_split_params(split_params: Any, optim: type[Optimizer]) -> None:
    if split_params not in (None, True, False):
        raise TypeError(f"OSS: split_params must be None (where it pays), True or False, got {split_params!r}")
    if split_params and optim not in SPLITTABLE:
        names = ", ".join(sorted(o.__name__ for o in SPLITTABLE))
        raise ValueError(
            f"OSS: split_params=True needs an element-wise optimizer ({names}); {optim.__name__} may read a whole "
            "tensor at once, so its update of a piece would differ. Pass split_params=False or None."
        )


def _check_can_share(broadcast_fp16: bool, shared_memory_on: bool) -> None:
    """Refuses `shared_parameters` with the settings under which it could not act (before any collective)."""
    if broadcast_fp16:
        raise ValueError(
            "OSS: shared_parameters cannot act with broadcast_fp16 (the ranks would map the owners' fp16 copies, not "
            "their parameters): choose one"
        )
    if not shared_memory_on:
        raise ValueError(
            f"OSS: shared_parameters needs shared memory, which {shared_memory.ENV_VAR}=0 turns off: unset it or "
            "leave shared_parameters off"
        )


def _check_one_device_type(params: list[torch.Tensor]) -> None:
    kinds = sorted({p.device.type for p in params})
    if len(kinds) > 1:
        raise ValueError(
            f"OSS: the parameters are on several device types ({', '.join(kinds)}); move the whole model to one "
            "device type (e.g. model.to('cuda')) before building the optimizer"
        )


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same strides wherever they matter (dimensions of size 1 can have any stride)."""
    return all(sa == sb for size, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True) if size > 1)


def _copy_in_layout_of(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(param, dtype=value.dtype).copy_(value)


def _may_use_fused(optim: type[Optimizer], param_groups: list[dict[str, Any]]) -> bool:
    """True when `optim` has a fused kernel for these parameters and the user did not pick an implementation."""
    if "fused" not in inspect.signature(optim.__init__).parameters:
        return False
    if any(group.get(key) is not None for group in param_groups for key in _PLACEMENT_KEYS):
        return False
    if any(group.get("differentiable") for group in param_groups):
        return False
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        supported = set(_get_fused_kernels_supported_devices())
    except ImportError:
        supported = {"cuda"}
    params = [p for group in param_groups for p in group["params"]]
    return bool(params) and all(p.is_floating_point() and p.device.type in supported for p in params)


def _local_norm_term(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This shard's contribution: ``max |g|`` for the inf-norm, else ``sum ||g||_p ** p`` (float32)."""
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    home = grads[0].device  # reduced where the gradients are, then moved once (a CUDA-to-host copy synchronises)
    norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type).to(home) for g in grads])
    if norm_type == float("inf"):
        return norms.max().reshape(1).to(device)
    return (norms**norm_type).sum().reshape(1).to(device)
