"""Collectives that run beside training: one place, one channel per set of ranks, and the device rules.

An algorithm that wants an exchange to travel while the caller keeps training (the compressed mean of SlowMo's
pseudo-gradients, `ddpkit.algorithms.compressed_mean`) hands it here as a job: a callable that receives the
`BackgroundChannel` of its ranks and issues its collectives on it. Jobs of one set of ranks run one after the
other, in the order they were submitted (the same order on every rank, as for any collective), on a process
group of their own, so they never interleave with the collectives the caller issues on its groups.

The device rules, enforced here and nowhere else:

- **gloo** (CPU tensors, or CUDA tensors staged through host memory): one worker thread per channel runs the
  jobs; gloo's collectives block their caller, so a thread is what lets training go on meanwhile.
- **NCCL** (and any other backend): no second thread ever issues a collective. NCCL forbids issuing operations of
  communicators from several threads without a consistent global order, so a job runs on the caller's thread
  when it is submitted; NCCL's operations are asynchronous on the GPU's streams already, so the job only
  enqueues work, and nothing synchronises a stream: a later wait orders on the stream like any kernel.

The channel's group is made by its members alone at their first job (on gloo, a `ProcessGroupGloo` on the job's
store under a prefix named by the ranks; otherwise ``new_group(use_local_synchronization=True)``), with the
parent group's timeout: torch's plain ``new_group`` needs every rank of the job, where a mean over node masters
is started by the masters alone. Memory: the group and, on gloo, one idle thread per set of ranks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.env import ProcessGroup, backend_name, job_timeout


def runs_in_thread(backend: str) -> bool:
    """The device rule: whether jobs on a channel of `backend` run on a worker thread (gloo only)."""
    return backend == "gloo"


class BackgroundChannel:
    """A process group of some ranks, made for background jobs alone, and the runner of its jobs (module doc)."""

    def __init__(self, ranks: list[int], parent: ProcessGroup | None, generation: int) -> None:
        self.default = dist.distributed_c10d._get_default_group()  # held: a new job's group is another object
        self.ranks = ranks
        self.rank, self.size = ranks.index(dist.get_rank()), len(ranks)
        timeout = job_timeout(parent) or job_timeout() or timedelta(minutes=30)
        self.gloo = backend_name(parent, "cpu") == "gloo"
        if self.gloo:
            name = f"ddpkit/background/{'_'.join(map(str, ranks))}/{generation}/"
            store = dist.PrefixStore(name, dist.distributed_c10d._get_default_store())
            self.backend: Any = dist.ProcessGroupGloo(store, self.rank, self.size, timeout)
        else:
            self.backend = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
        self.threaded = runs_in_thread("gloo" if self.gloo else backend_name(parent, "cuda"))
        self._jobs: queue.SimpleQueue[Callable[[BackgroundChannel], None]] = queue.SimpleQueue()
        if self.threaded:
            label = "ddpkit-background-" + ",".join(map(str, ranks))
            threading.Thread(target=self._serve, name=label, daemon=True).start()

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, out_sizes: list[int], in_sizes: list[int]) -> None:
        """One all-to-all of this channel's ranks (sizes in elements of `recv` / `send`)."""
        if self.gloo:
            self.backend.alltoall_base(recv, send, out_sizes, in_sizes).wait()
        else:
            dist.all_to_all_single(recv, send, out_sizes, in_sizes, group=self.backend)

    def submit(self, job: Callable[[BackgroundChannel], None]) -> None:
        """Runs `job(self)` after the jobs submitted before it: on the worker thread (gloo) or now (NCCL)."""
        if self.threaded:
            self._jobs.put(job)
        else:
            job(self)

    def _serve(self) -> None:
        while True:
            self._jobs.get()(self)


_channels: dict[tuple[int, ...], BackgroundChannel] = {}
_generations: dict[tuple[int, ...], int] = {}
_channels_lock = threading.Lock()


def channel_for(group: ProcessGroup | None) -> BackgroundChannel:
    """The channel of `group`'s ranks, made by its members at their first job on it (the same call everywhere)."""
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    with _channels_lock:
        channel = _channels.get(ranks)
        if channel is None or channel.default is not dist.distributed_c10d._get_default_group():
            generation = _generations.get(ranks, -1) + 1  # a store prefix never used before in this process
            _generations[ranks] = generation
            channel = _channels[ranks] = BackgroundChannel(list(ranks), group, generation)
        return channel
