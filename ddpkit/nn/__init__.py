"""Model wrappers: `ShardedDataParallel` (gradient sharding, ZeRO-2)."""

from ddpkit.nn.sharded_ddp import ShardedDataParallel, ShardedDDP

__all__ = ["ShardedDDP", "ShardedDataParallel"]
