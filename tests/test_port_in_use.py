"""A `--master-port` another process already listens on: rank 0 cannot host the job's store, and the command
ends at once saying so and how to fix it (not torch's raw EADDRINUSE text, nor a wait for the join timeout)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def test_a_port_in_use_is_named_with_the_flag_that_fixes_it(tmp_path):
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    port = holder.getsockname()[1]
    command = [sys.executable, "-m", "ddpkit", "train", "--nproc-per-node", "2", "--master-port", str(port)]
    command += ["--max-steps", "2", "--no-progress", "--out", str(tmp_path / "out")]
    began = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert done.returncode == 1, done
    assert f"port {port} is already in use on this machine" in done.stderr, done.stderr
    assert "Pass --master-port with a free port" in done.stderr, done.stderr
    assert time.monotonic() - began < 50, "it waited for the join timeout"
