"""ddpkit: data-parallel training that costs less memory and less network than plain DDP.

Layers (imports only go downwards):
- `ddpkit.distributed`: process groups, the collectives ddpkit uses, `comm_stats` (what was sent).
- `ddpkit.optim`: `OSS` (optimizer state sharding, ZeRO-1), `ShardedGradScaler`.
- `ddpkit.nn`: `ShardedDataParallel` (gradient sharding, ZeRO-2).
- `ddpkit.testing`: `run_distributed`, the multi-process test runner.
"""

import time as _time

__version__ = "0.1.0"

_imported_at = _time.time()  # when this process first imported ddpkit: the start of a `ddpkit` command's own work
