"""Starting a job: who am I (torchrun's environment, Slurm's or spawn arguments), joining with a timeout, leaving.

Importing it loads no torch (the launcher of `ddpkit train` spawns its ranks without it); the functions that talk
to torch import it when called. Starting, watching and stopping the local processes: `local_processes`.
"""

from __future__ import annotations

import atexit
import errno
import gc
import os
import random
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from ddpkit.distributed.rank_guard import say

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(RuntimeError):
    """The job could not start or a process failed; the message says what to check."""


@dataclass
class Placement:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def from_torchrun() -> Placement | None:
    """This process's placement when torchrun (or any launcher setting its variables) started it, else None."""
    if not all(name in os.environ for name in TORCHRUN_VARIABLES):
        return None
    env = os.environ
    return Placement(
        int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), env["MASTER_ADDR"], int(env["MASTER_PORT"])
    )


SLURM_DEFAULT_PORT_BASE = 15000  # the port every task derives from the job id (Lightning's rule), without MASTER_PORT


def from_slurm(master_port: int | None = None) -> Placement | None:
    """This process's placement when ``srun`` started it as one task of a job step of several tasks (one task
    per rank), read from the variables srun sets for its tasks, else None: rank ``SLURM_PROCID`` of
    ``SLURM_STEP_NUM_TASKS``, local rank ``SLURM_LOCALID``; the master is ``MASTER_ADDR`` or the first node of
    the step's node list, the port `master_port` (``--master-port``), else ``MASTER_PORT``, else 15000 plus the
    job id's last four digits (the same on every task). An interactive allocation's shell (``SLURM_JOB_NAME``
    bash or interactive) or a single task is not taken as the job's layout: ``ddpkit train`` then starts its own
    ranks. The torchrun variables are exported for what reads them (threads, the ledger), as torchrun would."""
    env = os.environ
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1)  # set by srun for its tasks, not in an sbatch script
    if "SLURM_PROCID" not in env or tasks < 2 or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    if master_port is None:
        job = env.get("SLURM_JOB_ID", "")
        master_port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else SLURM_DEFAULT_PORT_BASE + int(job[-4:] or 0)
    exported = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(tasks // nodes if tasks % nodes == 0 else 1),
        "GROUP_RANK": env.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": str(master_port),
    }
    env.update(exported)
    return from_torchrun()


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``node[07-09,12],gpu1`` -> ``node07``."""
    match = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    return prefix if ranges is None else prefix + re.split(r"[-,]", ranges)[0]


def rejoin_blocked_note() -> str | None:
    """Why a machine that leaves this elastic torchrun job could not come back, or None.

    With torchrun's default of sharing its rendezvous TCPStore with the workers, an agent that stays rank 0 across
    rendezvous rounds keeps the store address of the first round and never publishes it for the next one, so an
    agent that comes back waits for it until it times out (seen with torch 2.13; a job that only loses machines is
    not affected). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on every machine makes each round publish its own."""
    env = os.environ
    elastic = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
    shared_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if not (elastic and shared_store):
        return None
    return (
        "a machine that leaves this elastic job cannot rejoin it while torchrun shares its rendezvous store with "
        "the workers; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment of torchrun on every machine"
    )


def pick_backend(requested: str, local_processes: int = 1, device: str = "auto") -> str:
    """``auto``: NCCL when CUDA is present with a GPU for each of the `local_processes` (NCCL refuses two ranks on
    one GPU) and `device` is not ``"cpu"``, else gloo."""
    if requested == "auto":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "nccl" if device != "cpu" and gpus >= local_processes else "gloo"
    return requested


_PORTS_GIVEN: set[int] = set()
_PORT_CHOOSER = random.SystemRandom()  # the OS's randomness: forked processes and seeded scripts still differ


def free_port() -> int:
    """A TCP port for a single-machine job's rendezvous, free on every address now and likely still free later.

    Rank 0 binds it seconds after it is chosen (once torch is imported). A port from the kernel's ephemeral range
    could be handed to any outgoing connection meanwhile (gloo opens many) and rank 0 would fail with "address
    already in use". So the port is drawn at random below that range, where the kernel never assigns ports by
    itself, and below 30000 (Kubernetes' NodePorts, 30000-32767, are redirected without being bound), avoiding
    torchrun's 29400-29599 and ports this process gave out before. If none is free there, the kernel picks one.
    """
    top = min(_ephemeral_range_start(), 30000)
    candidates = [p for p in range(max(1024, top - 8192), top) if not 29400 <= p < 29600 and p not in _PORTS_GIVEN]
    for port in _PORT_CHOOSER.sample(candidates, min(len(candidates), 100)):
        if _bindable_everywhere(port):
            _PORTS_GIVEN.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere only a guess


def _bindable_everywhere(port: int) -> bool:
    """Whether `port` can be bound on the IPv4 and IPv6 wildcard addresses (torch's TCPStore listens on both)."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE or family == socket.AF_INET:
                return False  # in use, or no IPv4 at all; a host without IPv6 only needs IPv4
    return True


JOIN_GRACE_SECONDS = 5.0
"""How long past `timeout` a join may take before the watchdog ends the process (torch's own retries overshoot)."""


def route_source_address(host: str, port: int) -> str | None:
    """The local address this machine sends from to reach `host` (a UDP connect: no packet is sent), or None."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_with_address(address: str) -> str | None:
    """The name of the network interface holding the IPv4 `address` (Linux), or None."""
    return next((name for name, held in _ipv4_addresses().items() if held == address), None)


def interface_address(name: str) -> str | None:
    """The IPv4 address of the network interface `name` (Linux), or None."""
    return _ipv4_addresses().get(name)


def _ipv4_addresses() -> dict[str, str]:
    """Each network interface's IPv4 address, by interface name (Linux; those without one are left out)."""
    found: dict[str, str] = {}
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue  # no IPv4 address on this interface
                found[name] = socket.inet_ntoa(raw[20:24])
    except (ImportError, OSError):
        return found
    return found


def choose_gloo_interface(master_addr: str, master_port: int) -> str | None:
    """Points gloo at the interface that routes to the master, unless GLOO_SOCKET_IFNAME is already set.

    By default gloo advertises the address this machine's hostname resolves to, which on many machines and in
    containers is 127.0.0.1 (``/etc/hosts``): peers on other machines then cannot connect, and the join only
    fails after gloo's connect timeout (five times the process-group timeout). Returns the interface used.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    source = route_source_address(master_addr, master_port)
    name = interface_with_address(source) if source else None
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name  # read by ProcessGroupGloo when the group is created
    return name


def _join_failure(placement: Placement, timeout: float, reason: str) -> str:
    where = f"{placement.master_addr}:{placement.master_port}"
    if "EADDRINUSE" in reason or "address already in use" in reason:  # (rank 0 could not listen: no wait involved)
        return (
            f"rank {placement.rank} could not host the job at {where}: port {placement.master_port} "
            "is already in use on this machine (another job, or one that has not ended yet). Pass --master-port "
            "with a free port (the same on every machine), or stop the process that holds it."
        )
    return (
        f"rank {placement.rank} could not join the job at {where} within {timeout:g} s: {reason.rstrip('.')}. "
        "Check that the master (rank 0 / node rank 0) runs, that --master-addr/--host is its address as seen "
        "from here, that the port is open, and that every process was given the same world size."
    )


def join(placement: Placement, backend: str, timeout: float, *, multi_node: bool = False) -> None:
    """Joins the process group; fails with a clear LaunchError after `timeout` seconds instead of hanging.

    `timeout` also bounds every later collective: if a rank dies or stops answering, the others fail with an
    error instead of waiting forever. A join that torch itself lets run longer (gloo waits up to five times the
    timeout for a peer's connection) is ended by a watchdog `JOIN_GRACE_SECONDS` after the timeout, with the same
    message and exit code 1. With `multi_node` (the job spans machines) gloo uses the interface that routes to the
    master unless GLOO_SOCKET_IFNAME says otherwise.
    """
    import torch.distributed as dist

    interface = choose_gloo_interface(placement.master_addr, placement.master_port) if multi_node else None
    where = f" (gloo on interface {interface})" if interface and backend == "gloo" else ""
    joined = threading.Event()

    def watchdog() -> None:
        if not joined.wait(timeout + JOIN_GRACE_SECONDS):
            reason = f"not every peer connected{where}"
            say(f"ddpkit: {_join_failure(placement, timeout, reason)}")
            os._exit(1)  # the stuck call inside torch cannot be interrupted

    threading.Thread(target=watchdog, name="ddpkit-join-watchdog", daemon=True).start()
    try:
        dist.init_process_group(
            process_group_backends(backend),
            init_method=f"tcp://{placement.master_addr}:{placement.master_port}",
            rank=placement.rank,
            world_size=placement.world_size,
            timeout=timedelta(seconds=timeout),
        )
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise LaunchError(_join_failure(placement, timeout, f"{type(exc).__name__}: {first}{where}")) from exc
    finally:
        joined.set()


def process_group_backends(backend: str) -> str:
    """The backend string the job's process group is made with: NCCL for CUDA tensors always comes with gloo for
    CPU tensors ("cpu:gloo,cuda:nccl"), so the job's small control messages (settings agreement, metrics, object
    broadcasts) work whatever device they live on; gloo alone takes both."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def leave() -> None:
    """Leaves the process group; objects that still reference it (a DDP reducer in a reference cycle) are
    collected first, so they do not outlive it. (With torch 2.13 a destroyed default group may still live on, kept
    by ``torch.distributed.nn.functional``'s default arguments; `quiesce` covers the exit then.)"""
    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


QUIET_FOR_SECONDS = 0.02
"""How long gloo's worker threads must stay asleep before the interpreter's teardown may begin (`quiesce`)."""
QUIESCE_LIMIT_SECONDS = 1.0
"""The most `quiesce` waits at exit; where it cannot see the threads (no /proc), it waits `QUIET_FOR_SECONDS`."""
_QUIESCING: list[bool] = []  # whether `quiesce_at_exit` registered `quiesce` in this process


def quiesce_at_exit() -> None:
    """Runs `quiesce` when the interpreter exits normally, before its teardown (an ``atexit`` handler, registered
    once). ddpkit's optimizers and wrappers call it when they are built."""
    if not _QUIESCING:
        _QUIESCING.append(True)
        atexit.register(quiesce)


def quiesce(limit: float = QUIESCE_LIMIT_SECONDS) -> None:
    """Lets gloo's worker threads finish with the GIL free, so that none of them is still busy when the interpreter's
    teardown begins; at most `limit` seconds.

    The abort at exit ("terminate called without an active exception", SIGABRT, after every output was written)
    comes from there: a gloo worker thread drops its collective once done; where Python already let go of the
    collective's tensors (a temporary, a handle not kept), the last reference is the worker's, which must take the
    GIL to free them. Once the interpreter's teardown has begun, a thread that takes the GIL is ended on the spot,
    inside a C++ destructor, and the C++ runtime aborts the process (seen in the core dumps of such aborts). The
    workers outlive the script whenever their process group does: one the script did not destroy, one still held
    (a wrapper in a reference cycle, collected only in the teardown), and with torch 2.13 even a destroyed default
    group once an optimizer was built after `init_process_group` (``torch.distributed.nn.functional``, imported
    then, keeps the group as its functions' default argument until the teardown). So first leftover reference
    cycles are collected (a group no longer held is destroyed now, its workers joined), then this waits, with the
    GIL released, until every gloo worker thread has been asleep for `QUIET_FOR_SECONDS`. A collective a rank
    started and never waited for, still waiting for a peer when the script ends, is not covered.

    Args:
        limit: the most seconds it waits.

    Example:
        >>> from ddpkit.distributed.launch import quiesce
        >>> quiesce()  # the last line of a script that trains with torch's DDP alone (ddpkit's objects register it)
    """
    gc.collect()
    quiet_since = time.monotonic()
    deadline = quiet_since + limit
    while True:
        time.sleep(QUIET_FOR_SECONDS / 4)  # the GIL is free meanwhile
        now = time.monotonic()
        if _gloo_workers_busy():
            quiet_since = now
        if now - quiet_since >= QUIET_FOR_SECONDS or now >= deadline:
            return


def _gloo_workers_busy() -> bool:
    """Whether one of gloo's worker threads in this process (``pt_gloo_runloop``) is running or waiting to run
    (Linux ``/proc``); False where that cannot be read."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name, _, rest = stat.partition("(")[2].rpartition(")")
        if name.startswith("pt_gloo") and rest.split()[:1] == ["R"]:
            return True
    return False


def exit_without_teardown() -> NoReturn:
    """Ends a spawned rank that finished its work (results written, group left) with exit code 0, skipping the
    interpreter's teardown. At that teardown torch 2.13's C++ objects of a gloo job now and then abort the process
    ("terminate called without an active exception", SIGABRT: about 1 run in 60 of `ddpkit train`, after every
    output was written), which would fail a job that succeeded. Output streams are flushed first; files are
    closed (and checkpoints synced) by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def debug_mode() -> bool:
    """Whether DDPKIT_DEBUG asks for tracebacks and torch's C++ stack traces (``ddpkit train --debug`` sets it)."""
    return os.environ.get("DDPKIT_DEBUG", "") not in ("", "0")


def quiet_torch_errors() -> None:
    """Outside debug mode, torch's errors carry no C++ stack trace and its C++ logging shows errors only, so that
    ddpkit's one-line cause is not buried; set before the ranks import torch (they inherit the environment)."""
    if not debug_mode():
        os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "0")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


_SOURCE_PREFIX = re.compile(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*|Got the following error when running the callback: ")


def explain_failure(exc: BaseException, timeout: float) -> str:
    """One line: the exception's type and first line without torch's source location, and what it means when a
    collective failed because a peer stopped answering or vanished."""
    text = str(exc).strip()
    first = _SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else ""
    first = re.sub(r"\s*GLHF!.*$|\s*This is typically caused by.*$", "", first)
    name = type(exc).__name__
    first = first.removeprefix(f"{name}: ")
    cause = f"{name}: {first}" if first else name
    if isinstance(exc, LaunchError):
        return cause  # (ddpkit's own message says what it means)
    if re.search(r"[Tt]imed? ?out", first):
        return f"{cause} (a peer rank did not answer within --timeout {timeout:g} s: stopped, hung or unreachable)"
    from ddpkit.distributed.ledger import PEER_GONE

    if PEER_GONE.search(first):
        return f"{cause} (a peer rank ended: killed, crashed or its machine is gone)"
    return cause


def report_and_exit(exc: BaseException) -> None:
    """Prints a one-line reason (the traceback only with DDPKIT_DEBUG=1) and exits non-zero."""
    if os.environ.get("DDPKIT_DEBUG"):
        raise exc
    say(f"ddpkit: error: {exc}")
    sys.exit(1)
