"""ddpkit's accelerate recipe (issue 25, point 2) against accelerate's own DDP path.

One torchrun job runs the same accelerate loop (Adam, StepLR, accumulation over 2 micro-batches, clipping by norm,
`save_state` midway) through ``accelerator.prepare`` (torch DDP) and through `prepare_sharded` (OSS +
ShardedDataParallel, tests/accelerate_runs.py). The reference is accelerate's DDP run: losses and parameters must
agree to 1e-6 on every rank, the optimizer state must be split over the ranks, and a fresh model and optimizer that
`load_state` the checkpoint must end exactly where the uninterrupted run ended. With accelerate's own
``clip_grad_norm_`` (the norm of one shard) the parameters end 0.002 away from DDP's.
"""

from __future__ import annotations

import json

import pytest
from test_lightning import HERE, _close, _torchrun

pytest.importorskip("accelerate", reason="the accelerate recipe needs accelerate: pip install accelerate")

pytestmark = pytest.mark.slow


def test_the_sharded_recipe_trains_checkpoints_and_resumes_as_accelerates_ddp(tmp_path):
    _torchrun(2, HERE / "accelerate_runs.py", tmp_path)
    for rank in range(2):
        ddp, sharded = (json.loads((tmp_path / f"{mode}.rank{rank}.json").read_text()) for mode in ("ddp", "sharded"))
        assert (ddp["model"], sharded["model"]) == ("DistributedDataParallel", "ShardedDataParallel")
        assert _close(sharded["losses"], ddp["losses"]) < 1e-6 and _close(sharded["params"], ddp["params"]) < 1e-6
        for run in (ddp, sharded):  # load_state, then the same steps: the uninterrupted run's end, exactly
            assert run["resumed"] == run["params"], rank
            assert run["resumed_losses"] == run["losses"][-len(run["resumed_losses"]) :], rank
        assert 0 < sharded["state_bytes"] < ddp["state_bytes"], (sharded["state_bytes"], ddp["state_bytes"])
