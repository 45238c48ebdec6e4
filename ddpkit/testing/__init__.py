"""Helpers for testing distributed code: `run_distributed` runs a function on N gloo ranks (on CPU or
sharing GPUs)."""

from ddpkit.testing.spawn import DistributedTimeout, RemoteTraceback, rank_device, run_distributed

__all__ = ["DistributedTimeout", "RemoteTraceback", "rank_device", "run_distributed"]
