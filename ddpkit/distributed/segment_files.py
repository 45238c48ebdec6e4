"""The files behind shared-memory segments (`ddpkit.distributed.shared_memory`): their names, the ones this
process created, and the sweep that removes what killed processes left in ``/dev/shm``.

A segment file is named ``ddpkit-<group token>-<pid namespace>-<writer pid>-<name>``, so a file whose writer is
gone (in this pid namespace) can be told from a live one. Importing this module loads no torch: the launcher of
``ddpkit train`` sweeps before and after its ranks run.
"""

from __future__ import annotations

import atexit
import os
import re
import time

SHM_DIR = "/dev/shm"
STALE_AFTER_SECONDS = 60.0
"""A segment file is unlinked milliseconds after its creation; one this old whose writer is gone is litter."""
SEGMENT_FILE = re.compile(r"ddpkit-[0-9a-f]{32}-(\d+)-(\d+)-.+")  # token, pid namespace, pid, name
OWN_FILES: set[str] = set()  # segment files this process created and has not seen unlinked yet


def remove_own_files() -> list[str]:
    """Unlinks every segment file this process created that is still there (mappings stay valid); returns their
    paths. Safe from a signal handler's thread and at exit; never raises."""
    removed = []
    for path in list(OWN_FILES):
        OWN_FILES.discard(path)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


atexit.register(remove_own_files)


def pid_namespace() -> int:
    """The inode number of this process's pid namespace (pids mean something only within one), 0 if unknown."""
    try:
        return int(re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or 0)
    except OSError:
        return 0


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def sweep_stale(directory: str = SHM_DIR, now: float | None = None, min_age: float = STALE_AFTER_SECONDS) -> list[str]:
    """Removes ddpkit segment files left by killed processes and returns their names. A file goes when its writer
    was in this pid namespace and is gone, and the file is older than `min_age` seconds. Never raises: it runs
    just before a collective, and a file it cannot judge is left alone."""
    now = time.time() if now is None else now
    ours, removed = pid_namespace(), []
    try:
        names = os.listdir(directory) if ours else []
    except OSError:
        return removed
    for name in names:
        match = SEGMENT_FILE.fullmatch(name)
        if match is None or int(match.group(1)) != ours:
            continue
        path = os.path.join(directory, name)
        try:
            if now - os.stat(path).st_mtime >= min_age and _process_gone(int(match.group(2))):
                os.unlink(path)
                removed.append(name)
        except (OSError, OverflowError, ValueError):  # removed meanwhile, not ours to remove, or a pid no kernel has
            continue
    return removed
