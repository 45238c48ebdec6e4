"""Gradients averaged over a fault-tolerant round's members while backward still runs (DDP's overlap, per round).

`Manager.overlap_gradients(params)` puts one of these on the parameters: the trainable parameters are packed, in
reverse order (about the order backward produces their gradients), into buckets of about `bucket_bytes`. When the
last gradient of a bucket has been accumulated (a post-accumulate hook), the bucket is copied into one flat fp32
message and its all-reduce starts at once on the round's group (gloo works on it in its own thread while backward
goes on). `finish` starts the buckets whose gradients never came (parameters backward did not reach send zeros,
as DDP with `find_unused_parameters` does), waits for every bucket and writes the sums divided by the number of
members back into the gradients. A bucket whose all-reduce fails marks the round failed (`on_error`): the
remaining buckets are not sent and the gradients are left as they are, for the commit to drop the step.

Sends: the P gradients once per round in ceil(P * 4 / bucket_bytes) messages, as DDP does. Holds: one flat copy
of each bucket's gradients while it is in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ddpkit.distributed.comm import nbytes
from ddpkit.distributed.stats import comm_stats, wire_bytes
from ddpkit.fault_tolerance.failures import is_peer_failure


class RoundBuckets:
    """The buckets of `params` (module doc). `group_of()` gives the round's group (None: the round failed, or no
    round is open), `members()` how many members it has; `on_error()` marks the round failed."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        bucket_bytes: int,
        group_of: Callable[[], Any],
        members: Callable[[], int],
        on_error: Callable[[], None],
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group_of, self.members, self.on_error = group_of, members, on_error
        self.buckets: list[list[int]] = []
        size = bucket_bytes + 1
        for index in reversed(range(len(self.params))):
            if size > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(index)
            size += self.params[index].numel() * 4
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.enabled = True
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _reset(self) -> None:
        self.arrived = [0] * len(self.buckets)
        self.flights: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (its all-reduce, its message)
        self.failed = False

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def ready(_: torch.Tensor) -> None:
            if not self.enabled:
                return
            bucket = self.bucket_of[index]
            self.arrived[bucket] += 1
            if self.arrived[bucket] == len(self.buckets[bucket]):
                self._launch(bucket)

        return ready

    def _launch(self, bucket: int) -> None:
        group = None if self.failed else self.group_of()
        if group is None:
            self.failed = True
            return
        parts = [self.params[i] for i in self.buckets[bucket]]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                          for p in parts])  # fmt: skip
        size = nbytes(flat)
        comm_stats.record("all_reduce", "quorum", size, wire_bytes("all_reduce", size, self.members()))
        try:
            self.flights[bucket] = (group.allreduce([flat]), flat)
        except RuntimeError as exc:
            if not is_peer_failure(exc):
                raise
            self.failed = True

    def finish(self) -> bool:
        """Sends what backward did not, waits for every bucket and writes the averages into the gradients;
        False (gradients left alone, `on_error` called) if any bucket failed. Ready for the next backward after."""
        for bucket in range(len(self.buckets)):
            if bucket not in self.flights and not self.failed:
                self._launch(bucket)
        results = {}
        for bucket, (work, flat) in self.flights.items():
            try:
                work.wait()
                results[bucket] = flat
            except RuntimeError as exc:
                if not is_peer_failure(exc):
                    raise
                self.failed = True
        ok = not self.failed
        if ok:
            n = self.members()
            for bucket, flat in results.items():
                self._write_back(bucket, flat.div_(n))
        else:
            self.on_error()
        self._reset()
        return ok

    def _write_back(self, bucket: int, flat: torch.Tensor) -> None:
        offset = 0
        for i in self.buckets[bucket]:
            p = self.params[i]
            average = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = average.to(p.device, p.dtype)
            else:
                p.grad.copy_(average)

    def remove(self) -> None:
        """Takes the hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()
