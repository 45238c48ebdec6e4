"""How nodes average, and the math of it: the layer between transport (`ddpkit.distributed`) and the wrappers.

`averager` holds the protocol SlowMo's averaging modes share and their registry; `exact`, `gossip` and
`pseudo_gradient` are the three built-in modes; beside them the pure math they use (`gossip_graphs`,
`gossip_mixing`, `push_sum` rounds, `quantize`, the `compressed_mean`, `slow_momentum`). Importing this package
registers the built-in modes.
"""

from ddpkit.algorithms import exact, gossip, pseudo_gradient
from ddpkit.algorithms.averager import (
    AveragingContext,
    AveragingOptions,
    NodeAverager,
    SlowPhase,
    averager_class,
    register_averager,
    registered_averagers,
)

__all__ = [
    "AveragingContext",
    "AveragingOptions",
    "NodeAverager",
    "SlowPhase",
    "averager_class",
    "exact",
    "gossip",
    "pseudo_gradient",
    "register_averager",
    "registered_averagers",
]
