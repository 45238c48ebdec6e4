"""Where a job cannot reach its store, the command says so in ddpkit's one line: a `--master-port` another process
already listens on (rank 0 cannot host the job's store: named with the flag that fixes it, at once, not torch's raw
EADDRINUSE text nor a wait for the join timeout), and a fault-tolerant rank whose store never answers (no C++ frames
of torch's store client before the line)."""

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


def test_a_fault_tolerant_rank_whose_store_never_answers_says_so_in_one_line(tmp_path):
    """No C++ log lines or frames of torch's store client before ddpkit's line, and no peer-timeout hint that
    does not apply (the store is not a peer)."""
    spare = socket.socket()
    spare.bind(("127.0.0.1", 0))
    port = spare.getsockname()[1]
    spare.close()  # (nothing listens there now)
    command = [sys.executable, "-m", "ddpkit", "train", "--fault-tolerant", "--nnodes", "2", "--node-rank", "1"]
    command += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    command += ["--timeout", "3", "--max-steps", "2", "--no-progress", "--out", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done
    assert "no fault-tolerant job's store answered" in done.stderr, done.stderr
    assert "frame #" not in done.stderr and "socket.cpp" not in done.stderr, done.stderr
    assert "a peer rank did not answer" not in done.stderr, done.stderr
