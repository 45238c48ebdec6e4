"""Gradients averaged over a fault-tolerant round's members while backward still runs (DDP's overlap, per round).

`Manager.overlap_gradients(params)` puts one of these on the parameters. The bucketing is ShardedDataParallel's
(`ddpkit.distributed.grad_buckets`): the trainable parameters, in reverse order (about the order backward produces
their gradients), packed into buckets of about `bucket_bytes`, launched in one fixed order on every member; here
every member owns every bucket, so each bucket's message is all-reduced over the round's group (gloo works on it in
its own thread while backward goes on) instead of reduced to one owner. A bucket is launched once its last gradient
has been accumulated (a post-accumulate hook) and every bucket before it was. `finish` launches the buckets whose
gradients never came (parameters backward did not reach send zeros, as DDP with `find_unused_parameters` does),
waits for every bucket and writes the sums divided by the number of members into the gradients. Every message is
a copy, so a bucket whose all-reduce fails marks the round failed (`on_error`) with the gradients left as they
were: the remaining buckets are not sent and the commit drops the step.

Sends: the P gradients once per round in about P * 4 / bucket_bytes messages, as DDP does. Holds: one flat copy
of each bucket's gradients while it is in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ddpkit.distributed.comm import nbytes
from ddpkit.distributed.grad_buckets import build_buckets
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
        order = list(reversed(self.params))
        self.buckets = build_buckets(order, dict.fromkeys(order, 0), max(1, bucket_bytes // 4))
        for bucket in self.buckets:
            bucket.shared = True  # always a copy: a failed all-reduce leaves the gradients as they were
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self.reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def reset(self) -> None:
        """Forgets the backward under way (a rank that falls behind in one takes the live state and starts anew):
        the next backward starts from the first bucket."""
        for bucket in self.buckets:
            bucket.reset()
        self.launched = 0  # buckets launched so far, in order
        self.failed = False

    def _ready(self, param: torch.Tensor) -> None:
        self.bucket_of[id(param)].pending -= 1
        while self.launched < len(self.buckets) and self.buckets[self.launched].pending == 0:
            self._launch_next()

    def _launch_next(self) -> None:
        group = None if self.failed else self.group_of()  # (may raise FellBehind: nothing here moved yet)
        bucket = self.buckets[self.launched]
        self.launched += 1
        if group is None:
            self.failed = True
            return
        try:
            bucket.launch(self.members(), lambda message, _owner, _key: self._all_reduce(group, message), False, False)
        except RuntimeError as exc:
            if not is_peer_failure(exc):
                raise
            self.failed = True

    def _all_reduce(self, group: Any, message: torch.Tensor) -> Any:
        size = nbytes(message)
        comm_stats.record("all_reduce", "quorum", size, wire_bytes("all_reduce", size, self.members()))
        return group.allreduce([message])

    def finish(self) -> bool:
        """Sends what backward did not, waits for every bucket and writes the averages into the gradients;
        False (gradients left alone, `on_error` called) if any bucket failed. Ready for the next backward after."""
        while self.launched < len(self.buckets) and not self.failed:
            self._launch_next()
        sent = [bucket for bucket in self.buckets if bucket.work is not None]
        for bucket in sent:
            try:
                bucket.work.wait()  # type: ignore[attr-defined]
            except RuntimeError as exc:
                if not is_peer_failure(exc):
                    raise
                self.failed = True
        ok = not self.failed
        if ok:
            for bucket in sent:
                bucket.finish(True, self.members(), False)
        else:
            self.on_error()
        self.reset()
        return ok

    def remove(self) -> None:
        """Takes the hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()
