"""The tests' warm interpreter (tests/warm_processes.py) runs a command as a fresh interpreter would: what the
command sees (arguments, working directory, environment, import path, its own session), what it leaves (output,
exit status, death by a signal) and the process tree of a `ddpkit train` launcher (its fork server its child, in
its session, its ranks below that), each compared with the same command started cold."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import warm_processes
from test_train_cli import _env, _proc_table, descendants

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "marker": os.environ.get("WARM_TEST_MARKER"),
                  "path": sys.path[:2], "session": os.getsid(0) == os.getpid(), "name": __name__,
                  "mod": __import__("warm_helper_module").VALUE, "threads": __import__("torch").get_num_threads()}))
sys.stdout.flush()
mode = sys.argv[1]
if mode == "exit":
    sys.exit(3)
if mode == "raise":
    raise ValueError("raised on purpose")
if mode == "wait":
    import time
    time.sleep(60)
"""


@pytest.fixture
def script(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "warm_helper_module.py").write_text("VALUE = 'from PYTHONPATH'\n")
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def _start(script: Path, mode: str, warm: bool, tmp_path: Path) -> warm_processes.Command:
    env = _env(WARM_TEST_MARKER="set", PYTHONPATH=str(tmp_path / "lib"), OMP_NUM_THREADS="1")
    name = f"{mode}-{'warm' if warm else 'cold'}"
    return warm_processes.popen(
        [sys.executable, script, mode, "x y"], tmp_path / f"{name}.out", tmp_path / f"{name}.err", env, tmp_path, warm
    )


@pytest.mark.parametrize("mode", ["ok", "exit", "raise"])
def test_a_warm_command_sees_and_leaves_what_a_cold_one_does(tmp_path, script, mode):
    seen = {}
    for warm in (True, False):
        command = _start(script, mode, warm, tmp_path)
        assert command.warm == warm
        out, err = command.communicate(60)
        seen[warm] = (command.returncode, json.loads(out), "ValueError: raised on purpose" in err)
    assert seen[True] == seen[False]
    code, printed, raised = seen[True]
    assert code == {"ok": 0, "exit": 3, "raise": 1}[mode] and raised == (mode == "raise")
    assert printed["argv"] == [mode, "x y"] and printed["cwd"] == str(tmp_path) and printed["marker"] == "set"
    assert printed["path"] == [str(tmp_path), str(tmp_path / "lib")] and printed["session"]
    assert printed["name"] == "__main__" and printed["mod"] == "from PYTHONPATH" and printed["threads"] == 1


def test_a_warm_command_killed_by_a_signal_reports_it_as_popen_does(tmp_path, script):
    command = _start(script, "wait", True, tmp_path)
    deadline = time.monotonic() + 60
    while not command.output():
        assert time.monotonic() < deadline and command.poll() is None
        time.sleep(0.05)
    command.send_signal(signal.SIGKILL)
    assert command.wait(30) == -signal.SIGKILL


def test_a_warm_launchers_fork_server_and_ranks_are_its_descendants_in_its_session(tmp_path):
    """The process tree a test inspects (ranks found below the launcher, the session killed whole) is the cold
    command's: the fork server is the launcher's child, not the warm interpreter's."""
    hold = tmp_path / "hold"
    hold.touch()
    env = _env(PYTHONPATH=str(Path(__file__).parent), DDPKIT_TEST_HOLD_FILE=str(hold))
    words = ["train", "--model", "ft_factories:slow_mlp", "--nproc-per-node", "2", "--max-steps", "3"]
    words += ["--no-progress", "--out", tmp_path / "out"]
    command = warm_processes.popen(
        [sys.executable, "-m", "ddpkit", *words], tmp_path / "out.txt", tmp_path / "err.txt", env, tmp_path
    )
    try:
        deadline = time.monotonic() + 120
        while len(ranks := _ranks(command.pid)) < 2:
            assert command.poll() is None and time.monotonic() < deadline, (tmp_path / "err.txt").read_text()
            time.sleep(0.1)
        sessions = {os.getsid(pid) for pid in [command.pid, *ranks]}
        assert sessions == {command.pid}
    finally:
        hold.unlink()
    assert command.wait(120) == 0, (tmp_path / "err.txt").read_text()


def _ranks(launcher: int) -> list[int]:
    table = _proc_table()
    return [pid for pid in descendants(launcher, table) if table[pid][4].startswith("ddpkit-local-")]
