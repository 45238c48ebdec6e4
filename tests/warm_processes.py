"""Commands the tests start, forked from a warm interpreter instead of started cold.

A `ddpkit train` command costs about seven seconds of CPU before its first step on this project's machines, most
of it importing torch (and torch._dynamo, which every optimizer's constructor imports) in its fork server, and in a
fault-tolerant launcher once more. One helper process per pytest worker (the *warm interpreter*) imports those
modules once; each command a test starts is forked from it and then runs exactly as the command would: in its own
session, with the test's environment, working directory, arguments and import path, its output in the test's
files. Its fork server (multiprocessing's, which ddpkit's launcher starts for its ranks) is a spare the command
forked before it ran anything, instead of a fresh interpreter that imports torch again: still the command's child,
in its session, arming the launcher-death wake-up as ddpkit's import does in a launched fork server. So the process
tree, signals, exit statuses and every line of ddpkit's code are those of the real command; only the imports are
done. Under ``ip netns exec`` the command enters the namespace (and a mount namespace with its own /sys) itself.
One difference: glibc reads its settings when a process starts, so what a launcher puts in its ranks' environment for
glibc (``ddpkit train``'s huge pages for ``--strategy sharded``) reaches a cold command's ranks but not a warm one's,
whose spare fork server started before (tests/test_train_cli.py checks it on a cold command).

What cannot be served warm is started cold (`popen` decides): anything but ``ddpkit``/``python -m MODULE``/
``python SCRIPT``, and debug runs (torch reads its C++ logging settings at import). A test that is about a
command's own start-up passes ``warm=False``. Processes that a command starts by executing an interpreter
(torchrun's workers, Slurm's tasks) are cold.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ddpkit.distributed.local_processes import _name_process  # (imports no torch)

PRELOADED = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "numpy",
    "sklearn.datasets",
    "matplotlib",
    "matplotlib.pyplot",
    "ddpkit",
    "ddpkit.cli",
    "ddpkit.train.loop.run",
    "ddpkit.train.loop.bench",
    "ddpkit.fault_tolerance.manager",
)
"""What the warm interpreter imports before it forks commands: what a `ddpkit train` launcher, its fork server and
ranks import that costs seconds."""

COLD_VARIABLES = ("DDPKIT_DEBUG",)
"""Environment variables with which a command starts cold (they change what torch's import sets up)."""

QUIET_TORCH = {"TORCH_SHOW_CPP_STACKTRACES": "0", "TORCH_CPP_LOG_LEVEL": "ERROR"}
"""What ddpkit's launcher sets before its ranks import torch outside debug mode: the warm interpreter imports torch
with the same settings."""

DDPKIT_SCRIPT = shutil.which("ddpkit")


# ----------------------------------------------------------------------------------------------- the test side


class Command:
    """A command started by `popen`: `subprocess.Popen`'s pid, args, returncode, poll, wait, communicate,
    send_signal, terminate and kill. Forked warm, its exit status comes from the warm interpreter (its parent);
    started cold, from the `subprocess.Popen` it holds."""

    def __init__(self, args: list[str], stdout: Path, stderr: Path, pid: int, connection: Any = None, cold: Any = None):
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._files = (stdout, stderr)
        self._connection = connection
        self._cold = cold

    @property
    def warm(self) -> bool:
        return self._cold is None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._finish(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._finish(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Waits (as `wait`) and returns what the command wrote to its stdout file and, if another, its stderr
        file."""
        self.wait(timeout)
        stdout, stderr = self._files
        err = None if stderr == stdout else Path(stderr).read_text(errors="replace")
        return Path(stdout).read_text(errors="replace"), err

    def output(self) -> str:
        """What the command has written to its stdout file so far."""
        return Path(self._files[0]).read_text(errors="replace")

    def _finish(self, timeout: float | None) -> bool:
        if self._cold is not None:
            try:
                self.returncode = self._cold.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        self._connection.settimeout(timeout)
        try:
            data = self._connection.recv(64)
        except (TimeoutError, BlockingIOError):
            return False
        self.returncode = int(data.decode().strip()) if data else -999
        self._connection.close()
        return True

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # once reaped, the pid may be another process's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_servers: dict[tuple[str, ...], str] = {}


def _warm_address(extra: tuple[str, ...] = ()) -> str:
    """The socket of the warm interpreter that has `PRELOADED` and `extra` imported, started on first use; it
    ends with this process (it reads its stdin)."""
    if extra not in _servers:
        folder = tempfile.mkdtemp(prefix="ddpkit-warm-")
        atexit.register(shutil.rmtree, folder, True)
        address = os.path.join(folder, "socket")
        environment = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", *COLD_VARIABLES)}
        environment.update(QUIET_TORCH)
        process = subprocess.Popen(
            [sys.executable, __file__, address, *extra], stdin=subprocess.PIPE, env=environment, start_new_session=True
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(address + ".ready"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm interpreter did not start (exit {process.poll()})")
            time.sleep(0.05)
        _servers[extra] = address
        _processes.append(process)
    return _servers[extra]


_processes: list[subprocess.Popen] = []  # (held: their stdin closes when this process ends)


def _warm_command(args: list[str]) -> dict[str, Any] | None:
    """What the warm interpreter runs for `args` (a module, a script or ddpkit's console script, each perhaps
    after ``ip netns exec NAMESPACE``), or None."""
    if args[:3] == ["ip", "netns", "exec"] and len(args) > 4:
        inner = _warm_command(args[4:])
        return None if inner is None else {**inner, "netns": args[3]}
    if args and DDPKIT_SCRIPT and args[0] == DDPKIT_SCRIPT:
        return {"module": "ddpkit", "argv": [args[0], *args[1:]], "path0": os.path.dirname(args[0])}
    if len(args) >= 3 and args[0] == sys.executable and args[1] == "-m":
        return {"module": args[2], "argv": [args[2], *args[3:]], "path0": None}
    if len(args) >= 2 and args[0] == sys.executable and args[1].endswith(".py"):
        return {"script": args[1], "argv": args[1:], "path0": os.path.dirname(os.path.abspath(args[1]))}
    return None


def popen(
    args: list[Any],
    stdout: str | Path,
    stderr: str | Path,
    env: dict[str, str],
    cwd: str | Path,
    warm: bool = True,
    preload: tuple[str, ...] = (),
) -> Command:
    """Starts `args` in a new session with `env` in `cwd`, its output appended to the files `stdout` and `stderr`
    (which may be one file): forked from the warm interpreter where it can be (`warm`), else as `subprocess.Popen`
    starts it. A warm command's interpreter has `PRELOADED` and `preload` imported."""
    args = [str(a) for a in args]
    stdout, stderr = Path(stdout), Path(stderr)
    command = _warm_command(args) if warm else None
    debug = "--debug" in args or any(env.get(name) not in (None, "", "0") for name in COLD_VARIABLES)
    if command is None or debug:
        with open(stdout, "ab") as out, open(stderr, "ab") as err:
            cold = subprocess.Popen(args, stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True)
        return Command(args, stdout, stderr, cold.pid, cold=cold)
    for path in (stdout, stderr):
        open(path, "ab").close()  # (there, as a cold command's are, when this returns)
    request = {**command, "env": env, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
    connection = socket.socket(socket.AF_UNIX)
    connection.connect(_warm_address(tuple(preload)))
    connection.sendall(json.dumps(request).encode() + b"\n")
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = connection.recv(64)
        if not chunk:
            raise RuntimeError("the warm interpreter closed the connection before starting the command")
        reply += chunk
    return Command(args, stdout, stderr, int(reply), connection=connection)


def run(args: list[Any], env: dict[str, str], cwd: str | Path, timeout: float, warm: bool = True) -> Any:
    """Runs `args` to its end as `subprocess.run(..., capture_output=True, text=True, timeout=...)` does (killed
    at `timeout`, then TimeoutExpired); forked warm where it can be."""
    folder = Path(tempfile.mkdtemp(prefix="ddpkit-run-"))
    try:
        command = popen(args, folder / "out", folder / "err", env, cwd, warm)
        try:
            out, err = command.communicate(timeout)
        except subprocess.TimeoutExpired:
            command.kill()
            command.wait(30)
            raise
        return subprocess.CompletedProcess(command.args, command.returncode, out, err)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------------- the warm interpreter's side


def _serve(address: str, extra: list[str]) -> None:
    """Imports `PRELOADED` and `extra`, then forks one command per connection to `address` and reports its exit
    status on it; ends when its stdin closes (the test process ended)."""
    import importlib

    for name in (*PRELOADED, *extra):
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(64)
    Path(address + ".ready").touch()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    running: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 1024):
                    os._exit(0)
            elif key.data == "accept":
                connection, _ = listener.accept()
                request = json.loads(_read_line(connection))
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for held in (listener, connection, *running.values()):
                        held.close()
                    _run(request)  # never returns
                connection.sendall(f"{pid}\n".encode())
                running[pid] = connection
        _reap(running)


def _read_line(connection: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data.decode()


def _reap(running: dict[int, socket.socket]) -> None:
    """Sends the exit status of each ended command (as `subprocess.Popen.returncode` gives it) to its test."""
    for pid in list(running):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 255 << 8
        if done:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            connection = running.pop(pid)
            try:
                connection.sendall(f"{code}\n".encode())
            except OSError:
                pass
            connection.close()


def _run(request: dict[str, Any]) -> None:
    """In the forked child: becomes the requested command (session, directory, environment, output, arguments,
    import path) and runs it as the interpreter would, then exits with its status."""
    code = 1
    try:
        try:
            _become_the_command(request)
        except BaseException:  # (an error of this module's, not the command's: said in the command's stderr file)
            import traceback

            with open(request["stderr"], "a") as err:
                err.write(f"tests/warm_processes.py could not start the command:\n{traceback.format_exc()}")
            raise
        code = _main(request)
    finally:
        _exit(code)


def _become_the_command(request: dict[str, Any]) -> None:
    """Everything but running it: session, namespace, directory, output, environment, import path, arguments."""
    os.setsid()
    if "netns" in request:
        _enter_network_namespace(request["netns"])
    os.chdir(request["cwd"])
    _redirect(request["stdout"], request["stderr"])
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in pythonpath]
    os.environ.clear()
    os.environ.update(request["env"])
    wanted = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["path0"] or os.getcwd(), *wanted, *base]
    sys.argv[:] = request["argv"]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _threads_as_at_load()
    _fork_helpers_instead_of_starting_them()


def _threads_as_at_load() -> None:
    """OMP_NUM_THREADS as torch's OpenMP runtime reads it when it loads (in a fresh interpreter, after the command
    set it): the warm interpreter loaded it without. Sets the count only; no thread starts here."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def join_network_namespace(name: str) -> None:
    """Moves the calling thread into the network namespace ``ip netns`` calls `name` (what ``ip netns exec`` does
    first; the sockets the thread opens afterwards live there)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the network namespace {name}")
    finally:
        os.close(fd)


CLONE_NEWNET = 0x40000000


def _enter_network_namespace(name: str) -> None:
    """What ``ip netns exec NAME`` does before it runs a command: moves this process into the network namespace
    ``ip netns`` calls `name`, and into a mount namespace of its own where /sys is mounted again, so that
    /sys/class/net shows that namespace's interfaces (the probes read their byte counters there). Its bind mounts of
    /etc/netns/NAME files no command here needs."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_slave, mnt_detach = 0x00020000, 0x4000, 0x80000, 2

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what} for the network namespace {name}")

    join_network_namespace(name)
    check(libc.unshare(clone_newns), "unshare of the mount namespace")
    check(libc.mount(b"none", b"/", None, ms_rec | ms_slave, None), "making / a slave mount")
    check(libc.umount2(b"/sys", mnt_detach), "unmounting /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mounting /sys")


def _redirect(stdout: str, stderr: str) -> None:
    import io

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(target, fd)
        os.close(target)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        open(1, "wb", buffering=0 if unbuffered else -1, closefd=False), write_through=unbuffered
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False), errors="backslashreplace", write_through=True
    )


def _main(request: dict[str, Any]) -> int:
    """Runs the command's module or script as ``__main__``; its exit status as the interpreter would give it
    (an uncaught KeyboardInterrupt ends the process by SIGINT, as Python does)."""
    import runpy

    try:
        if "module" in request:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(request["script"], run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())  # (what the interpreter calls: a program may have replaced it)
        return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _exit(code: int) -> None:
    """Ends the process as the interpreter's shutdown would: non-daemon threads joined, atexit handlers run,
    output flushed."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        _flush()
        os._exit(code)


FORK_SERVER = "from multiprocessing.forkserver import main"
RESOURCE_TRACKER = "from multiprocessing.resource_tracker import main"


def _fork_helpers_instead_of_starting_them() -> None:
    """Makes multiprocessing fork its fork server and resource tracker instead of starting fresh interpreters that
    import everything again; each then runs the same code.

    The fork server comes from a spare forked now, before the command runs anything: forked later from the command,
    it would carry the command's torch thread pools (a fault-tolerant launcher computes), with which its forked
    ranks hang at their first parallel operation. The spare waits for the fork server's descriptors and the
    command's environment as it is then (with the launcher's pid), and ends if the command ends without one. The
    resource tracker, which runs no torch, is forked from the command when it is needed."""
    from multiprocessing import util

    start = util.spawnv_passfds
    spare, spare_pid = _fork_spare()

    def spawn(path: str, args: list[str], passfds: Any) -> int:
        nonlocal spare
        code = args[args.index("-c") + 1] if "-c" in args else ""
        if code.startswith(FORK_SERVER) and spare is not None:
            request = json.dumps({"code": code, "fds": list(passfds), "env": dict(os.environ)}).encode()
            socket.send_fds(spare, [request], list(passfds))
            spare.close()
            spare = None
            return spare_pid
        if not code.startswith(RESOURCE_TRACKER):
            return start(path, args, passfds)
        pid = os.fork()
        if pid == 0:
            _close_all_but({0, 1, 2, *passfds})
            _exec_helper(code)
        return pid

    util.spawnv_passfds = spawn


def _fork_spare() -> tuple[socket.socket, int]:
    """Forks the process that becomes the command's fork server; returns the socket that reaches it and its pid."""
    here, there = socket.socketpair()
    own_name = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    _name_process(SPARE_NAME)  # before the fork: the spare is never seen under the command's name
    pid = os.fork()
    if pid == 0:
        here.close()
        _become_fork_server(there)
    _name_process(own_name)
    there.close()
    return here, pid


def _become_fork_server(connection: socket.socket) -> None:
    """The spare's life: receives the fork server's code, descriptors and environment, puts each descriptor at the
    number the code names, and runs it as a fresh fork server would (ddpkit's import there arms the launcher-death
    wake-up: armed here the same way). Ends at once if the command ended first."""
    try:
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 16)
    except OSError:
        message, fds = b"", []
    if not message:
        os._exit(0)
    request = json.loads(message)
    _name_process(FORK_SERVER_NAME)
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000 + i) for i, fd in enumerate(fds)]
    _close_all_but({0, 1, 2, *high})
    for parked, wanted in zip(high, request["fds"], strict=True):
        os.dup2(parked, wanted)
        os.close(parked)
    os.environ.clear()
    os.environ.update(request["env"])
    import ddpkit

    ddpkit._wake_when_launcher_dies()
    _exec_helper(request["code"])


SPARE_NAME = "warm-spare"
"""The name (``ps``, /proc/PID/comm) of a spare until it becomes a fork server: not a process the command started
(tests that look for what a command started leave it out)."""
FORK_SERVER_NAME = os.path.basename(sys.executable)[:15]
"""A fork server's name, as a fresh interpreter's would be."""


def is_spare(pid: int) -> bool:
    """Whether process `pid` is a spare (not a process the command started)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == SPARE_NAME
    except OSError:
        return False


def _exec_helper(code: str) -> None:
    """Runs a multiprocessing helper's ``-c`` code as ``__main__`` and exits with its status."""
    status = 0
    try:
        exec(code, {"__name__": "__main__"})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        _flush()
        os._exit(status)


def _close_all_but(keep: set[int]) -> None:
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
