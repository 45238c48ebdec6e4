"""The collectives ddpkit uses, each recorded in `comm_stats`.

Ranks given to these functions (`src`, `dst`) are ranks *inside* `group`, which is what every caller in ddpkit
thinks in (the owner of a shard is a rank of the optimizer's group). They are translated to the global ranks
torch expects. With ``async_op=True`` a work handle is returned (``.wait()``); the bytes are counted when the
collective is issued.

`reduce` on gloo is done here, point to point: gloo's own reduce sends more than the least possible,
each rank's tensor sent to the root once, (N-1) x the tensor in all, which is what this one sends on the wire
(`tests/test_wire_bytes.py`). With it, a reduce to the owner plus a broadcast from the owner (sharded data
parallelism) puts exactly the bytes of DDP's ring all-reduce on the wire. The root receives into CPU buffers
it keeps for the next reduce of the same shape (`_ScratchPool`): a new buffer of many megabytes per reduce costs
a page fault per 4 KiB on first touch, which can take longer than the transfer itself.

Receives are posted before the data they wait for where the order of a step allows (`post_reduce`,
`broadcast_many`): gloo's TCP point-to-point is a rendezvous whose ready notice travels behind the receiver's own
outgoing data on the same connection, so a receive posted late holds the other direction of the link
(`ddpkit.nn.sharded_ddp`).

CUDA tensors on gloo are staged through host memory here, by ddpkit, for every collective (`_HostStaging`): gloo's
point-to-point send and receive hand the tensor's raw pointer to a socket, which is only valid for host memory;
torch's gloo backend stages CUDA tensors itself for some collectives (all-reduce, broadcast, reduce, all-gather,
gather, scatter, all-to-all in the sources read) but not for others (reduce-scatter, coalesced all-reduce), and
this differs between versions (`benchmarks/gloo_cuda_probe.py` tells for the torch at hand). Each rank copies its CUDA
input into a pinned host tensor (a synchronous copy: it waits for the work queued on the current stream that
produces the tensor), runs the CPU code path above on the host copies, and copies the results back to the GPU
when the collective is waited for (for a DDP hook's future: when it completes, so backward overlaps the transfer),
synchronously too, so they are in place for every stream once `wait()`
returns. Only what a rank needs crosses the PCIe bus: a broadcast's source copies out, its receivers copy in; a
reduce's senders copy out, its root copies out and back; the sum is done on the host, in rank order, as on CPU.
Each copy is counted in `comm_stats` as kind ``cpu_staging`` (its bytes as payload, 0 on the wire). NCCL takes
CUDA tensors directly and stages nothing.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, defaultdict

import torch
import torch.distributed as dist

from ddpkit.distributed.env import ProcessGroup, backend_name, global_rank, group_label, group_rank, group_size
from ddpkit.distributed.stats import comm_stats, wire_bytes

Work = object  # torch's work handle (torch.distributed.Work), kept opaque


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes of `tensor`'s elements (what a collective on it carries)."""
    return tensor.numel() * tensor.element_size()


def _record(
    kind: str, group: ProcessGroup | None, payload: int, is_root: bool = False, sent: float | None = None
) -> None:
    n = group_size(group)
    comm_stats.record(
        kind, group_label(group), payload, wire_bytes(kind, payload, n, is_root) if sent is None else sent
    )


_p2p_tags: dict[str, itertools.count] = defaultdict(itertools.count)


def next_p2p_tag(group: ProcessGroup | None) -> int:
    """The tag of the next point-to-point exchange on `group`: every rank issues them in the same order."""
    return next(_p2p_tags[group_label(group)]) % (2**31 - 1)


