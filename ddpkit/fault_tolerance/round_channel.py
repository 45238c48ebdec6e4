"""A fault-tolerant round's group as a channel for jobs (the compressed mean of pseudo-gradients over its members).

`ddpkit.algorithms.compressed_mean` hands its exchange as a job to a channel: for a group of the whole job that is
`ddpkit.distributed.background`'s, a group of its own that runs beside training. A round of a fault-tolerant job
(`ddpkit.fault_tolerance.manager.Manager`) has a gloo group made for its members alone, which lives one round:
`RoundChannel` gives it a channel's shape (`rank`, `size`, `all_to_all`, `submit`) and runs each job at once on
the caller's thread, so a mean is done when `submit` returns, and an exchange that fails (a member died in it)
fails inside the caller's `Manager.collective`, which marks the round failed.

Sends what its jobs send, over the round's group; holds the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddpkit.fault_tolerance.membership import Quorum


class RoundChannel:
    """The open round's group (`quorum`, on a member) as a channel whose jobs run on the caller's thread."""

    gloo = True  # a round's group is a gloo group (its tensors are on the CPU)
    threaded = False

    def __init__(self, quorum: Quorum) -> None:
        if not quorum.is_member or quorum.group is None:
            raise ValueError(f"RoundChannel: this rank has no group in round {quorum.round}")
        assert quorum.index is not None
        self.group: Any = quorum.group
        self.rank, self.size = quorum.index, len(quorum.members)

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, out_sizes: list[int], in_sizes: list[int]) -> None:
        """One all-to-all of the round's members (sizes in elements of `recv` / `send`)."""
        self.group.alltoall_base(recv, send, out_sizes, in_sizes).wait()

    def submit(self, job: Callable[[RoundChannel], None]) -> None:
        job(self)
