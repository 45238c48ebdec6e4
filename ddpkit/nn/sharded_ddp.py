"""ShardedDataParallel: gradient sharding (ZeRO stage 2) on top of OSS.

What it is: a module wrapper that, during backward, reduces each gradient bucket to the rank whose OSS owns it,
so each rank holds the averaged gradients of its own shard only; `OSS.step` then updates the shards and
broadcasts them. What it sends per step: every trainable gradient once (to its owner) plus OSS's broadcast of
every parameter once, exactly DDP's all-reduce bytes; on one host through shared memory (`mailboxes`), across
hosts of several ranks in two stages (`hierarchical_reduce`), over sockets with every receive posted at the first
gradient so both directions of a link carry data (`comm.post_reduce`: gloo's point-to-point is a rendezvous whose
ready notice queues behind the receiver's own outgoing data; `receives_ahead` posts fewer). What it holds: the
class docstring's "Memory". Where its time goes, measured: benchmarks/README.md, "Where ZeRO-2's time goes".
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.algorithms.quantize import COMPRESSIONS, BlockCodec
from ddpkit.distributed import comm, hosts, launch, ledger, shared_memory
from ddpkit.distributed.agreement import check_parameters_agree
from ddpkit.distributed.buckets import broadcast_coalesced
from ddpkit.distributed.env import ProcessGroup, group_rank, group_size, require_initialized
from ddpkit.distributed.grad_buckets import GradBucket, build_buckets
from ddpkit.distributed.hierarchical_reduce import HierarchicalReduce
from ddpkit.distributed.mailboxes import MailboxReduce
from ddpkit.nn.wrapper import ModuleWrapper
from ddpkit.optim.adascale import AdaScale
from ddpkit.optim.oss import OSS
from ddpkit.optim.param_pieces import ParamPiece


class DeviceChangeError(ValueError, AssertionError):
    """`ShardedDataParallel.to` asked to move the parameters to another device type: a ValueError, and the
    AssertionError fairscale raised there (its own test catches that)."""


HeldKind = Literal["average", "local"]
"""What the last reduce left in a parameter's ``.grad``: the owner's average, or a non-owner's own gradient."""


