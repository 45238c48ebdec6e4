"""Fixtures shared by the test modules that run `ddpkit train` as a command."""

import signal

from test_train_cli import procs, two_hosts  # noqa: F401  (fixtures: commands killed at the end, netns hosts)

# A shell starts a background job with SIGINT ignored, and every process it starts inherits that, so the Ctrl-C
# tests' SIGINT would never reach the `ddpkit train` they start. A handler (unlike "ignore") is not inherited.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
