"""Gradient buckets: which gradients travel together to which owner, in which order, while backward runs.

ShardedDataParallel reduces each bucket to its owner (`ddpkit.nn.sharded_ddp`); a fault-tolerant round all-reduces
each one over the round's members, every member its owner (`ddpkit.fault_tolerance.round_buckets`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddpkit.distributed import comm
from ddpkit.distributed.buckets import flatten, views

Reduce = Callable[[torch.Tensor, int, str], object]
"""Starts the async SUM-reduce of a message to an owner: (message, owner, the bucket's key) -> handle to wait for."""


@dataclass
class GradBucket:
    """Gradients of parameters that share an owner, device type and dtype, reduced to the owner as one message.

    With `count_users`, one extra element per parameter carries 1 from each rank that produced its gradient, so
    the owner learns which parameters were unused on every rank.

    A `shared` bucket is one of those that pack small parameters (several, or one where the owner changes): its
    message is always a copy, so the ranks that do not own it keep their own gradient untouched through the
    reduce (`finish(keep_local=True)`). A parameter that travels alone is reduced in place.

    A bucket with a `span` carries elements ``[start, end)`` of its one parameter's flattened gradient: one piece
    of a parameter that OSS cut over the ranks. After the reduce the owner's slice holds the average and the other
    ranks' copy of the slice is zeroed, so each rank's gradient is the average on the slice it owns and zero
    elsewhere (ShardedDataParallel then keeps only the rank's piece, unless `full_split_grads`).
    """

    owner: int
    params: list[torch.nn.Parameter]
    pending: int = 0
    message: torch.Tensor | None = None
    work: object | None = None
    used_here: list[bool] = field(default_factory=list)
    in_place: bool = False
    divide_on_owner: bool = False
    key: str = ""  # names this bucket's message, the same every step (shared-memory mailboxes are kept by it)
    index: int = 0  # its place in the launch order
    posted: comm.PostedReduce | None = None  # this step's reduce with its receiving side posted early, if any
    span: tuple[int, int] | None = None  # a piece of the one parameter's flattened gradient
    shared: bool = False  # packs small parameters: sent as a copy, never in place
    released: bool = False  # a non-owner dropped its gradients already (`release`), before the reduce completed
    finished: bool = False  # `finish` ran already this step (it may run before the end of backward)

    @property
    def numel(self) -> int:
        if self.span is not None:
            return self.span[1] - self.span[0]
        return sum(p.numel() for p in self.params)

    def _grads(self) -> list[torch.Tensor]:
        """The gradients this bucket sends (zeros for a parameter without one), a slice for a piece."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.span is not None:
            grads = [grads[0].reshape(-1)[self.span[0] : self.span[1]]]
        return grads

    def _shapes(self) -> list[torch.Size]:
        if self.span is not None:
            return [torch.Size([self.numel])]
        return [p.shape for p in self.params]

    def reset(self) -> None:
        self.pending = len(self.params)
        self.message = None
        self.work = None
        self.used_here = []
        self.in_place = False
        self.divide_on_owner = False
        self.posted = None
        self.released = False
        self.finished = False

    def message_spec(self, reduce_fp16: bool, count_users: bool) -> tuple[int, torch.dtype]:
        """The element count and dtype `launch` will reduce: known before any gradient exists, so the owner can
        post its receives early (`comm.post_reduce`)."""
        dtype = self.params[0].dtype
        if reduce_fp16 and dtype == torch.float32:
            dtype = torch.float16
        return self.numel + (len(self.params) if count_users else 0), dtype

    def launch(self, world_size: int, reduce: Reduce, reduce_fp16: bool, count_users: bool) -> None:
        """Starts the async reduce of this bucket's (pre-divided) gradients to the owner: through `posted` when
        the reduce was posted ahead, else through `reduce`."""
        self.used_here = [p.grad is not None for p in self.params]
        direct = (
            not self.shared
            and len(self.params) == 1
            and self.used_here[0]
            and self.params[0].grad.is_contiguous()
            and not reduce_fp16
            and not count_users
        )
        self.in_place = direct
        if direct:  # one large gradient (or a piece of one): reduce it in place, no copy
            message = self._grads()[0].view(-1)
        else:
            grads = self._grads()
            if count_users:
                grads.append(torch.tensor(self.used_here, dtype=grads[0].dtype, device=grads[0].device))
            message = flatten(grads)
        # fp32/fp64: only the owner divides, once, instead of every rank dividing what it sends (bit for bit the
        # same when N is a power of two). The sum overflows where the average would not only for gradients within
        # a factor N of the type's largest value (3.4e38 in fp32), which no real gradient nears even under fp16
        # loss scaling (whose overflows happen in fp16, far below). Narrow types are divided before they travel,
        # as DDP does.
        self.divide_on_owner = message.dtype in (torch.float32, torch.float64) and not reduce_fp16
        if not self.divide_on_owner:
            message.div_(world_size)
            if reduce_fp16 and message.dtype == torch.float32:
                message = message.half()
        self.message = message
        self.work = self.posted.start(message) if self.posted is not None else reduce(message, self.owner, self.key)

    def release(self, keep_local: bool, block: bool = False) -> bool:
        """A non-owner's early release, once its part of the reduce no longer needs its data: the gradients are
        dropped as `finish` would drop them (not those a `shared` bucket keeps with `keep_local`) and the message
        is let go. A copied message frees the gradients at once; a message sent in place frees them once its
        transfer is done (at once through shared memory, which copied it). Without `block` it only looks; returns
        whether the transfer is done (the message released)."""
        sent = _sent(self.work, block)
        droppable = self.span is None and not (keep_local and self.shared)  # (a piece's parameter keeps its gradient)
        if droppable and not self.released and (sent or not self.in_place):
            for p in self.params:
                p.grad = None
            self.released = True
        if sent:
            self.message = None  # (the handle keeps what the transfer still needs)
        return sent

    def finish(
        self, is_owner: bool, world_size: int, count_users: bool, keep_local: bool = False
    ) -> list[torch.nn.Parameter]:
        """Waits for the reduce; the owner takes the averaged gradients, others drop theirs (or, for a `shared`
        bucket with `keep_local`, keep their own gradient as it was before the reduce).

        Returns the parameters that received no gradient on any rank (only known with `count_users`); their
        gradients are left as they were, as DDP does. Once per step: a second call (the end of backward after an
        early one) does nothing.
        """
        if self.finished:
            return []
        self.finished = True
        comm.wait_all([self.work])
        unused: list[torch.nn.Parameter] = []
        if not is_owner:
            if (keep_local and self.shared) or self.released:
                return unused
            for p in self.params:
                if self.span is None:
                    p.grad = None
                elif p.grad is not None:
                    _piece_of_grad(p, self.span).zero_()
            return unused
        assert self.message is not None
        if self.divide_on_owner:
            self.message.div_(world_size)
        if self.in_place:
            return unused  # the owner's gradient already holds the average
        shapes = self._shapes()
        if count_users:
            shapes.append(torch.Size([len(self.params)]))
        parts = views(self.message, shapes)
        users = parts[-1].mul(world_size) if count_users else None
        for i, (p, averaged) in enumerate(zip(self.params, parts, strict=False)):
            if users is not None and float(users[i]) < 0.5:
                unused.append(p)
                continue
            if self.span is not None:
                _piece_of_grad(p, self.span).copy_(averaged)
            elif p.grad is None:
                p.grad = averaged.to(p.dtype).clone()
            else:
                p.grad.copy_(averaged)
        return unused


def _sent(work: object, block: bool) -> bool:
    """Whether a reduce's handle no longer needs the sender's tensor (waiting for that with `block`); handles that
    cannot tell (a reduce in two stages across hosts) are done only when the reduce is waited for."""
    if block and hasattr(work, "wait_sent"):
        work.wait_sent()  # type: ignore[attr-defined]
    sent = getattr(work, "sent", None)
    return bool(sent()) if callable(sent) else False


def _piece_of_grad(param: torch.nn.Parameter, span: tuple[int, int]) -> torch.Tensor:
    """A writable view of elements ``[start, end)`` of `param`'s flattened gradient (made zero and contiguous
    first where needed)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    elif not param.grad.is_contiguous():
        param.grad = param.grad.contiguous()
    return param.grad.view(-1)[span[0] : span[1]]


