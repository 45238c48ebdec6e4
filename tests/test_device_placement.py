"""Where ranks and models go: `run_distributed(device=...)`, `ddpkit train --device`, and NCCL's one-GPU-per-rank rule.

These run without a GPU; what they check is that a wrong placement fails early with a message naming the argument.
The placement itself is exercised on a GPU by tests/cuda.
"""

import pytest
import torch

from ddpkit.distributed import launch
from ddpkit.testing import rank_device, run_distributed
from ddpkit.train.settings.config import TrainConfig, validate

NO_CUDA = not torch.cuda.is_available()


def _where(rank, world):
    return str(rank_device())


def test_run_distributed_places_ranks_and_refuses_bad_devices():
    assert run_distributed(_where, 2) == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        run_distributed(_where, 2, device="gpu")
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        run_distributed(_where, torch.cuda.device_count() + 1, backend="nccl", device="cuda" if not NO_CUDA else "cpu")


@pytest.mark.skipif(not NO_CUDA, reason="checks the message given where CUDA is missing")
def test_cuda_placement_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        run_distributed(_where, 2, device="cuda")
    with pytest.raises(ValueError, match="--device cuda needs CUDA"):
        validate(TrainConfig(device="cuda"))
    with pytest.raises(ValueError, match="--backend nccl needs CUDA"):
        validate(TrainConfig(backend="nccl"))


def test_train_device_flag_and_backend_choice():
    with pytest.raises(ValueError, match="--device must be one of auto, cpu, cuda"):
        validate(TrainConfig(device="tpu"))
    with pytest.raises(ValueError, match="--device cpu needs --backend gloo"):
        validate(TrainConfig(backend="nccl", device="cpu"))
    gpus = torch.cuda.device_count() if not NO_CUDA else 0
    assert launch.pick_backend("auto", gpus + 1) == "gloo"  # NCCL only with a GPU per local process
    assert launch.pick_backend("auto", 1, device="cpu") == "gloo"
    assert launch.pick_backend("gloo", 1, device="cuda") == "gloo"
