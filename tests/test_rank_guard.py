"""The lines ranks and launchers write to a shared stderr never mix; a launched rank arms its wake-up (the
parent-death signal SIGCONT) as soon as it imports ddpkit."""

import os
import signal
import subprocess
import sys

import pytest


def test_a_line_and_its_newline_go_out_in_one_write(tmp_path):
    """Under PYTHONUNBUFFERED (as the CLI tests run), print writes the text and the newline separately, and the
    launcher's last line landed between a stopping rank's two writes; `say` writes the whole line at once."""
    script = (
        "import os, sys\n"
        "from ddpkit.distributed import rank_guard\n"
        "real = os.write\n"
        "calls = []\n"
        "os.write = lambda fd, data: calls.append((fd, data)) or real(fd, data)\n"
        "rank_guard.say('ddpkit: rank 1: SIGTERM received; stopping')\n"
        "os.write = real\n"
        "print(repr(calls))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "ddpkit: rank 1: SIGTERM received; stopping\n"
    assert done.stdout.strip() == repr([(2, b"ddpkit: rank 1: SIGTERM received; stopping\n")])


# reads the parent-death signal back from the kernel (prctl PR_GET_PDEATHSIG) after importing ddpkit alone
_READ_PARENT_DEATH_SIGNAL = (
    "import ctypes, sys, ddpkit\n"
    "value = ctypes.c_int(0)\n"
    "assert ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0) == 0\n"
    "print(value.value, 'torch' in sys.modules)\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize(
    ("variables", "armed"),
    [
        ({"DDPKIT_LAUNCHER_PID": "parent"}, True),  # a rank ddpkit's launcher spawned
        ({"DDPKIT_LAUNCHER_PID": "1"}, False),  # a process that rank started in turn (inherited variable)
        ({"TORCHELASTIC_RUN_ID": "job", "LOCAL_RANK": "0"}, True),  # a torchrun worker
        ({}, False),  # a user's own process
    ],
)
def test_a_launched_rank_is_woken_when_its_launcher_dies_from_ddpkits_import(variables, armed):
    dropped = ("DDPKIT_LAUNCHER_PID", "TORCHELASTIC_RUN_ID", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env |= {k: str(os.getpid()) if v == "parent" else v for k, v in variables.items()}
    done = subprocess.run(
        [sys.executable, "-c", _READ_PARENT_DEATH_SIGNAL], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(int(signal.SIGCONT) if armed else 0), "False"], done.stdout
