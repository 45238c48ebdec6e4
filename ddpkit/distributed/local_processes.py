"""The local processes of a job: started, watched and stopped by the command that launched them.

`spawn` runs a worker named by ``"package.module:function"`` in one process per local rank. Nothing here imports
torch: the launcher of ``ddpkit train`` only waits for its ranks. The ranks come from multiprocessing's fork
server: one helper process imports the worker's module (torch with it: seconds of CPU) once, then forks a rank per
local process, which starts with all of it in memory instead of importing it again (each spawned interpreter paid
it in full: four ranks on two cores took four imports' time to start). The fork server never initialises CUDA, so
each rank can. A rank that fails leaves its traceback as text in a file the launcher prints in debug mode.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from ddpkit import LAUNCHER_PID_VARIABLE
from ddpkit.distributed.launch import LaunchError, debug_mode, quiet_torch_errors
from ddpkit.distributed.rank_guard import say

STOP_GRACE_SECONDS = 3.0
"""After one local process fails, how long the others get to end by themselves, then to end on SIGTERM, before
SIGKILL (torch's default is 30 s each, far past --timeout for a rank that hangs or was stopped)."""


class Terminated(Exception):
    """The launcher received SIGTERM (or SIGHUP); its processes were stopped."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signal.Signals(signum).name)


def spawn(
    worker: str | Callable[..., Any],
    nprocs: int,
    args: tuple,
    stopped_limit: float | None = None,
    independent: bool = False,
) -> list[str]:
    """Runs ``worker(local_rank, *args)`` in `nprocs` spawned processes and waits for all of them. `worker` is a
    function or its name as ``"package.module:function"`` (imported in the ranks only).

    With `independent` (a fault-tolerant job: the others train on without a lost rank) a failed process leaves the
    others running, and the returned list says how each failed one ended; otherwise it is empty and:

    If one fails, the others are stopped (within 2 x `STOP_GRACE_SECONDS`) and a LaunchError names it; Ctrl-C
    (SIGINT, even when the shell that started this process ignored it, as it does for background jobs) stops every
    local process, and so does SIGTERM or SIGHUP (what `kill`, `timeout` and schedulers send), after which this
    process exits with 128 + the signal's number. A process stopped (SIGSTOP, Ctrl-Z) for more than
    `stopped_limit` seconds (its peers on other machines have given up on it by then) is ended with the others and
    named. Should this process be killed outright (SIGKILL), each rank notices its launcher is gone and ends
    (`guard_rank`), even one stopped at that moment: the fork server finds this process's id in
    `LAUNCHER_PID_VARIABLE`, arms its wake-up at ddpkit's import and each rank's at the fork, and ends with this
    process. Shared-memory files a killed rank left behind are removed once every rank has ended.
    """
    quiet_torch_errors()
    from ddpkit.distributed.segment_files import sweep_stale

    sweep_stale(min_age=0)  # what an earlier job on this host left when it was killed
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    processes: list[Any] = []
    error_files = [_error_file() for _ in range(nprocs)]
    launcher = os.environ.get(LAUNCHER_PID_VARIABLE)
    os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())  # the ranks arm their wake-up at import
    try:
        _start(worker, args, error_files, processes)
        if independent:
            return _wait_for_all(processes, error_files)
        failed, stopped = _wait_for_first_failure(processes, stopped_limit)
        if stopped:
            _stop(processes)
            raise LaunchError(
                f"local process {failed} was stopped (SIGSTOP or Ctrl-Z) for more than {stopped_limit:g} s, past "
                "--timeout, so the job's other ranks have given up on it; every local process was ended"
            )
        if failed is not None:
            _stop(processes, grace=STOP_GRACE_SECONDS)  # the others end by themselves once they notice, or are ended
            raise LaunchError(_describe_exit(failed, processes[failed], error_files[failed]))
    except KeyboardInterrupt:
        _stop(processes)
        raise
    except Terminated as exc:
        _stop(processes)
        signum = signal.Signals[str(exc)]
        say(f"ddpkit: {signum.name} received; stopped every local process")
        sys.exit(128 + int(signum))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _restore_variable(LAUNCHER_PID_VARIABLE, launcher)
        sweep_stale(min_age=0)
        for path in error_files:
            _remove(path)
    return []


def _start(worker: str | Callable[..., Any], args: tuple, error_files: list[str], processes: list[Any]) -> None:
    """Starts one process per error file, each running `_run_local_rank` for its index, and appends it to
    `processes` as soon as it runs (so that an interruption meanwhile stops those already started). The processes
    are forked by the fork server, which has the worker's module imported; each gets this process's environment as
    it is now (the fork server's own is this process's when it first started)."""
    context = start_context(worker.partition(":")[0] if isinstance(worker, str) else None)
    environment = dict(os.environ)
    for index, error_file in enumerate(error_files):
        process = context.Process(target=_run_local_rank, args=(worker, index, args, error_file, environment))
        process.start()
        processes.append(process)


PRELOADED_WITH_TORCH = ("torch._dynamo",)
"""Modules the fork server imports after a worker's module: every torch optimizer's constructor imports
torch._dynamo (about 2 s of CPU), which each rank would otherwise pay again. Importing it touches no CUDA device
(tests/test_local_processes.py checks), so the forked ranks can still use CUDA."""

RANK_NAME_PREFIX = "ddpkit-local-"
"""A local rank's process name (``ps -e``, ``top``, /proc/PID/comm) is this and its index."""


def start_context(preload: str | None, context_of: Callable[[str], Any] = multiprocessing.get_context) -> Any:
    """The multiprocessing context that starts local processes: the fork server where the platform has one
    (Linux, macOS), importing module `preload` (if given; with `PRELOADED_WITH_TORCH`) before its first start,
    else a fresh interpreter per process (``spawn``: Windows). `context_of` makes it (torch.multiprocessing's
    ``get_context`` for processes that pass tensors)."""
    forkserver = "forkserver" in multiprocessing.get_all_start_methods()
    context = context_of("forkserver" if forkserver else "spawn")
    if forkserver and preload is not None:
        context.set_forkserver_preload([preload, *PRELOADED_WITH_TORCH])  # (ignored once the fork server runs)
    return context


def adopt_environment(environment: dict[str, str]) -> None:
    """Makes this process's environment `environment`: a forked process starts with the fork server's, which is
    its starter's as it was when the fork server started."""
    os.environ.clear()
    os.environ.update(environment)


def _run_local_rank(
    worker: str | Callable[..., Any], index: int, args: tuple, error_file: str, environment: dict[str, str]
) -> None:
    """A local process's body: takes the launcher's `environment`, lets the fork server end with the launcher,
    takes the name ``ddpkit-local-<index>`` (what ``ps`` and ``top`` show) and runs the worker; an exception's
    traceback goes to `error_file` (as text) and the process exits with 1; Ctrl-C (KeyboardInterrupt) ends it
    quietly, as its launcher reports the interruption."""
    adopt_environment(environment)
    _release_fork_server()
    _name_process(f"{RANK_NAME_PREFIX}{index}")
    try:
        resolve(worker)(index, *args)
    except KeyboardInterrupt:
        pass
    except Exception:
        with open(error_file, "w") as f:
            f.write(traceback.format_exc())
        sys.exit(1)


def _name_process(name: str) -> None:
    """Sets this process's name as the kernel shows it (``ps -e``, ``top``, /proc/PID/comm; 15 bytes at most)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
        except (OSError, AttributeError):
            pass


def _release_fork_server() -> None:
    """Closes this process's copy of the descriptor that keeps the fork server running. The fork server ends when
    every holder has closed it; with the ranks holding it, a killed launcher left the fork server up, and so no
    parent-death signal woke a rank that was stopped (SIGSTOP) at that moment. The ranks start no processes of
    their own through it."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    descriptor = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(descriptor, int):
        try:
            os.close(descriptor)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def resolve(worker: str | Callable[..., Any]) -> Callable[..., Any]:
    """The function `worker` names (``"package.module:function"``), or `worker` itself when it is one."""
    if callable(worker):
        return worker
    module, _, name = worker.partition(":")
    if not module or not name:
        raise ValueError(f"worker: expected a function or 'package.module:function', got {worker!r}")
    return getattr(importlib.import_module(module), name)


def _error_file() -> str:
    """A path for a rank's traceback, not yet created (the rank writes it only when it fails)."""
    handle, path = tempfile.mkstemp(prefix="ddpkit-rank-error-", suffix=".txt")
    os.close(handle)
    os.unlink(path)
    return path


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _restore_variable(name: str, value: str | None) -> None:
    """Puts environment variable `name` back to `value` (None: unset)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _wait_for_all(processes: list[Any], error_files: list[str]) -> list[str]:
    """Waits for every process; returns a line for each that failed."""
    for p in processes:
        p.join()
    return [_describe_exit(i, p, error_files[i]) for i, p in enumerate(processes) if p.exitcode != 0]


def _wait_for_first_failure(processes: list[Any], stopped_limit: float | None) -> tuple[int | None, bool]:
    """Waits until every process ended successfully ((None, False)), one failed ((its index, False)) or one has
    been stopped for longer than `stopped_limit` seconds ((its index, True))."""
    from multiprocessing.connection import wait

    pending = {p.sentinel: i for i, p in enumerate(processes)}
    stopped_since: dict[int, float] = {}
    while pending:
        for sentinel in wait(list(pending), timeout=1.0 if stopped_limit is not None else None):
            index = pending.pop(sentinel)
            processes[index].join()
            if processes[index].exitcode != 0:
                return index, False
        if stopped_limit is None:
            continue
        now = time.monotonic()
        for index in pending.values():
            if not is_stopped(processes[index].pid):
                stopped_since.pop(index, None)
            elif now - stopped_since.setdefault(index, now) > stopped_limit:
                return index, True
    return None, False


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (state T in /proc; False where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _stop(processes: list[Any], grace: float = 0.0) -> None:
    """Gives running processes `grace` seconds to end, then SIGTERM (and SIGCONT, so that a stopped one acts on
    it) and `STOP_GRACE_SECONDS` more, then SIGKILL."""
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            _signal(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            _signal(p.pid, signal.SIGKILL)
            p.join(timeout=STOP_GRACE_SECONDS)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(index: int, process: Any, error_file: str) -> str:
    """One line saying how local process `index` ended (with its traceback, if it left one, in debug mode)."""
    code = process.exitcode
    if code is not None and code < 0:
        try:
            how = f"terminated with signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"terminated with signal {-code}"
    else:
        how = f"terminated with exit code {code}"
    if debug_mode() and os.access(error_file, os.R_OK):
        with open(error_file) as f:
            print(f.read(), file=sys.stderr, flush=True)
    return f"local process {index} failed: process {index} {how}"
