"""The launcher's local processes (`ddpkit.distributed.local_processes`): started without torch in the launcher,
a failure named with its traceback as text, a worker given by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_cli import _proc_table, alive, descendants

from ddpkit.distributed.launch import LaunchError
from ddpkit.distributed.local_processes import RANK_NAME_PREFIX, resolve, spawn


def fails_on_rank_one(index: int, message: str) -> None:
    """A worker for `spawn`: rank 1 raises, rank 0 returns."""
    if index == 1:
        raise RuntimeError(message)


def stops_itself(index: int) -> None:
    """A worker for `spawn`: stops its own process (SIGSTOP) before anything else, as a Ctrl-Z could."""
    os.kill(os.getpid(), signal.SIGSTOP)


def test_a_rank_stopped_before_its_guard_is_woken_and_ends_when_the_launcher_is_killed():
    """The parent-death signal is armed in each rank as the fork server forks it (the rank guard arms it again
    later); a rank stopped before that, orphaned, would stay stopped forever, and its fork server with it."""
    here = str(Path(__file__).resolve().parent)
    code = f"from ddpkit.distributed.local_processes import spawn\nspawn('{__name__}:stops_itself', 1, ())\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    family: set[tuple[int, int]] = set()  # (pid, start time): a pid alone may be reused
    try:
        deadline = time.monotonic() + 60
        while True:
            table = _proc_table()
            family = {(p, table[p][3]) for p in descendants(launcher.pid, table)}
            stopped = [p for p, _ in family if table[p][4] == f"{RANK_NAME_PREFIX}0" and table[p][1] == "T"]
            if stopped:
                break
            assert time.monotonic() < deadline and launcher.poll() is None, "the rank never stopped itself"
            time.sleep(0.05)
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 30  # (each of them needs the CPU for a moment: at load, seconds)
        while (left := alive(family)) and time.monotonic() < deadline:
            time.sleep(0.1)
        table = _proc_table()
        states = {p: table[p][1:5:3] for p, _ in left if p in table}  # (state, name)
        assert not left, f"the stopped rank or its fork server outlived the killed launcher: {states}"
    finally:
        launcher.kill()
        for pid, _ in alive(family):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


def test_the_launcher_of_a_built_in_job_imports_no_torch():
    # what `ddpkit train --model mlp --data digits` runs in the launcher up to spawning its ranks
    code = (
        "import sys\n"
        "from ddpkit.cli import make_config, build_parser\n"
        "import ddpkit.train.loop.launcher, ddpkit.distributed.local_processes\n"
        "make_config(build_parser().parse_args(['train', '--model', 'mlp', '--data', 'digits']))\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(loaded), loaded[:3])\n"
    )
    printed = _python(code)
    assert printed.startswith("0 "), f"the launcher imported torch: {printed}"


def test_the_modules_the_fork_server_imports_leave_cuda_alone():
    """A process that has initialised CUDA (even only asking how many devices there are) cannot pass it on to the
    ranks it forks: the fork server imports the workers' modules, so these must not touch CUDA at import."""
    code = (
        "import torch, torch.cuda\n"
        "calls = []\n"
        "torch._C._cuda_getDeviceCount = lambda: calls.append('_cuda_getDeviceCount') or 0\n"
        "torch._C._cuda_getCurrentRawStream = lambda *a: calls.append('_cuda_getCurrentRawStream')\n"
        "for name in ('is_available', 'device_count', 'init', '_lazy_init', 'current_device'):\n"
        "    setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n))\n"
        "from ddpkit.train.loop.launcher import RANK_MAIN\n"
        "from ddpkit.distributed.local_processes import PRELOADED_WITH_TORCH\n"
        "import importlib\n"
        "for module in (RANK_MAIN.partition(':')[0], 'ddpkit.train.loop.bench', *PRELOADED_WITH_TORCH):\n"
        "    importlib.import_module(module)\n"
        "print(calls)\n"
    )
    printed = _python(code)
    assert printed.strip() == "[]", f"importing a worker's module touched CUDA: {printed}"


def _python(code: str) -> str:
    """What `code` printed, run in a fresh interpreter (which must succeed)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_failed_rank_is_named_and_its_traceback_printed_as_text_in_debug_mode(monkeypatch, capfd):
    monkeypatch.setenv("DDPKIT_DEBUG", "1")
    with pytest.raises(LaunchError, match="local process 1 failed: process 1 terminated with exit code 1"):
        spawn(f"{__name__}:fails_on_rank_one", 2, ("the reason rank 1 gave",))
    err = capfd.readouterr().err
    assert "Traceback" in err and "RuntimeError: the reason rank 1 gave" in err


def test_a_worker_is_a_function_or_its_name():
    assert resolve(f"{__name__}:fails_on_rank_one") is fails_on_rank_one
    assert resolve(fails_on_rank_one) is fails_on_rank_one
    with pytest.raises(ValueError, match=r"worker: expected a function or 'package\.module:function'"):
        resolve("no_colon_here")