class ShardedDataParallel(ModuleWrapper):
    """Data parallelism in which each gradient is reduced only to the rank that owns its optimizer state (ZeRO-2).

    During backward, as soon as a bucket's gradients (one owner, device and dtype, up to `reduce_buffer_size`
    elements; large parameters alone) are accumulated, they are averaged onto the rank that owns them in OSS (one
    asynchronous reduce, in one fixed order on every rank); when backward ends, owners hold exactly DDP's averaged
    gradient. Other ranks drop the large gradients they do not own and keep their own small ones
    (`keep_bucketed_grads`); of a parameter OSS cut, only the rank's piece. More: docs/sharded.md.

    Sends: at construction, an all-gather of an 8-byte digest of the ranks' parameters and options (ranks that
    differ are refused, naming the option) and rank 0's parameters; per step, every trainable gradient once to its
    owner: with OSS's broadcast, DDP's all-reduce traffic (one host: shared memory; across hosts: summed per host
    first). Holds: its own gradients (P/N), the buckets in flight, over sockets receive buffers.

    Args:
        module: the model to train; the same parameters on every rank.
        sharded_optimizer: the `OSS` (or an `AdaScale` around one) that owns the parameters, or a list of them.
        process_group: the process group to reduce over: the optimizers' (default: the whole job).
        broadcast_buffers: broadcast the module's buffers from rank 0 before each forward that syncs gradients.
        sync_models_at_startup: broadcast rank 0's parameters and buffers at construction, so replicas start equal.
        reduce_buffer_size: the most elements a bucket of small gradients packs (0: every gradient on its own).
        auto_refresh_trainable: notice a parameter frozen or unfrozen since the last step and rebuild the buckets.
        reduce_fp16: send fp32 gradients in fp16 (half the bytes, as fairscale's option).
        warn_on_trainable_params_changed: warn when that rebuild happens.
        find_unused_parameters: leave the gradients of parameters unused on every rank untouched, as DDP does.
        cross_host_compression: "none", "bf16", "int8" or "int4" (with error feedback) between hosts; CPU only.
        keep_bucketed_grads: keep each rank's own gradients of small parameters it does not own (as fairscale).
        full_split_grads: keep the whole gradient of a parameter OSS cut into pieces on every rank.
        receives_ahead: over sockets, post an owner's receives only this many buckets ahead (None: all at once).

    Raises:
        ValueError: an argument out of range, one that cannot act in the run's layout, or ranks that differ.
        TypeError: `module` not a Module, `sharded_optimizer` not an OSS (or AdaScale around one), a switch no bool.

    Example::

        optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
        model = ShardedDataParallel(model, optimizer)
        loss_fn(model(x), y).backward()
        optimizer.step()
    """

    def __init__(
        self,
        module: nn.Module,
        sharded_optimizer: OSS | AdaScale | list[OSS | AdaScale],
        process_group: ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int = 2**23,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
        find_unused_parameters: bool = False,
        cross_host_compression: str = "none",
        keep_bucketed_grads: bool = True,
        full_split_grads: bool = False,
        receives_ahead: int | None = None,
    ) -> None:
        super().__init__()
        require_initialized("ShardedDataParallel")
        ledger.explain_uncaught_failures()  # a collective failure names each rank's last collective
        launch.quiesce_at_exit()  # gloo's threads done before the interpreter's teardown (its docstring)
        if not isinstance(module, nn.Module):
            raise TypeError(f"ShardedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}")
        self.sharded_optimizers = _check_optimizers(sharded_optimizer)
        self.process_group = _check_group(process_group, self.sharded_optimizers)
        if not isinstance(reduce_buffer_size, int) or reduce_buffer_size < 0:
            raise ValueError(
                f"ShardedDataParallel: reduce_buffer_size must be an int >= 0 (elements; 0 disables bucketing), "
                f"got {reduce_buffer_size!r}"
            )
        _check_one_device_type(module)
        _check_compression(cross_host_compression, {p.device.type for p in module.parameters()})
        self.cross_host_compression = cross_host_compression
        if not isinstance(keep_bucketed_grads, bool):
            raise TypeError(
                f"ShardedDataParallel: keep_bucketed_grads must be True or False, got {keep_bucketed_grads!r}"
            )
        self.keep_bucketed_grads = keep_bucketed_grads
        if not isinstance(full_split_grads, bool):
            raise TypeError(f"ShardedDataParallel: full_split_grads must be True or False, got {full_split_grads!r}")
        self.full_split_grads = full_split_grads
        if receives_ahead is not None and (
            isinstance(receives_ahead, bool) or not isinstance(receives_ahead, int) or receives_ahead < 1
        ):
            raise ValueError(f"ShardedDataParallel: receives_ahead must be None or an int >= 1, got {receives_ahead!r}")
        self.receives_ahead = receives_ahead
        shared_memory.enabled_by_environment()  # a bad DDPKIT_SHARED_MEMORY fails here, before any collective
        options = {  # what changes the messages every rank exchanges: ranks that differ would mismatch mid-backward
            "reduce_buffer_size": reduce_buffer_size,
            "find_unused_parameters": find_unused_parameters,
            "reduce_fp16": reduce_fp16,
            "keep_bucketed_grads": keep_bucketed_grads,
            "cross_host_compression": cross_host_compression,
            "broadcast_buffers": broadcast_buffers,
            "receives_ahead": receives_ahead,
        }
        check_parameters_agree(module, self.process_group, what="ShardedDataParallel", extra=options)  # (before
        # shared memory is agreed: nothing is left behind when they differ)
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.reduce_buffer_size = reduce_buffer_size
        self.auto_refresh_trainable = auto_refresh_trainable
        self.reduce_fp16 = reduce_fp16
        self.warn_on_trainable_params_changed = warn_on_trainable_params_changed
        self.find_unused_parameters = find_unused_parameters
        self.world_size = group_size(self.process_group)
        self.rank = group_rank(self.process_group)
        # DDP's attributes that code written for DDP reads (Lightning, accelerate): one device type (checked above)
        devices = {p.device for p in module.parameters()}
        self.is_multi_device_module = len(devices) > 1
        self.device_type = next(iter(devices)).type if devices else "cpu"
        self._grad_sync_enabled = True
        self._sync_this_backward = True
        self._callback_queued = False
        self._receives_posted = False
        self._unreduced = False
        self._next_bucket = 0
        self._next_post = 0  # buckets whose receiving side is posted (sockets), in order
        self._next_owned_finish = 0  # buckets before it: an owner's posted reduces completed during backward
        self._sending: list[GradBucket] = []  # non-owned buckets launched whose transfer may still need their data
        self._warned_unused = False
        self._hooks: list[Any] = []
        self._accumulators: dict[nn.Parameter, Any] = {}  # per parameter: the AccumulateGrad node its hook asks
        # Gradients left in place by the last reduce, with their identity and version then: an owner's average
        # ("average") or, with keep_bucketed_grads, a non-owner's own gradient ("local"). See `_keep_average_hook`.
        self._held: dict[nn.Parameter, tuple[int, int, HeldKind]] = {}
        self._buckets: list[GradBucket] = []
        self._bucket_of: dict[nn.Parameter, list[GradBucket]] = {}  # several for a parameter cut into pieces
        self._own_piece: dict[nn.Parameter, ParamPiece] = {}  # per parameter cut into pieces: this rank's piece
        self._cut_in_flight: list[nn.Parameter] = []  # cut parameters whose pieces all left, not yet let go
        self._piece_marks: dict[nn.Parameter, tuple[int, int]] = {}  # the held piece gradient's id and version
        if sync_models_at_startup:
            self._broadcast_from_rank0([p.detach() for p in module.parameters()])
            self._broadcast_from_rank0(list(module.buffers()))
        cpu_bytes = shared_memory.cpu_bytes(module.parameters())
        # Room the host needs: the senders' mailboxes, (N-1) copies of the gradients, and OSS's parameter
        # segments, one more copy. Without it every rank keeps the sockets (never a SIGBUS mid-backward).
        self._mailboxes = MailboxReduce.agree(self.process_group, cpu_bytes * self.world_size)
        self._two_stage: HierarchicalReduce | None = None
        if self._mailboxes is None and cpu_bytes:  # several hosts: within each first, then across (hosts doc)
            wanted = self.sharded_optimizers[0].hierarchical
            compress = cross_host_compression != "none"
            groups = hosts.hierarchy(self.process_group, wanted, "ShardedDataParallel", one_per_host=compress)
            if groups is not None:
                codec = BlockCodec(cross_host_compression) if compress else None
                self._two_stage = HierarchicalReduce.agree(groups, cpu_bytes, codec)
        self._bucket_generation = 0
        self.refresh_trainable()

    # -- set-up ---------------------------------------------------------------------------------------------------

    def refresh_trainable(self) -> None:
        """Rebuilds the gradient buckets and hooks after `requires_grad` changed on some parameters."""
        for optimizer in self.sharded_optimizers:
            optimizer.refresh_trainable()
        for hook in self._hooks:
            hook.remove()
        owner_of, pieces = {}, {}
        self._own_piece = {}
        for optimizer in self.sharded_optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        owner_of[p] = optimizer.owner_of(p)
                        if optimizer.pieces_of(p):
                            pieces[p] = [(piece.owner, piece.start, piece.end) for piece in optimizer.pieces_of(p)]
                            self._own_piece[p] = optimizer.pieces_of(p)[self.rank]
        module_params = [p for p in self.module.parameters() if p.requires_grad]
        _warn_unoptimized(self.module, owner_of)
        expected_order = [p for p in reversed(module_params) if p in owner_of]  # backward visits layers in reverse
        self._buckets = build_buckets(expected_order, owner_of, self.reduce_buffer_size, pieces)
        self._forget_generation(f"{self._bucket_generation}.")
        self._bucket_generation += 1
        self._bucket_of = {}
        for bucket in self._buckets:
            for p in bucket.params:
                self._bucket_of.setdefault(p, []).append(bucket)
        self._held = {p: mark for p, mark in self._held.items() if p in self._bucket_of}  # frozen ones: forgotten
        # The hooks hold the wrapper weakly (`_weakly`): held strongly, it could never be freed.
        self._accumulators = {}
        owner = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(_weakly(owner, "_on_grad_ready")) for p in self._bucket_of]
        self._hooks += [p.register_hook(self._keep_average_hook(p)) for p in self._bucket_of]
        self._trainable_signature = self._signature()
        ledger.set_context("ShardedDataParallel trainable parameters", self._describe_trainable())

    def _describe_trainable(self) -> str:
        names = [name for name, p in self.module.named_parameters()]
        frozen = [name for name, p in self.module.named_parameters() if not p.requires_grad]
        shown = ", ".join(frozen[:4]) + (f" and {len(frozen) - 4} more" if len(frozen) > 4 else "")
        return f"{len(names) - len(frozen)} of {len(names)}" + (f" (frozen: {shown})" if frozen else "")

    def _forget_generation(self, prefix: str) -> None:
        """Frees what the buckets of the generation being replaced held: their shared-memory mailboxes (so
        /dev/shm does not grow with every freeze and unfreeze) and their cross-host error-feedback residuals."""
        mailboxes = self._mailboxes or (self._two_stage.mailboxes if self._two_stage is not None else None)
        if mailboxes is not None:
            mailboxes.forget(prefix)
        if self._two_stage is not None:
            self._two_stage.forget(prefix)

    def _signature(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.module.parameters())

    # -- forward --------------------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.auto_refresh_trainable and self._signature() != self._trainable_signature:
            if self.warn_on_trainable_params_changed:
                warnings.warn(
                    "ShardedDataParallel: the set of trainable parameters changed; rebuilding the gradient "
                    "buckets (pass warn_on_trainable_params_changed=False to silence this)",
                    stacklevel=2,
                )
            self.refresh_trainable()
        if torch.is_grad_enabled():
            self._refuse_grads_that_require_grad()
        self._sync_this_backward = self._grad_sync_enabled
        # As torch DDP: buffers are synced only by a forward that will sync gradients (grad enabled, not in
        # no_sync), so an evaluation on some ranks only (`torch.no_grad()`) sends nothing and cannot hang.
        if self.broadcast_buffers and self._grad_sync_enabled and torch.is_grad_enabled():
            self.sync_buffers(blocking=True)
        return self.module(*inputs, **kwargs)

    def _refuse_grads_that_require_grad(self) -> None:
        """Before a forward that may be followed by a backward (where fairscale checks too): a ``.grad`` that
        requires grad would be reduced into an autograd graph; it is refused on the rank that holds it, naming it."""
        for name, param in self.module.named_parameters():
            if param.grad is not None and param.grad.requires_grad:
                raise RuntimeError(_GRAD_REQUIRES_GRAD.format(name=name))

    def sync_buffers(self, blocking: bool = False) -> list[Any] | None:
        """Broadcasts the module's buffers from rank 0.

        Blocking: one flat message per (device type, dtype). Non-blocking: each buffer is broadcast in place and
        the pending works are returned; the buffers hold rank 0's values once every work has been waited for.
        """
        buffers = list(self.module.buffers())
        if self.world_size == 1 or not buffers:
            return None if blocking else []
        if blocking:
            self._broadcast_from_rank0(buffers)
            return None
        return [comm.broadcast(b, 0, self.process_group, async_op=True) for b in buffers]

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        if self.world_size > 1:
            broadcast_coalesced(tensors, 0, self.process_group)

    # -- backward: reduce each gradient to its owner ---------------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is not None and param.grad.requires_grad:
            name = next((n for n, p in self.module.named_parameters() if p is param), "a parameter")
            raise RuntimeError(_GRAD_REQUIRES_GRAD.format(name=name))
        if not self._sync_this_backward:
            self._unreduced = True  # accumulated under no_sync(): `reduce()` has work to do
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
            self._post_receives()
        for bucket in self._bucket_of[param]:
            bucket.pending -= 1
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            self._launch(self._buckets[self._next_bucket])
            self._next_bucket += 1
        if self._two_stage is not None:
            self._two_stage.progress()  # cross-host stages of buckets whose host stage is done

    def _keep_average_hook(self, param: nn.Parameter) -> Any:
        """A gradient hook for a second backward before the gradients were cleared (accumulating without no_sync).

        The owner's ``.grad`` then still holds the average A of the last reduce, and DDP's answer is
        A + average(new). The other ranks must then send only their new gradient: one that kept its own gradient
        of the last reduce (`keep_bucketed_grads`) drops it here, before autograd adds the new one to it. Adding
        (N-1) A to the owner's incoming gradient then makes the next reduce give exactly DDP's answer. The version
        counter tells whether ``.grad`` is still untouched since the reduce (a zero_grad() in place is a clear).
        """

        with torch.enable_grad():  # the node that adds to param.grad, kept by the wrapper, not by the hook: the
            # node holds the parameter, so a hook of the parameter holding it would make a cycle never freed
            self._accumulators[param] = param.view_as(param).grad_fn.next_functions[0][0]
        owner = weakref.ref(self)

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            wrapper = owner()
            if wrapper is None or not _will_accumulate(wrapper._accumulators[param]):  # torch.autograd.grad(...,
                return None  # params): .grad is left alone
            kind = wrapper._untouched_since_reduce(param)
            if kind == "local":
                param.grad = None  # autograd then takes the new gradient as it is
            if kind != "average" or wrapper.world_size == 1:
                return None
            # A split parameter's held gradient is the average on this rank's piece and zero elsewhere, so the
            # same correction applies piece by piece.
            return grad + (wrapper.world_size - 1) * param.grad

        return hook

    def _untouched_since_reduce(self, param: nn.Parameter) -> HeldKind | None:
        """The kind of gradient the last reduce left on `param` ("average" or "local") if `param` still holds it
        untouched, else None; either way the record is forgotten."""
        mark = self._held.pop(param, None)
        held = param.grad
        if mark is None or held is None or mark[:2] != (id(held), held._version):
            return None
        return mark[2]

    def _drop_stale(self, bucket: GradBucket) -> None:
        """Before a bucket is sent: a gradient that this backward did not reach (its parameter was unused here) but
        the last reduce left must not be sent again as new. A non-owner's kept gradient is dropped; an owner's
        average A is multiplied by N, so the sum gives A + average(others' new), as DDP's accumulation."""
        if not self._held:
            return
        for p in bucket.params:
            kind = self._untouched_since_reduce(p) if p in self._held else None
            if kind == "local":
                p.grad = None
            elif kind == "average" and p.grad is not None:
                p.grad.mul_(self.world_size)

    def _post_receives(self) -> None:
        """Over sockets (gloo, CPU), posts the receiving side of the first buckets' reduces at the first gradient.

        Each owner's ready notices then leave before its own outgoing buckets, which would otherwise queue ahead
        of them on the connection and hold the data coming the other way (see `comm.post_reduce` and the module
        doc). With `receives_ahead` the posts run that many buckets ahead of the launches (`_post_up_to`), so an
        owner's receive buffers are bounded by a few buckets, not its whole share. Every rank posts in the bucket
        order, so the tags match; shared memory needs none of this.
        """
        if self._receives_posted:
            return
        self._receives_posted = True
        self._next_post = 0
        if self._mailboxes is None:
            self._post_up_to(self._ahead)

    @property
    def _ahead(self) -> int:
        """How many buckets ahead of the launches the receives are posted: all of them by default."""
        return self.receives_ahead if self.receives_ahead is not None else len(self._buckets)

    def _may_block(self, bucket: GradBucket) -> bool:
        """Whether waiting for `bucket`'s transfer is safe and wanted: a point-to-point send, which completes once
        its owner has posted the receive (at its first gradient, or with `receives_ahead` when it is near that
        bucket, which every rank reaches in the same order); a reduce in two stages across hosts only with
        `receives_ahead` (by default it is waited for at the end of backward: waiting for a send to cross a slow
        link would stall this rank's backward)."""
        if not hasattr(bucket.work, "wait_sent"):
            return False
        return self._two_stage is None or self.receives_ahead is not None

    def _post_up_to(self, end: int) -> None:
        """Posts the receiving side of the point-to-point reduces of the buckets before index `end` not yet posted
        (in bucket order on every rank: the same tags); across hosts, that of their stage 2 (`HierarchicalReduce`)."""
        if self._mailboxes is not None:
            return
        while self._next_post < min(end, len(self._buckets)):
            bucket = self._buckets[self._next_post]
            numel, dtype = bucket.message_spec(self.reduce_fp16, self.find_unused_parameters)
            if self._two_stage is not None:
                key = f"{self._bucket_generation}.{bucket.key}"
                self._two_stage.post(key, numel, dtype, bucket.owner, bucket.params[0].device)
            elif comm.can_post_reduce(bucket.params[0].device, self.process_group):
                bucket.posted = comm.post_reduce(numel, dtype, bucket.owner, self.process_group)
            self._next_post += 1

    def _finish_owned_up_to(self, end: int) -> None:
        """An owner completes its posted reduces of the buckets before index `end` (its receive buffers go back
        to the pool for the next ones). Safe to wait for: every rank has posted its receives of a bucket before it
        launches the one `receives_ahead` earlier, so the rank furthest behind never waits for one ahead of it."""
        while self._next_owned_finish < min(end, self._next_post):
            bucket = self._buckets[self._next_owned_finish]
            posted = bucket.posted is not None or self._two_stage is not None
            if bucket.owner == self.rank and posted and bucket.work is not None and not bucket.finished:
                if self._two_stage is not None:
                    self._two_stage.advance_through(bucket.work)  # (stage 2 in launch order)
                bucket.finish(True, self.world_size, self.find_unused_parameters)
            self._next_owned_finish += 1

    def _launch(self, bucket: GradBucket) -> None:
        self._drop_stale(bucket)
        self._post_up_to(bucket.index + 1 + self._ahead)
        bucket.launch(self.world_size, self._reduce, self.reduce_fp16, self.find_unused_parameters)
        if bucket.owner != self.rank:
            self._sending.append(bucket)
        self._release_sent()
        if self.receives_ahead is not None:
            self._finish_owned_up_to(bucket.index + 1 - self.receives_ahead)
        if bucket.span is not None and bucket is self._bucket_of[bucket.params[0]][-1]:
            self._cut_in_flight.append(bucket.params[0])
            self._let_go_of_cut_grads(in_flight=0 if self._mailboxes is not None else 1)

    def _let_go_of_cut_grads(self, in_flight: int) -> None:
        """Parameters cut into pieces whose pieces have all been launched keep only this rank's piece of their
        gradient (`full_split_grads=False`), the oldest first, until `in_flight` remain: their reduces are waited
        for (on one host the owner added its piece when it launched it; over sockets its senders' pieces have all
        been posted, to receives posted at the first gradient). A reduce in two stages across hosts is left for
        the end of backward."""
        if self._two_stage is not None and in_flight > 0:
            return
        while len(self._cut_in_flight) > in_flight:
            param = self._cut_in_flight.pop(0)
            for bucket in self._bucket_of[param]:
                bucket.finish(bucket.owner == self.rank, self.world_size, self.find_unused_parameters)
            if not self.full_split_grads:
                self._keep_own_piece(param)

    def _keep_own_piece(self, param: nn.Parameter) -> None:
        """Lets `param`'s full-size gradient go, keeping the average on this rank's piece as that piece's own
        gradient: added to the piece's gradient of the last reduce where that is still untouched (a second
        backward without clearing accumulates, as DDP's does), else replacing it."""
        if param.grad is None:
            return
        piece = self._own_piece[param]
        average = param.grad.reshape(-1)[piece.start : piece.end]
        held = piece.tensor.grad if piece.held else None
        if held is not None and self._piece_marks.get(param) == (id(held), held._version):
            held.add_(average)
        else:
            piece.hold(average.clone())
        param.grad = None
        grad = piece.tensor.grad
        self._piece_marks[param] = (id(grad), grad._version)

    def _release_sent(self) -> None:
        """Non-owned buckets whose transfer is done let their gradients go now, not at the end of backward; at
        most `IN_FLIGHT` of them stay in flight (the oldest is waited for), so a rank holds about its own
        gradients plus that many buckets while backward runs (through shared memory a bucket is done as soon as
        it was copied into its mailbox)."""
        keep = self.keep_bucketed_grads
        self._sending = [b for b in self._sending if not b.release(keep)]
        while len(self._sending) > IN_FLIGHT and self._sending[0].release(
            keep, block=self._may_block(self._sending[0])
        ):
            self._sending.pop(0)

    def _reduce(self, message: torch.Tensor, owner: int, key: str) -> object:
        if self._mailboxes is not None:  # one host: through shared memory
            return self._mailboxes.reduce(message, owner, f"{self._bucket_generation}.{key}")
        if self._two_stage is not None:  # several hosts: within each host, then across
            return self._two_stage.reduce(message, owner, f"{self._bucket_generation}.{key}")
        return comm.reduce(message, owner, self.process_group, async_op=True)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        self._reduce_all()

    def _reduce_all(self) -> None:
        self._post_receives()  # after no_sync(), `reduce()` comes without a gradient hook
        for bucket in self._buckets[self._next_bucket :]:
            self._launch(bucket)
        if self._two_stage is not None:
            self._two_stage.finish()
        unused_here = []
        for bucket in self._buckets:
            unused_here += [p for p, used in zip(bucket.params, bucket.used_here, strict=True) if not used]
            owner = bucket.owner == self.rank
            bucket.finish(owner, self.world_size, self.find_unused_parameters, keep_local=self.keep_bucketed_grads)
        self._let_go_of_cut_grads(in_flight=0)
        for bucket in self._buckets:  # once every piece of a split gradient is final
            kind: HeldKind = "average" if bucket.owner == self.rank else "local"
            for p in bucket.params:
                if p.grad is not None and (kind == "average" or bucket.shared):
                    self._held[p] = (id(p.grad), p.grad._version, kind)
            bucket.reset()
        self._next_bucket = 0
        self._next_owned_finish = 0
        self._sending = []
        self._receives_posted = False
        self._unreduced = False
        if unused_here and not self.find_unused_parameters and not self._warned_unused:
            self._warned_unused = True
            warnings.warn(
                f"ShardedDataParallel: {len(unused_here)} parameter(s) got no gradient on rank {self.rank}; they "
                "were averaged as zero from this rank. If some are unused on every rank, pass "
                "find_unused_parameters=True to leave their gradients untouched (as DDP does).",
                stacklevel=2,
            )

    def reduce(self) -> None:
        """Reduces the gradients accumulated under `no_sync()` to their owners.

        Not needed after a normal backward, which reduces by itself: then (nothing accumulated since) it does
        nothing, where reducing again would divide the owners' averages by N once more. A collective: call it on
        every rank, at the same point.
        """
        if self._unreduced:
            self._reduce_all()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside this block accumulate gradients locally, without communication."""
        previous = self._grad_sync_enabled
        self._grad_sync_enabled = False
        try:
            yield
        finally:
            self._grad_sync_enabled = previous

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Clears the module's gradients: zeroes them in place by default (fairscale's default), or sets them to
        None, and those that this rank's pieces of split parameters hold apart. Either way the next backward gives
        each owner exactly DDP's averaged gradient."""
        self.module.zero_grad(set_to_none=set_to_none)
        for piece in self._own_piece.values():
            piece.clear_grad(set_to_none)

    def to(  # type: ignore[override]
        self,
        device: torch.device | str | torch.dtype | None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> ShardedDataParallel:
        """Casts the module's floating-point parameters and buffers to `dtype` and/or moves them to `device` of
        the same device type (another type would strand OSS's state: a `DeviceChangeError`), then rebuilds the gradient
        buckets. A dtype given first (``sdp.to(torch.float64)``) is taken as `dtype`."""
        if isinstance(device, torch.dtype):
            device, dtype = None, device if dtype is None else dtype
        target = torch.device(device) if device is not None else None
        current = {p.device.type for p in self.module.parameters()}
        if target is not None and current and current != {target.type}:
            raise DeviceChangeError(
                f"ShardedDataParallel.to: the parameters are on {', '.join(sorted(current))} and the optimizer state "
                f"follows them; moving to {target.type} is not supported (build the model on that device first)"
            )
        self.module.to(device=target, dtype=dtype, non_blocking=non_blocking)
        self.refresh_trainable()
        return self


ShardedDDP = ShardedDataParallel


_GRAD_REQUIRES_GRAD = (
    "ShardedDataParallel only works with gradients that do not require grad: the .grad of {name} does (set by "
    "hand or by a hook, or made by backward(create_graph=True)); detach it (p.grad = p.grad.detach()) or clear it "
    "before the next forward, and take higher-order gradients outside the wrapper"
)

IN_FLIGHT = 2
"""Non-owned buckets a rank keeps in flight during backward before it waits for the oldest one's transfer."""


def _weakly(owner: weakref.ref, method: str) -> Callable[..., None]:
    """A hook that calls `method` of the wrapper `owner` refers to, while it lives.

    torch keeps a parameter's post-accumulate-grad hooks where Python's cycle collector does not look, so a hook
    holding the wrapper (which holds the parameter) would keep the wrapper, its optimizers and their process group
    alive until the interpreter's teardown, past `destroy_process_group()` and `ddpkit.distributed.launch.leave()`;
    gloo's worker threads then run into the teardown, where one that frees a tensor Python let go of aborts the
    process ("terminate called without an active exception")."""

    def call(*args: Any) -> None:
        wrapper = owner()
        if wrapper is not None:
            getattr(wrapper, method)(*args)

    return call


def _will_accumulate(accumulator: Any) -> bool:
    """Whether the running backward adds to the gradient of the parameter whose AccumulateGrad node is `accumulator`
    (False under ``torch.autograd.grad``, which runs the parameter's hooks but leaves ``.grad`` alone). torch has no
    public way to ask: its private check raises for a parameter under ``autograd.grad``, which is the answer. That
    reading is verified once on a known graph (`_engine_check`); where the check is missing or answers otherwise,
    ShardedDataParallel warns once and takes every backward as accumulating (right for ``backward()``; under
    ``autograd.grad`` through the wrapper, gradients left by the last reduce may then be dropped)."""
    will_execute = _engine_check()
    if will_execute is None:
        return True
    try:
        return bool(will_execute(accumulator))
    except RuntimeError:
        return False


_ENGINE_CHECK: list[Any] = []  # [the verified check, or None], filled at the first use


def _engine_check() -> Any:
    """torch's private ``_will_engine_execute_node`` if it answers as `_will_accumulate` reads it on a leaf of a known
    graph (True under ``backward()``, a RuntimeError under ``autograd.grad``), else None after one warning."""
    if not _ENGINE_CHECK:
        _ENGINE_CHECK.append(_verified_engine_check())
    return _ENGINE_CHECK[0]


def _verified_engine_check() -> Any:
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    answers: list[bool | str] = []
    if will_execute is not None:
        leaf = torch.zeros(1, requires_grad=True)
        with torch.enable_grad():
            node = leaf.view_as(leaf).grad_fn.next_functions[0][0]

            def ask(_: torch.Tensor) -> None:
                try:
                    answers.append(bool(will_execute(node)))
                except RuntimeError:
                    answers.append("raised")

            leaf.register_hook(ask)
            (leaf * 2).sum().backward()
            torch.autograd.grad((leaf * 3).sum(), [leaf])
    if answers == [True, "raised"]:
        return will_execute
    warnings.warn(
        f"ShardedDataParallel: this torch ({torch.__version__}) does not tell whether a backward will accumulate "
        "into .grad (torch._C._will_engine_execute_node is missing or answers otherwise); every backward is taken "
        "as accumulating, so torch.autograd.grad through the wrapper may drop gradients the last reduce left",
        stacklevel=3,
    )
    return None


def _check_optimizers(sharded_optimizer: OSS | AdaScale | list[OSS | AdaScale]) -> list[OSS]:
    """The OSS optimizers (an `AdaScale` wrapping an OSS stands for that OSS)."""
    given = [sharded_optimizer] if not isinstance(sharded_optimizer, list | tuple) else list(sharded_optimizer)
    optimizers = [o.optimizer if isinstance(o, AdaScale) else o for o in given]
    for optimizer, original in zip(optimizers, given, strict=True):
        if not isinstance(optimizer, OSS):
            what = type(optimizer).__name__
            what = f"AdaScale wrapping {what}" if original is not optimizer else what
            raise TypeError(
                "ShardedDataParallel: sharded_optimizer must be a ddpkit.optim.OSS (or an AdaScale wrapping one) or "
                f"a list of them, got {what}; wrap your optimizer: "
                "OSS(model.parameters(), optim=torch.optim.Adam, lr=...)"
            )
    if not optimizers:
        raise ValueError("ShardedDataParallel: sharded_optimizer is an empty list")
    seen: set[torch.Tensor] = set()
    for optimizer in optimizers:
        params = {p for group in optimizer.param_groups for p in group["params"]}
        if params & seen:
            raise ValueError("ShardedDataParallel: the OSS optimizers in sharded_optimizer share parameters")
        seen |= params
    return optimizers


def _check_group(process_group: ProcessGroup | None, optimizers: list[OSS]) -> ProcessGroup:
    group = process_group if process_group is not None else optimizers[0].group
    ranks = _ranks(group)
    for optimizer in optimizers:
        if _ranks(optimizer.group) != ranks:
            raise ValueError(
                "ShardedDataParallel: process_group must contain the same ranks as the OSS optimizers' group "
                f"({_ranks(optimizer.group)}), got {ranks}"
            )
    return group


def _ranks(group: ProcessGroup | None) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _check_compression(compression: str, device_types: set[str]) -> None:
    """`cross_host_compression` must be a known codec, and (other than "none") acts on CPU parameters only: the
    two-stage reduce across hosts runs over gloo on CPU tensors, so on GPUs it would be silently ignored."""
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"ShardedDataParallel: cross_host_compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}"
        )
    if compression != "none" and device_types - {"cpu"}:
        raise ValueError(
            f"ShardedDataParallel: cross_host_compression={compression!r} compresses the CPU (gloo) reduce between "
            f"hosts; the parameters are on {', '.join(sorted(device_types - {'cpu'}))}, where NCCL reduces them "
            "uncompressed: leave it at 'none' (or train on CPUs)"
        )


def _check_one_device_type(module: nn.Module) -> None:
    kinds = sorted({p.device.type for p in module.parameters()})
    if len(kinds) > 1:
        raise ValueError(
            f"ShardedDataParallel: the module's parameters are on several device types ({', '.join(kinds)}); "
            "move the whole model to one device type first (e.g. model.to('cuda'))"
        )


def _warn_unoptimized(module: nn.Module, owner_of: dict[nn.Parameter, int]) -> None:
    missing = [name for name, p in module.named_parameters() if p.requires_grad and p not in owner_of]
    if missing:
        warnings.warn(
            f"ShardedDataParallel: trainable parameters not held by any sharded optimizer are neither reduced nor "
            f"updated: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}",
            stacklevel=3,
        )
