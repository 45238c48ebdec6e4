"""Fixtures shared by the test modules that run `ddpkit train` as a command."""

from test_train_cli import procs, two_hosts  # noqa: F401  (fixtures: commands killed at the end, netns hosts)
