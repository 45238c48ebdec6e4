"""The mean of a flat fp32 tensor over a group, sent quantised (`ddpkit.algorithms.quantize`), ring-like traffic.

Algorithm, for N ranks and a tensor of n values:

1. the tensor is cut into N chunks on block boundaries (`chunk_bounds`: the blocks dealt out as evenly as
   possible, the first chunks one block longer when N does not divide the number of blocks); chunk j belongs to
   rank j (its owner);
2. every rank quantises each of its chunks and sends chunk j to rank j, in one all-to-all (payload + scales, one
   uint8 message per chunk; its own chunk stays local);
3. the owner dequantises the N messages of its chunk, sums them in fp32 in rank order, divides by N and
   quantises the mean again;
4. the owners' quantised chunks are all-gathered (an all-to-all in which each owner sends its chunk to every
   other rank), and every rank dequantises them: every rank ends with the same bits.

Communicated, per rank, with Q the quantised bytes of the whole tensor and q the bytes of this rank's chunk:
``Q - q`` in step 2 (recorded in `comm_stats` as kind ``all_to_all``, payload Q) and ``(N - 1) q`` in step 4
(kind ``all_gather``, payload q), ``Q + (N - 2) q`` in all: exactly ``2 (N - 1) / N Q``, what a ring all-reduce
sends of Q, when N divides the number of blocks, and otherwise at most one block's bytes times ``N - 2`` more
on the ranks that own a longer chunk (the sum over ranks is always ``2 (N - 1) Q``). Every compression, "none"
(fp32) included, takes this same path, so its sum is the same rank-ordered one on every rank and in
`simulate_compressed_mean`. The bytes are counted when a mean is started, in the caller's thread. CUDA tensors
on gloo go through host copies (counted as ``cpu_staging``); NCCL takes them as they are.

Memory: the quantised messages (about Q on each side of each exchange, N q for the all-gather's send buffer),
one fp32 chunk for the owner's sum and the fp32 result (n values).

`start_compressed_mean` returns at once with a `PendingMean`; the exchange is a job of
`ddpkit.distributed.background` on the channel of the group's ranks (a process group of its own, with the
parent's timeout): on gloo a worker thread runs the started means one after the other, in the order they were
started (the same order on every rank, as for any collective); on NCCL the exchange is enqueued on the caller's
thread and streams (no second thread issues NCCL calls). So a mean in flight never interleaves with the
collectives the caller keeps issuing on its own groups. `compressed_mean` starts one and waits for it.
`simulate_compressed_mean` computes, in one process, the very result N ranks get, bit for bit.

The ranks may also be a fault-tolerant round's members (`start_mean_on` with a `MeanWay` over
`ddpkit.fault_tolerance.round_channel.RoundChannel`: the exchange runs at once on the caller's thread), where a
member that just joined takes part without counting: the owners sum only the counted ranks' messages and divide
by their number.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ddpkit.algorithms.quantize import Quantized, check_compression, dequantize, from_bytes, quantize, to_bytes
from ddpkit.distributed.background import BackgroundChannel, channel_for
from ddpkit.distributed.env import ProcessGroup, group_label, group_rank, group_size
from ddpkit.distributed.stats import comm_stats


def chunk_bounds(numel: int, parts: int, block: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of each of `parts` chunks of `numel` values, cut on multiples of `block`."""
    blocks = -(-numel // block)
    base, extra = divmod(blocks, parts)
    bounds, start = [], 0
    for j in range(parts):
        stop = min(numel, start + (base + (j < extra)) * block)
        bounds.append((start, stop))
        start = stop
    return bounds


def _owner_mean(
    messages: list[Quantized], compression: str, block: int, counted: list[bool] | None = None
) -> Quantized:
    """What an owner computes from the N messages of its chunk: the fp32 mean (rank order) of those whose rank
    is `counted` (None: all), quantised."""
    kept = messages if counted is None else [m for m, c in zip(messages, counted, strict=True) if c]
    if not kept:
        raise ValueError("compressed mean: no rank counts (counted is all False)")
    total = dequantize(kept[0])
    for message in kept[1:]:
        total += dequantize(message)
    return quantize(total.div_(len(kept)), compression, block)


def simulate_messages(
    inputs: list[torch.Tensor], compression: str, block: int
) -> tuple[list[list[Quantized]], list[Quantized]]:
    """The messages of a mean over ``len(inputs)`` ranks: ``sent[r][j]`` (rank r's chunk j) and ``owners[j]``."""
    check_compression(compression, block)
    bounds = chunk_bounds(inputs[0].numel(), len(inputs), block)
    sent = [[quantize(x[a:b], compression, block) for a, b in bounds] for x in inputs]
    owners = [_owner_mean([s[j] for s in sent], compression, block) for j in range(len(inputs))]
    return sent, owners


def simulate_compressed_mean(inputs: list[torch.Tensor], compression: str, block: int) -> torch.Tensor:
    """The result every rank of `compressed_mean` gets when rank r holds ``inputs[r]``, bit for bit."""
    _, owners = simulate_messages(inputs, compression, block)
    return torch.cat([dequantize(q) for q in owners])


class PendingMean:
    """A mean started by `start_compressed_mean`; `wait()` returns it (fp32, on the input's device).

    `sent` holds the quantised chunks this rank sent (dequantised by `sent_values()`: what error feedback needs),
    `owner` this rank's quantised mean chunk once the mean is done.
    """

    def __init__(self, sent: list[Quantized], device: torch.device) -> None:
        self.sent, self.device = sent, device
        self.owner: Quantized | None = None
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    def sent_values(self) -> torch.Tensor:
        """The fp32 values this rank's messages stand for (the input, as quantised)."""
        return torch.cat([dequantize(q) for q in self.sent])

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> torch.Tensor:
        """Blocks until the mean has arrived and returns it; raises what the exchange raised, if it failed."""
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"compressed mean failed: {self._error}") from self._error
        assert self._result is not None
        return self._result

    def _finish(self, owner: Quantized | None, result: torch.Tensor | None, error: BaseException | None) -> None:
        self.owner, self._result, self._error = owner, result, error
        self._done.set()


