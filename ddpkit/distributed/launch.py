"""Starting a job: who am I (torchrun's environment or spawn arguments), joining with a timeout, local spawning."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def pick_backend(requested: str) -> str:
    """``auto``: NCCL when CUDA is present, else gloo."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


def free_port() -> int:
    """A TCP port nobody listens on right now (for single-machine jobs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join(placement: Placement, backend: str, timeout: float) -> None:
    """Joins the process group; fails with a clear LaunchError after `timeout` seconds instead of hanging.

    `timeout` also bounds every later collective: if a rank dies or stops answering, the others fail with an
    error instead of waiting forever.
    """
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{placement.master_addr}:{placement.master_port}",
            rank=placement.rank,
            world_size=placement.world_size,
            timeout=timedelta(seconds=timeout),
        )
    except Exception as exc:
        raise LaunchError(
            f"rank {placement.rank} could not join the job at {placement.master_addr}:{placement.master_port} "
            f"within {timeout:.0f} s: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
            "Check that the master (rank 0 / node rank 0) runs, that --master-addr/--host is its address as seen "
            "from here, that the port is open, and that every process was given the same world size."
        ) from exc


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(worker: Callable[..., Any], nprocs: int, args: tuple) -> None:
    """Runs ``worker(local_rank, *args)`` in `nprocs` spawned processes and waits for all of them.

    If one fails, the others are stopped and a LaunchError names it; Ctrl-C stops every local process.
    """
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not context.join():
            pass
    except KeyboardInterrupt:
        _stop(context.processes)
        raise
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        _stop(context.processes)
        raise LaunchError(_describe_failure(exc)) from None


def _stop(processes: list[Any]) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=10)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)


def _describe_failure(exc: Exception) -> str:
    text = str(exc).strip()
    last = text.splitlines()[-1] if text else type(exc).__name__
    index = getattr(exc, "error_index", "?")
    return f"local process {index} failed: {last}"


def report_and_exit(exc: BaseException) -> None:
    """Prints a one-line reason (the traceback only with DDPKIT_DEBUG=1) and exits non-zero."""
    if os.environ.get("DDPKIT_DEBUG"):
        raise exc
    print(f"ddpkit: error: {exc}", file=sys.stderr, flush=True)
    sys.exit(1)