ALONE_NUMEL = 2**18
"""Gradients of at least this many elements (1 MiB in fp32) are reduced alone and in place: bucketing only saves
per-message latency, which is negligible at that size, while copying into a bucket costs a pass over the data."""


Spans = dict[torch.nn.Parameter, list[tuple[int, int, int]]]
"""Per parameter cut into pieces: (owner, start, end) of each piece."""


def build_buckets(
    params: list[torch.nn.Parameter],
    owner_of: dict[torch.nn.Parameter, int],
    max_numel: int,
    pieces: Spans | None = None,
) -> list[GradBucket]:
    """Packs `params` (in the order their gradients are expected) into buckets of at most `max_numel` elements.

    A bucket holds a run of *consecutive* parameters with the same owner, device type and dtype, so it is complete
    as soon as backward has passed them and its reduce overlaps the rest of backward (a bucket gathering one
    owner's parameters from the whole model would only be ready at the end). Parameters of at least
    ``min(max_numel, ALONE_NUMEL)`` elements (all of them when `max_numel` is 0) travel alone, reduced in place.
    A parameter in `pieces` travels as one bucket per piece, each to that piece's owner, in place.
    The list order is the launch order on every rank.
    """
    pieces = pieces or {}
    buckets: list[GradBucket] = []
    current: GradBucket | None = None
    current_key: tuple[int, str, torch.dtype] | None = None
    for p in params:
        if p in pieces:
            buckets += [GradBucket(owner, [p], span=(start, end)) for owner, start, end in pieces[p]]
            current, current_key = None, None
            continue
        key = (owner_of[p], p.device.type, p.dtype)
        alone = max_numel == 0 or p.numel() >= min(max_numel, ALONE_NUMEL)
        if alone or key != current_key or current is None or current.numel + p.numel() > max_numel:
            current = GradBucket(key[0], [], shared=not alone)
            buckets.append(current)
            current_key = None if alone else key
        current.params.append(p)
    for index, bucket in enumerate(buckets):
        bucket.key, bucket.index = str(index), index
        bucket.reset()
    return buckets