class _ScratchPool:
    """Receive buffers kept for reuse, per (shape, dtype), on CPU only (CUDA's caching allocator already reuses).

    Small tensors are not kept (allocating them is cheap), nor more than `MAX_SHAPES` shapes (least recently used
    dropped first), so the pool holds at most what the reduces of the most recent shapes had in flight at once.
    """

    MIN_NUMEL = 2**16
    MAX_SHAPES = 64

    def __init__(self) -> None:
        self._free: OrderedDict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = OrderedDict()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.shape, like.dtype)
        if like.device.type == "cpu" and self._free.get(key):
            self._free.move_to_end(key)
            return self._free[key].pop()
        return torch.empty_like(like, memory_format=torch.contiguous_format)

    def give(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or tensor.numel() < self.MIN_NUMEL:
            return
        key = (tensor.shape, tensor.dtype)
        self._free.setdefault(key, []).append(tensor)
        self._free.move_to_end(key)
        while len(self._free) > self.MAX_SHAPES:
            self._free.popitem(last=False)


_scratch = _ScratchPool()


class _PointToPointWorks:
    """Pending point-to-point sends and receives that `wait()` completes together (an async collective's handle)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def sent(self) -> bool:
        """A sender's view, without waiting: whether every transfer is done (gloo's point-to-point handles say so
        only once waited for). Done, the handles are let go (gloo's keep the tensor they sent alive), so the
        sender's tensor may be freed."""
        if all(work.is_completed() for work in self.works):
            self.works = []
        return not self.works

    def wait_sent(self) -> None:
        """A sender's view: waits until every transfer is done (`sent`)."""
        self.wait()
        self.works = []


class _PointToPointReduce(_PointToPointWorks):
    """The pending sends (non-roots) or receives (root) of a point-to-point reduce; `wait()` sums on the root."""

    def __init__(self, tensor: torch.Tensor, works: list, received: list[torch.Tensor]) -> None:
        super().__init__(works)
        self.tensor, self.received = tensor, received

    def sent(self) -> bool:
        done = super().sent()
        if done and not self.received:
            self.tensor = None  # type: ignore[assignment]  (a sender's tensor: not needed any more)
        return done

    def wait_sent(self) -> None:
        super().wait_sent()
        if not self.received:
            self.tensor = None  # type: ignore[assignment]

    def wait(self) -> bool:
        super().wait()
        for part in self.received:  # in rank order: the same sum on every run
            self.tensor.add_(part)
            _scratch.give(part)
        self.received = []
        return True


def _reduce_point_to_point(tensor: torch.Tensor, dst: int, group: ProcessGroup | None) -> _PointToPointReduce:
    """Every non-root sends its tensor to `dst` once; `dst` receives and adds them (SUM)."""
    tag = next_p2p_tag(group)
    me, n = group_rank(group), group_size(group)
    if me != dst:
        _record("reduce", group, nbytes(tensor), sent=float(nbytes(tensor)))
        return _PointToPointReduce(tensor, [dist.isend(tensor, global_rank(group, dst), group=group, tag=tag)], [])
    _record("reduce", group, nbytes(tensor), sent=0.0)
    received = [_scratch.take(tensor) for _ in range(n - 1)]
    sources = [r for r in range(n) if r != me]
    works = [
        dist.irecv(buf, global_rank(group, r), group=group, tag=tag) for r, buf in zip(sources, received, strict=True)
    ]
    return _PointToPointReduce(tensor, works, received)


def _broadcast_point_to_point(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> _PointToPointWorks:
    """`src` sends its tensor to every other rank once; the others receive it in place."""
    tag = next_p2p_tag(group)
    me, n, size = group_rank(group), group_size(group), nbytes(tensor)
    if me == src:
        _record("broadcast", group, size, sent=float((n - 1) * size))
        peers = [r for r in range(n) if r != me]
        return _PointToPointWorks([dist.isend(tensor, global_rank(group, r), group=group, tag=tag) for r in peers])
    _record("broadcast", group, size, sent=0.0)
    return _PointToPointWorks([dist.irecv(tensor, global_rank(group, src), group=group, tag=tag)])


class PostedReduce:
    """A point-to-point SUM reduce of a message of known size whose receiving side is posted before the data exists.

    Every rank creates it at the same point, in the same order (it takes the group's next tag); the root posts
    its receives at once, so their ready notices leave before the rank's own outgoing data queues up behind them
    (see `post_reduce`). Later `start(tensor)` sends `tensor` (non-roots) or returns the handle whose `wait()`
    adds the received messages into `tensor` in rank order (root): the same sum, bytes and count as `reduce`.
    """

    def __init__(self, numel: int, dtype: torch.dtype, dst: int, group: ProcessGroup | None) -> None:
        self.numel, self.dtype, self.dst, self.group = numel, dtype, dst, group
        self.tag = next_p2p_tag(group)
        self.received: list[torch.Tensor] = []
        self.works: list = []
        me = group_rank(group)
        if me == dst:
            like = torch.empty(1, dtype=dtype).expand(numel)  # shape and dtype only, for the scratch pool
            self.received = [_scratch.take(like) for _ in range(group_size(group) - 1)]
            sources = [r for r in range(group_size(group)) if r != me]
            self.works = [
                dist.irecv(buf, global_rank(group, r), group=group, tag=self.tag)
                for r, buf in zip(sources, self.received, strict=True)
            ]

    def start(self, tensor: torch.Tensor) -> _PointToPointReduce:
        """Sends `tensor` to the root, or (root) returns the pending sum into `tensor`; call once."""
        if tensor.numel() != self.numel or tensor.dtype != self.dtype or not tensor.is_contiguous():
            raise ValueError(
                f"PostedReduce.start: expected a contiguous tensor of {self.numel} {self.dtype} elements (as "
                f"posted), got {tensor.numel()} {tensor.dtype} elements (contiguous: {tensor.is_contiguous()})"
            )
        flat = tensor.view(-1)
        if group_rank(self.group) != self.dst:
            _record("reduce", self.group, nbytes(flat), sent=float(nbytes(flat)))
            send = dist.isend(flat, global_rank(self.group, self.dst), group=self.group, tag=self.tag)
            return _PointToPointReduce(flat, [send], [])
        _record("reduce", self.group, nbytes(flat), sent=0.0)
        pending = _PointToPointReduce(flat, self.works, self.received)
        self.works, self.received = [], []
        return pending


def can_post_reduce(device: torch.device, group: ProcessGroup | None) -> bool:
    """Whether `post_reduce` applies: CPU messages on a gloo group of two or more ranks."""
    return device.type == "cpu" and group_size(group) > 1 and _is_gloo(group) and not _STAGE_CPU_TENSORS


def post_reduce(numel: int, dtype: torch.dtype, dst: int, group: ProcessGroup | None) -> PostedReduce:
    """Posts the receiving side of a later SUM reduce to `dst` of a CPU message of `numel` `dtype` elements.

    Why: gloo's TCP point-to-point is a rendezvous: a send starts when the receiver's ready notice arrives, and
    that notice travels on the same ordered connection as the receiver's own outgoing data. A root that posts its
    receive only when it has its own message ready (ShardedDataParallel's owners, at their own bucket) posts it
    while its earlier outgoing buckets stream, so the data coming the other way waits for them and the link is
    used one direction at a time. Posting every receive at the start of backward sends the notices first.
    Collective in order: every rank of `group` calls it at the same point (`can_post_reduce` must hold).
    """
    return PostedReduce(numel, dtype, dst, group)


def broadcast_many(pairs: list[tuple[torch.Tensor, int]], group: ProcessGroup | None = None) -> list[Work | None]:
    """Starts the broadcast of each ``(tensor, src)`` (as `broadcast`, async) with every receive posted first.

    On gloo the point-to-point broadcasts of contiguous CPU tensors take their tags in list order (the same on
    every rank), then this rank posts all its receives, then all its sends: its ready notices leave ahead of its
    own outgoing data (see `post_reduce`), so broadcasts from different roots flow both ways at once. Other
    tensors go through `broadcast` in list order. Same bytes and counts as calling `broadcast` on each.
    """
    works: list[Work | None] = []
    sends: list[tuple[torch.Tensor, int]] = []
    me, n = group_rank(group), group_size(group)
    for tensor, src in pairs:
        if n < 2 or not tensor.is_contiguous() or not _is_gloo(group) or _staged([tensor], group):
            works.append(broadcast(tensor, src, group, async_op=True))
            continue
        tag = next_p2p_tag(group)
        size = nbytes(tensor)
        if me == src:
            _record("broadcast", group, size, sent=float((n - 1) * size))
            sends.append((tensor, tag))
        else:
            _record("broadcast", group, size, sent=0.0)
            works.append(_PointToPointWorks([dist.irecv(tensor, global_rank(group, src), group=group, tag=tag)]))
    peers = [r for r in range(n) if r != me]
    for tensor, tag in sends:
        works.append(
            _PointToPointWorks([dist.isend(tensor, global_rank(group, r), group=group, tag=tag) for r in peers])
        )
    return works


def _is_gloo(group: ProcessGroup | None, device_type: str = "cpu") -> bool:
    return backend_name(group, device_type) == "gloo"


_STAGE_CPU_TENSORS = False
"""Tests only: stage CPU tensors too (through unpinned host copies), to exercise the staging path without a GPU."""


def _staged(tensors: list[torch.Tensor], group: ProcessGroup | None) -> bool:
    """Whether a collective on `tensors` over `group` goes through host copies (CUDA tensors on gloo)."""
    if not tensors or any(getattr(t, "_ddpkit_host_copy", False) for t in tensors) or group_size(group) < 2:
        return False
    devices = {t.device.type for t in tensors}
    if _STAGE_CPU_TENSORS:
        return _is_gloo(group)
    return any(d != "cpu" and _is_gloo(group, d) for d in devices)


class _HostStaging:
    """Host copies of device tensors for one gloo collective, and the copies back that `finish()` makes."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()

    def host(self, tensor: torch.Tensor, copy_in: bool = True, copy_back: bool = False) -> torch.Tensor:
        """A contiguous host tensor like `tensor` (pinned for CUDA), holding its values when `copy_in`."""
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
        out._ddpkit_host_copy = True  # type: ignore[attr-defined]
        if copy_in:
            out.copy_(tensor)  # waits for the current stream's work on `tensor`
            self._count(out)
        if copy_back:
            self._back.append((tensor, out))
        return out

    def finish(self) -> None:
        """Copies every result back to its device tensor, synchronously: once this returns, any stream sees it.
        Once only, whichever thread calls it first (the caller's `wait`, or a future's callback)."""
        with self._lock:
            back, self._back = self._back, []
        for tensor, host in back:
            tensor.copy_(host)
            self._count(host)

    def _count(self, host: torch.Tensor) -> None:
        _record("cpu_staging", self.group, nbytes(host), sent=0.0)


class _StagedWork:
    """An async collective on host copies: `wait()` waits for it, then copies the results back to the device.

    `get_future()` (what a DDP communication hook returns) returns at once: its future completes when the
    collective has and the results are copied back (by the callback, synchronously, so they are in place on every
    stream), so backward goes on computing while the bucket travels.
    """

    def __init__(self, work: Work | None, staging: _HostStaging, outputs: list[torch.Tensor]) -> None:
        self.work, self.staging, self.outputs = work, staging, outputs
        self._future: torch.futures.Future | None = None

    def wait(self) -> bool:
        if self._future is not None:
            self._future.wait()
            return True
        if self.work is not None:
            self.work.wait()  # type: ignore[attr-defined]
            self.work = None
        self.staging.finish()
        return True

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            if self.work is None:
                self.staging.finish()
                self._future = torch.futures.Future()
                self._future.set_result(self.outputs)
            else:
                work, self.work = self.work, None

                def copy_back(_: torch.futures.Future) -> list[torch.Tensor]:
                    self.staging.finish()
                    return self.outputs

                self._future = work.get_future().then(copy_back)  # type: ignore[attr-defined]
        return self._future


def _finish_staged(
    work: Work | None, staging: _HostStaging, async_op: bool, outputs: list[torch.Tensor]
) -> Work | None:
    pending = _StagedWork(work, staging, outputs)
    if async_op:
        return pending
    pending.wait()
    return None


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Sends `tensor` from group rank `src` to every rank of `group` (in place on receivers); counted.

    On gloo a contiguous tensor goes point to point: gloo runs a process group's collectives one after the other,
    so broadcasts from different roots issued together (OSS's shards, SlowMo's slices) would take turns on the link.

    Args:
        tensor: what `src` sends and the others receive into.
        src: the sending rank.
        group: the process group (None: the default group); ranks are ranks inside it.
        async_op: return the pending work to wait for instead of waiting.

    Returns:
        The pending work with `async_op`, else None.
    """
    if _staged([tensor], group):
        staging = _HostStaging(group)
        is_src = group_rank(group) == src
        host = staging.host(tensor, copy_in=is_src, copy_back=not is_src)
        return _finish_staged(broadcast(host, src, group, async_op=True), staging, async_op, [tensor])
    if group_size(group) > 1 and tensor.is_contiguous() and _is_gloo(group):
        pending = _broadcast_point_to_point(tensor, src, group)
        if async_op:
            return pending
        pending.wait()
        return None
    _record("broadcast", group, nbytes(tensor))
    return dist.broadcast(tensor, global_rank(group, src), group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    group: ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Work | None:
    """Reduces `tensor` from every rank into group rank `dst` (only `dst`'s tensor holds the result); counted.

    On gloo a SUM goes point to point (see the module doc); other tensors must not be changed until it is waited for.

    Args:
        tensor: each rank's contribution; on `dst`, the result.
        dst: the rank that receives the result.
        group: the process group (None: the default group); ranks are ranks inside it.
        op: the reduction (``torch.distributed.ReduceOp``; default SUM).
        async_op: return the pending work to wait for instead of waiting.

    Returns:
        The pending work with `async_op`, else None.
    """
    if _staged([tensor], group):
        staging = _HostStaging(group)
        host = staging.host(tensor, copy_back=group_rank(group) == dst)
        return _finish_staged(reduce(host, dst, group, op, async_op=True), staging, async_op, [tensor])
    if op == dist.ReduceOp.SUM and group_size(group) > 1 and _is_gloo(group):
        pending = _reduce_point_to_point(tensor.view(-1) if tensor.is_contiguous() else tensor, dst, group)
        if async_op:
            return pending
        pending.wait()
        return None
    _record("reduce", group, nbytes(tensor))
    return dist.reduce(tensor, global_rank(group, dst), op=op, group=group, async_op=async_op)


def reduce_collective(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None) -> Work:
    """Starts a SUM reduce of `tensor` into group rank `dst` as one backend collective, counted: unlike `reduce`,
    its handle has ``get_future()`` (what a DDP communication hook returns). Non-root tensors may be overwritten."""
    _record("reduce", group, nbytes(tensor), is_root=group_rank(group) == dst)
    work = dist.reduce(tensor, global_rank(group, dst), op=dist.ReduceOp.SUM, group=group, async_op=True)
    assert work is not None
    return work


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Work | None:
    """Reduces `tensor` over `group` into every rank's copy; counted.

    Args:
        tensor: each rank's contribution, replaced by the result.
        group: the process group (None: the default group); ranks are ranks inside it.
        op: the reduction (``torch.distributed.ReduceOp``; default SUM).
        async_op: return the pending work to wait for instead of waiting.

    Returns:
        The pending work with `async_op`, else None.
    """
    if _staged([tensor], group):
        staging = _HostStaging(group)
        host = staging.host(tensor, copy_back=True)
        return _finish_staged(all_reduce(host, group, op, async_op=True), staging, async_op, [tensor])
    _record("all_reduce", group, nbytes(tensor))
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(
    outputs: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Gathers every rank's `tensor` into `outputs` on every rank; counted.

    Args:
        outputs: one tensor per rank, in rank order, filled with that rank's `tensor`.
        tensor: this rank's contribution.
        group: the process group (None: the default group); ranks are ranks inside it.
        async_op: return the pending work to wait for instead of waiting.

    Returns:
        The pending work with `async_op`, else None.
    """
    if _staged([tensor, *outputs], group):
        staging = _HostStaging(group)
        host_outputs = [staging.host(t, copy_in=False, copy_back=True) for t in outputs]
        work = all_gather(host_outputs, staging.host(tensor), group, True)
        return _finish_staged(work, staging, async_op, outputs)
    _record("all_gather", group, nbytes(tensor))
    return dist.all_gather(outputs, tensor, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    inputs: list[torch.Tensor],
    group: ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Work | None:
    """Reduces `inputs[i]` over the group into rank i's `output`; counted.

    Args:
        output: this rank's share of the result.
        inputs: one tensor per rank, in rank order: what this rank contributes to each rank's share.
        group: the process group (None: the default group); ranks are ranks inside it.
        op: the reduction (``torch.distributed.ReduceOp``; default SUM).
        async_op: return the pending work to wait for instead of waiting.

    Returns:
        The pending work with `async_op`, else None.
    """
    if _staged([output, *inputs], group):
        staging = _HostStaging(group)
        host_output = staging.host(output, copy_in=False, copy_back=True)
        work = reduce_scatter(host_output, [staging.host(t) for t in inputs], group, op, async_op=True)
        return _finish_staged(work, staging, async_op, [output])
    _record("reduce_scatter", group, sum(nbytes(t) for t in inputs))
    return dist.reduce_scatter(output, inputs, op=op, group=group, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    outputs: list[torch.Tensor] | None,
    dst: int,
    group: ProcessGroup | None = None,
    is_root: bool = False,
) -> None:
    """Gathers every rank's `tensor` into `outputs` on group rank `dst` (None elsewhere)."""
    if _staged([tensor, *(outputs or [])], group):
        staging = _HostStaging(group)
        host_outputs = [staging.host(t, copy_in=False, copy_back=True) for t in outputs] if outputs else None
        gather(staging.host(tensor), host_outputs, dst, group, is_root)
        staging.finish()
        return
    _record("gather", group, nbytes(tensor), is_root=is_root)
    dist.gather(tensor, outputs, dst=global_rank(group, dst), group=group)


def barrier(group: ProcessGroup | None = None) -> None:
    """Returns once every rank of `group` has called it (counted, with no payload)."""
    _record("barrier", group, 0)
    dist.barrier(group=group)


def wait_all(works: list[Work | None]) -> None:
    """Waits for every async collective in `works` (None entries are skipped)."""
    for work in works:
        if work is not None:
            work.wait()  # type: ignore[attr-defined]