def _check_flat(flat: torch.Tensor) -> None:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.float32:
        got = f"{flat.dim()}-D {flat.dtype}" if isinstance(flat, torch.Tensor) else type(flat).__name__
        raise ValueError(f"compressed mean: flat must be a 1-D float32 tensor, got {got}")


def start_compressed_mean(flat: torch.Tensor, group: ProcessGroup | None, compression: str, block: int) -> PendingMean:
    """Starts the mean of `flat` over `group` (see the module doc) and returns at once.

    `flat` is quantised before this returns, so the caller may change it right away. Every rank of `group` must
    start the same means, with the same sizes and settings, in the same order.
    """
    check_compression(compression, block)
    n, me = group_size(group), group_rank(group)
    if me < 0:
        raise ValueError("compressed mean: this rank is not in `group`")
    return start_mean_on(flat, MeanWay(n, me, group_label(group), lambda: channel_for(group)), compression, block)


class MeanWay:
    """Where a mean travels: `size` ranks, this one `rank` among them, the `label` its bytes are counted under
    in `comm_stats`, and `channel()`, the channel its job runs on (made when first needed: a mean over one rank
    sends nothing). `counted`: per rank, whether its input counts in the mean (None: every rank's does); a rank
    that does not count still takes part in the exchange (its messages are ignored) and receives the mean.

    A job's group is one of the job (`channel_for`) or a fault-tolerant round's (`ddpkit.distributed.
    round_channel.RoundChannel`, whose jobs run at once on the caller's thread)."""

    def __init__(
        self, size: int, rank: int, label: str, channel: Callable[[], Any], counted: list[bool] | None = None
    ) -> None:
        if counted is not None and len(counted) != size:
            raise ValueError(f"compressed mean: counted has {len(counted)} entries for {size} ranks")
        self.size, self.rank, self.label, self.channel, self.counted = size, rank, label, channel, counted


