"""The mean of a flat fp32 tensor over a group, sent quantised (`ddpkit.distributed.quantize`), ring-like traffic.

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

`start_compressed_mean` returns at once with a `PendingMean`; the exchange runs on a process group of the same
ranks made for it by its members alone at their first mean (`_Channel`; with the parent's timeout), by one
worker thread per group of ranks, which runs the started means one after the other, in the order they were
started (the same order on every rank, as for any collective). So a mean in flight never interleaves with the
collectives the caller keeps issuing on its own groups. `compressed_mean` starts one and waits for it.
`simulate_compressed_mean` computes, in one process, the very result N ranks get, bit for bit.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.env import ProcessGroup, backend_name, group_label, group_rank, group_size, job_timeout
from ddpkit.distributed.quantize import Quantized, check_compression, dequantize, from_bytes, quantize, to_bytes
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


def _owner_mean(messages: list[Quantized], compression: str, block: int) -> Quantized:
    """What an owner computes from the N messages of its chunk: their fp32 mean (rank order), quantised."""
    total = dequantize(messages[0])
    for message in messages[1:]:
        total += dequantize(message)
    return quantize(total.div_(len(messages)), compression, block)


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
    _check_flat(flat)
    n, me = group_size(group), group_rank(group)
    if me < 0:
        raise ValueError("compressed mean: this rank is not in `group`")
    bounds = chunk_bounds(flat.numel(), n, block)
    pending = PendingMean([quantize(flat[a:b], compression, block) for a, b in bounds], flat.device)
    if n == 1:
        owner = _owner_mean(pending.sent, compression, block)
        pending._finish(owner, dequantize(owner), None)
        return pending
    sizes = [q.nbytes() for q in pending.sent]
    label = group_label(group)
    comm_stats.record("all_to_all", label, sum(sizes), float(sum(sizes) - sizes[me]))
    comm_stats.record("all_gather", label, sizes[me], float((n - 1) * sizes[me]))
    _channel(group).submit(_Job(pending, bounds, sizes, (compression, block, label)))
    return pending


def compressed_mean(flat: torch.Tensor, group: ProcessGroup | None, compression: str, block: int) -> torch.Tensor:
    """The mean of `flat` over `group`, sent quantised; the same bits on every rank (see the module doc)."""
    return start_compressed_mean(flat, group, compression, block).wait()


class _Job:
    """One started mean, as the worker thread runs it on the channel."""

    def __init__(self, pending: PendingMean, bounds: list[tuple[int, int]], sizes: list[int], settings: tuple) -> None:
        self.pending, self.bounds, self.sizes = pending, bounds, sizes
        self.compression, self.block, self.label = settings
        self.event = torch.cuda.Event() if pending.device.type == "cuda" else None
        if self.event is not None:
            self.event.record()  # the quantisation queued on the caller's stream

    def run(self, channel: _Channel) -> None:
        try:
            if self.event is not None:
                torch.cuda.set_device(self.pending.device)
                torch.cuda.current_stream().wait_event(self.event)
            owner, result = self._exchange(channel)
            if self.event is not None:
                torch.cuda.current_stream().synchronize()
            self.pending._finish(owner, result, None)
        except BaseException as error:  # handed to the caller's wait()
            self.pending._finish(None, None, error)

    def _transport(self, channel: _Channel, send: torch.Tensor, out_sizes: list[int], in_sizes: list[int]):
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

    def _exchange(self, channel: _Channel) -> tuple[Quantized, torch.Tensor]:
        n, me, sizes = channel.size, channel.rank, self.sizes
        numels = [b - a for a, b in self.bounds]
        send = torch.cat([to_bytes(q) for q in self.pending.sent])
        mine = self._transport(channel, send, [sizes[me]] * n, sizes)
        received = [from_bytes(m, numels[me], self.compression, self.block) for m in mine]
        owner = _owner_mean(received, self.compression, self.block)
        gathered = self._transport(channel, to_bytes(owner).repeat(n), sizes, [sizes[me]] * n)
        chunks = [from_bytes(m, k, self.compression, self.block) for m, k in zip(gathered, numels, strict=True)]
        return owner, torch.cat([dequantize(q) for q in chunks])


class _Channel:
    """A process group of the given ranks, made for the means alone, and the one thread that runs them in order.

    On gloo the group is a `ProcessGroupGloo` built by the members only, on the job's store under a prefix named
    by the ranks: torch's ``new_group`` needs every rank of the job (or, with ``use_local_synchronization``,
    members that have made as many groups as each other, as its hashed names count them), where a mean over node
    masters is started by the masters alone. Other backends get ``new_group(use_local_synchronization=True)``.
    """

    def __init__(self, ranks: list[int], parent: ProcessGroup | None, generation: int) -> None:
        self.default = dist.distributed_c10d._get_default_group()  # held: a new job's group is another object
        self.rank, self.size = ranks.index(dist.get_rank()), len(ranks)
        timeout = job_timeout(parent) or job_timeout() or timedelta(minutes=30)
        self.gloo = backend_name(parent, "cpu") == "gloo"
        if self.gloo:
            name = f"ddpkit/compressed_mean/{'_'.join(map(str, ranks))}/{generation}/"
            store = dist.PrefixStore(name, dist.distributed_c10d._get_default_store())
            self.backend: Any = dist.ProcessGroupGloo(store, self.rank, self.size, timeout)
        else:
            self.backend = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        name = "ddpkit-compressed-mean-" + ",".join(map(str, ranks))
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, out_sizes: list[int], in_sizes: list[int]) -> None:
        if self.gloo:
            self.backend.alltoall_base(recv, send, out_sizes, in_sizes).wait()
        else:
            dist.all_to_all_single(recv, send, out_sizes, in_sizes, group=self.backend)

    def submit(self, job: _Job) -> None:
        self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            self._jobs.get().run(self)


_channels: dict[tuple[int, ...], _Channel] = {}
_generations: dict[tuple[int, ...], int] = {}
_channels_lock = threading.Lock()


def _channel(group: ProcessGroup | None) -> _Channel:
    """The channel for `group`'s ranks, made by its members at their first mean on it (the same call everywhere)."""
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    with _channels_lock:
        channel = _channels.get(ranks)
        if channel is None or channel.default is not dist.distributed_c10d._get_default_group():
            generation = _generations.get(ranks, -1) + 1  # a store prefix never used before in this process
            _generations[ranks] = generation
            channel = _channels[ranks] = _Channel(list(ranks), group, generation)
        return channel
