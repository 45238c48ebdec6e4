"""The lines ranks and launchers write to a shared stderr never mix."""

import os
import subprocess
import sys


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
