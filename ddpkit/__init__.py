"""ddpkit: data-parallel training that costs less memory and less network than plain DDP.

Layers (imports only go downwards):
- `ddpkit.distributed`: process groups, the collectives ddpkit uses, `comm_stats` (what was sent).
- `ddpkit.optim`: `OSS` (optimizer state sharding, ZeRO-1), `ShardedGradScaler`.
- `ddpkit.nn`: `ShardedDataParallel` (gradient sharding, ZeRO-2).
- `ddpkit.testing`: `run_distributed`, the multi-process test runner.

Importing ddpkit loads no torch and communicates nothing; in a rank that ddpkit's launcher spawned it arms the
parent-death signal (`_wake_when_launcher_dies`).
"""

import os as _os
import sys as _sys
import time as _time

__version__ = "0.1.0"

_imported_at = _time.time()  # when this process first imported ddpkit: the start of a `ddpkit` command's own work

LAUNCHER_PID_VARIABLE = "DDPKIT_LAUNCHER_PID"
"""Set by ddpkit's launcher for the ranks it spawns: its process id (see `_wake_when_launcher_dies`)."""


def _set_parent_death_signal(sig: int) -> bool:
    """Asks Linux to send `sig` to this process when its parent ends (prctl PR_SET_PDEATHSIG); False elsewhere."""
    if not _sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _launched_rank() -> bool:
    """Whether this process is a rank that a launcher started: ddpkit's (it named itself, the parent, in
    `LAUNCHER_PID_VARIABLE`; the rank's own children are not ranks) or torchrun's (its worker variables)."""
    if _os.environ.get(LAUNCHER_PID_VARIABLE) == str(_os.getppid()):
        return True
    return "TORCHELASTIC_RUN_ID" in _os.environ and "LOCAL_RANK" in _os.environ


def _wake_when_launcher_dies() -> bool:
    """In a launched process (`_launched_rank`), arms SIGCONT as the parent-death signal at ddpkit's first import,
    before torch's, and in every process it forks at once (ddpkit's launcher has its ranks forked by a fork server,
    itself a launched process, which ends with the launcher): a rank stopped (SIGSTOP, Ctrl-Z) while it starts,
    then orphaned by a killed launcher, is woken and ends at its rank guard (`ddpkit.distributed.rank_guard`),
    which used to arm it only after torch's import, seconds later, leaving such a rank (and the launcher's resource
    tracker) stopped forever. SIGCONT does nothing to a running process. Returns whether it armed it."""
    import signal

    if not _launched_rank():
        return False
    server = _os.getpid()

    def arm_in_child() -> None:
        if _os.getppid() == server:  # (not in the grandchildren a rank forks itself: DataLoader workers)
            _set_parent_death_signal(signal.SIGCONT)

    _os.register_at_fork(after_in_child=arm_in_child)
    return _set_parent_death_signal(signal.SIGCONT)


_wake_when_launcher_dies()
