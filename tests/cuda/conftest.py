"""The `cuda` test set: every ddpkit component on CUDA tensors. Run it with ``pytest -m cuda`` on a machine with CUDA.

Multi-rank tests run gloo ranks that share the GPUs (``run_distributed(device="cuda")``: on one GPU every rank
uses ``cuda:0``, since NCCL refuses two ranks on one GPU); NCCL runs at world size 1 (``test_cuda_nccl_and_cli``).
Without CUDA every test here is skipped. ``DDPKIT_CUDA_TESTS_ON_CPU=1`` runs them on CPU instead, with ddpkit
taking the path CUDA tensors take (no shared memory; every gloo collective staged through host copies and
counted): a check of the tests' own logic and counts on a machine without a GPU, not a substitute for the GPU run.
Tests that need a real GPU (NCCL, ``ddpkit train --device cuda``, CUDA streams) are skipped in that mode.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ON_CPU = os.environ.get("DDPKIT_CUDA_TESTS_ON_CPU") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if ON_CPU else None)
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(_HERE))  # the CPU tests' helpers (tests/test_*.py) are reused here


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(
        reason="needs CUDA (torch.cuda.is_available() is False); DDPKIT_CUDA_TESTS_ON_CPU=1 dry-runs them on CPU"
    )
    for item in items:
        if os.path.abspath(str(item.fspath)).startswith(_HERE + os.sep):
            item.add_marker(pytest.mark.cuda)
            if DEVICE is None:
                item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """``"cuda"``, or ``"cpu"`` in the dry run (DDPKIT_CUDA_TESTS_ON_CPU=1)."""
    assert DEVICE is not None
    return DEVICE


@pytest.fixture
def real_cuda() -> None:
    """Skips a test that needs a real GPU (NCCL, CUDA streams, the CLI on CUDA) in the dry run."""
    if DEVICE != "cuda":
        pytest.skip("needs a real GPU (not covered by the CPU dry run)")
