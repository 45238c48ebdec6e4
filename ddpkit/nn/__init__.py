"""Model wrappers: `ShardedDataParallel` (gradient sharding, ZeRO-2) and `SlowMoDistributedDataParallel`."""

from ddpkit.nn.sharded_ddp import ShardedDataParallel, ShardedDDP
from ddpkit.nn.slowmo_ddp import SlowMoBaseAlgorithm, SlowMoDDP, SlowMoDistributedDataParallel

__all__ = ["ShardedDDP", "ShardedDataParallel", "SlowMoBaseAlgorithm", "SlowMoDDP", "SlowMoDistributedDataParallel"]
