"""Model wrappers: `ShardedDataParallel` (gradient sharding, ZeRO-2) and `SlowMoDistributedDataParallel`."""

# SGP's graphs, mixing and gossipers, next to SlowMo as fairscale offers them
from ddpkit.algorithms.gossip_graphs import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphManager,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)
from ddpkit.algorithms.gossip_mixing import MixingManager, UniformMixing
from ddpkit.algorithms.push_sum import PushPull, PushSum
from ddpkit.nn.sharded_ddp import ShardedDataParallel, ShardedDDP
from ddpkit.nn.slowmo_ddp import SlowMoBaseAlgorithm, SlowMoDDP, SlowMoDistributedDataParallel

__all__ = ["ShardedDDP", "ShardedDataParallel", "SlowMoBaseAlgorithm", "SlowMoDDP", "SlowMoDistributedDataParallel"]
__all__ += ["DynamicBipartiteExponentialGraph", "DynamicBipartiteLinearGraph", "DynamicDirectedExponentialGraph"]
__all__ += ["DynamicDirectedLinearGraph", "GraphManager", "MixingManager", "NPeerDynamicDirectedExponentialGraph"]
__all__ += ["PushPull", "PushSum", "RingGraph", "UniformMixing"]
