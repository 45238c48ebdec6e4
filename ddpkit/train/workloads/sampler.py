"""A distributed sampler that can resume in the middle of an epoch, at the same or another world size."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data.distributed import DistributedSampler


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` (shuffled, padded, rank r takes every world-size-th index) that can skip the first
    `start` positions of the epoch's permutation (`set_start`).

    Rank r's j-th sample is position ``r + world_size * j`` of the permutation, so after k full batches of B the
    ranks together consumed exactly positions ``[0, k * B * world_size)``. A job resumed from a checkpoint taken
    there skips those and splits the rest over its own ranks, however many: every sample of the epoch is still
    seen once (plus the padding that makes the split even, taken from the permutation's beginning as
    DistributedSampler does). At an unchanged world size the order is DistributedSampler's, wherever it starts.
    No communication; memory: one permutation of the dataset's indices.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, num_replicas: int, rank: int, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle=True, seed=seed)
        self.start = 0

    def set_start(self, start: int) -> None:
        """Skips the first `start` positions of the epoch's permutation (0: the whole epoch)."""
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"ResumableSampler.set_start: start must be an int >= 0, got {start!r}")
        self.start = start

    def _remaining(self) -> int:
        return max(len(self.dataset) - self.start, 0)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return math.ceil(self._remaining() / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        indices = torch.randperm(len(self.dataset), generator=g).tolist()  # type: ignore[arg-type]
        if self.start >= len(indices):
            return iter([])
        end = self.start + len(self) * self.num_replicas  # padded as DistributedSampler pads: from the beginning
        indices += (indices * math.ceil(end / len(indices)))[: end - len(indices)]
        return iter(indices[self.start + self.rank : end : self.num_replicas])
