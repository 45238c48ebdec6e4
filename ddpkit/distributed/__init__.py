"""The only layer of ddpkit that talks to torch.distributed directly."""

from ddpkit.distributed.comm import all_gather, all_reduce, broadcast, reduce, reduce_scatter
from ddpkit.distributed.env import comm_device, group_label, group_rank, group_size, require_initialized
from ddpkit.distributed.hooks import counting_allreduce_hook
from ddpkit.distributed.stats import CollectiveCount, CommStats, comm_stats

__all__ = [
    "CollectiveCount",
    "CommStats",
    "all_gather",
    "all_reduce",
    "broadcast",
    "comm_device",
    "comm_stats",
    "counting_allreduce_hook",
    "group_label",
    "group_rank",
    "group_size",
    "reduce",
    "reduce_scatter",
    "require_initialized",
]
