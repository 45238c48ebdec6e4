"""The launcher's local processes (`ddpkit.distributed.local_processes`): started without torch in the launcher,
a failure named with its traceback as text, a worker given by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddpkit.distributed.launch import LaunchError
from ddpkit.distributed.local_processes import resolve, spawn


def fails_on_rank_one(index: int, message: str) -> None:
    """A worker for `spawn`: rank 1 raises, rank 0 returns."""
    if index == 1:
        raise RuntimeError(message)


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
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("0 "), f"the launcher imported torch: {done.stdout}"


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
