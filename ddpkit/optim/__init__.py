"""Optimizers: `OSS` (optimizer state sharding, ZeRO-1) and `ShardedGradScaler`."""

from ddpkit.optim.adascale import AdaScale
from ddpkit.optim.adascale_wrapper import AdaScaleWrapper
from ddpkit.optim.grad_scaler import ShardedGradScaler
from ddpkit.optim.oss import OSS
from ddpkit.optim.oss_hook import reduce_to_owners_hook

__all__ = ["OSS", "AdaScale", "AdaScaleWrapper", "ShardedGradScaler", "reduce_to_owners_hook"]
