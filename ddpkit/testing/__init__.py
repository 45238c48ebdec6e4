"""Helpers for testing distributed code: `run_distributed` runs a function on N gloo ranks."""

from ddpkit.testing.spawn import DistributedTimeout, RemoteTraceback, run_distributed

__all__ = ["DistributedTimeout", "RemoteTraceback", "run_distributed"]