def start_mean_on(flat: torch.Tensor, way: MeanWay, compression: str, block: int) -> PendingMean:
    """`start_compressed_mean` over the ranks `way` names (the same rules)."""
    check_compression(compression, block)
    _check_flat(flat)
    n, me = way.size, way.rank
    bounds = chunk_bounds(flat.numel(), n, block)
    pending = PendingMean([quantize(flat[a:b], compression, block) for a, b in bounds], flat.device)
    if n == 1:
        owner = _owner_mean(pending.sent, compression, block, way.counted)
        pending._finish(owner, dequantize(owner), None)
        return pending
    sizes = [q.nbytes() for q in pending.sent]
    comm_stats.record("all_to_all", way.label, sum(sizes), float(sum(sizes) - sizes[me]))
    comm_stats.record("all_gather", way.label, sizes[me], float((n - 1) * sizes[me]))
    way.channel().submit(_Job(pending, bounds, sizes, (compression, block, way.label, way.counted)))
    return pending


def compressed_mean(flat: torch.Tensor, group: ProcessGroup | None, compression: str, block: int) -> torch.Tensor:
    """The mean of `flat` over `group`, sent quantised; the same bits on every rank (see the module doc)."""
    return start_compressed_mean(flat, group, compression, block).wait()


class _Job:
    """One started mean, as the worker thread runs it on the channel."""

    def __init__(self, pending: PendingMean, bounds: list[tuple[int, int]], sizes: list[int], settings: tuple) -> None:
        self.pending, self.bounds, self.sizes = pending, bounds, sizes
        self.compression, self.block, self.label, self.counted = settings
        self.event = torch.cuda.Event() if pending.device.type == "cuda" else None
        if self.event is not None:
            self.event.record()  # the quantisation queued on the caller's stream

    def __call__(self, channel: BackgroundChannel) -> None:
        try:
            on_thread = self.event is not None and channel.threaded  # a CUDA tensor staged through gloo's thread
            if on_thread:
                torch.cuda.set_device(self.pending.device)
                torch.cuda.current_stream().wait_event(self.event)
            owner, result = self._exchange(channel)
            if on_thread:
                torch.cuda.current_stream().synchronize()  # the worker's own wait: the caller's stream runs on
            self.pending._finish(owner, result, None)
        except BaseException as error:  # handed to the caller's wait()
            self.pending._finish(None, None, error)

    def _transport(self, channel: BackgroundChannel, send: torch.Tensor, out_sizes: list[int], in_sizes: list[int]):
        """One all-to-all of uint8 messages, through host copies for CUDA tensors on gloo."""
        staged = send.device.type == "cuda" and channel.gloo
        if staged:
            send = send.cpu()
            comm_stats.record("cpu_staging", self.label, send.numel(), 0.0)
        recv = torch.empty(sum(out_sizes), dtype=torch.uint8, device=send.device)
        channel.all_to_all(recv, send, out_sizes, in_sizes)
        if staged:
            comm_stats.record("cpu_staging", self.label, recv.numel(), 0.0)
            recv = recv.to(self.pending.device)
        return recv.split(out_sizes)

    def _exchange(self, channel: BackgroundChannel) -> tuple[Quantized, torch.Tensor]:
        n, me, sizes = channel.size, channel.rank, self.sizes
        numels = [b - a for a, b in self.bounds]
        send = torch.cat([to_bytes(q) for q in self.pending.sent])
        mine = self._transport(channel, send, [sizes[me]] * n, sizes)
        received = [from_bytes(m, numels[me], self.compression, self.block) for m in mine]
        owner = _owner_mean(received, self.compression, self.block, self.counted)
        gathered = self._transport(channel, to_bytes(owner).repeat(n), sizes, [sizes[me]] * n)
        chunks = [from_bytes(m, k, self.compression, self.block) for m, k in zip(gathered, numels, strict=True)]
        return owner, torch.cat([dequantize(q) for q in chunks])
