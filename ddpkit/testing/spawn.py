"""Run a function on N ranks in spawned processes, with a timeout and the failing rank's traceback.

`run_distributed(fn, world_size, *args)` calls ``fn(rank, world_size, *args)`` on every rank of a gloo job and
returns the per-rank results. The ranks are forked by multiprocessing's fork server, which imports torch once (a
fresh interpreter per rank imported it again, seconds each), and take the caller's environment as it is at the
call. They are kept in a pool per (world size, backend) and reused by the next call; a call that fails in a way that
may leave ranks stuck in a collective (one rank raised while others did not return, a timeout, a dead process)
discards the pool, and the next call spawns a fresh one. ``fresh=True`` always uses new processes, and
``init=False`` leaves the process group uninitialised (to test what happens without one).

``device="cuda"`` places the ranks on GPUs before the group is made: rank r uses GPU ``r % torch.cuda.device_count()``,
so on one GPU every rank of a gloo job shares ``cuda:0`` (NCCL refuses two ranks on one GPU: with ``backend="nccl"``
the world size must not exceed the number of GPUs). Inside `fn`, `rank_device()` names the rank's device.

`fn` must be picklable: a module-level function.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from ddpkit.distributed.local_processes import adopt_environment, start_context

_GRACE_SECONDS = 10.0


class RemoteTraceback(Exception):
    """Carries the formatted traceback of the rank that failed; raised as the `__cause__` of its error."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


class DistributedTimeout(TimeoutError):
    """Some ranks did not finish within the timeout."""


_DEVICE_ENV = "DDPKIT_RANK_DEVICE"


def rank_device() -> torch.device:
    """The device `run_distributed` placed this rank on (``cpu`` unless it was called with ``device="cuda"``)."""
    return torch.device(os.environ.get(_DEVICE_ENV, "cpu"))


def _worker(
    rank: int,
    world_size: int,
    init_file: str | None,
    backend: str,
    pg_timeout: float,
    tasks: Any,
    results: Any,
    device: str,
    environment: dict[str, str],
) -> None:
    import torch.distributed as dist

    adopt_environment(environment)
    torch.set_num_threads(1)  # N ranks share few cores; avoid oversubscription
    os.environ.setdefault("LOCAL_RANK", str(rank))
    if device == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        os.environ[_DEVICE_ENV] = f"cuda:{index}"
    if init_file is not None:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args = task
        try:
            results.put((task_id, rank, True, fn(rank, world_size, *args), None))
        except BaseException as exc:  # reported to the parent, which re-raises it
            text = traceback.format_exc()
            try:
                pickle.dumps(exc)
            except Exception:
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            results.put((task_id, rank, False, exc, text))
    if dist.is_initialized():
        dist.destroy_process_group()


class _RankPool:
    """World-size processes that run tasks one at a time, all ranks together."""

    def __init__(self, world_size: int, backend: str, init: bool, pg_timeout: float, device: str) -> None:
        ctx = start_context(__name__, mp.get_context)  # (torch imported with this module, once)
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="ddpkit-rdzv-")
        init_file = os.path.join(self._dir, "store") if init else None
        env = dict(os.environ)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, backend, pg_timeout, self._tasks[r], self._results, device, env),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._ids = itertools.count()
        self.broken = False

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, fn, args))
        outcomes: dict[int, tuple[bool, Any, str | None]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                tid, rank, ok, value, text = self._results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in outcomes]
                for r in dead:
                    outcomes[r] = (False, RuntimeError(f"rank {r} died (exit code {self._procs[r].exitcode})"), None)
                continue
            if tid != task_id:
                continue
            outcomes[rank] = (ok, value, text)
            if not ok:  # the others may be stuck in a collective: give them a short grace period
                deadline = min(deadline, time.monotonic() + _GRACE_SECONDS)
        return self._finish(fn, outcomes, timeout)

    def _finish(self, fn: Callable[..., Any], outcomes: dict, timeout: float) -> list[Any]:
        missing = [r for r in range(self.world_size) if r not in outcomes]
        failures = sorted(r for r, (ok, _, _) in outcomes.items() if not ok)
        if missing or any(not p.is_alive() for p in self._procs):
            self.broken = True  # stuck in a collective, or a dead peer: the survivors' group is unusable
        if missing or failures:
            if failures:
                rank = failures[0]
                _, exc, text = outcomes[rank]
                note = f"rank {rank} of {self.world_size} failed in {fn.__name__}"
                if missing:
                    note += f"; ranks {missing} did not return"
                raise exc from RemoteTraceback(f"{note}\n{text or ''}")
            raise DistributedTimeout(
                f"ranks {missing} of {self.world_size} did not finish {fn.__name__} within {timeout:.0f} s"
            )
        return [outcomes[r][1] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=5)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)


_pools: dict[tuple[int, str, str], _RankPool] = {}


def _close_pools() -> None:
    for pool in _pools.values():
        pool.close(kill=pool.broken)
    _pools.clear()


atexit.register(_close_pools)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    init: bool = True,
    fresh: bool = False,
    pg_timeout: float = 60.0,
    device: str = "cpu",
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on `world_size` ranks and returns their results in rank order.

    Args:
        fn: a module-level (picklable) function of ``(rank, world_size, *args)``.
        world_size: how many ranks.
        *args: passed on to `fn` on every rank (picklable).
        timeout: seconds every rank has to return.
        backend: the process group's backend, ``"gloo"`` or ``"nccl"``.
        init: make the process group before `fn` runs (False: leave it uninitialised).
        fresh: new processes for this call instead of the pool kept per (world size, backend, device).
        pg_timeout: seconds after which a collective inside `fn` fails.
        device: ``"cpu"`` or ``"cuda"`` (see the module doc; `rank_device()` tells `fn` which).

    Returns:
        What `fn` returned on each rank, in rank order.

    Raises:
        DistributedTimeout: some rank has not returned after `timeout` seconds.
        Exception: the first failing rank's exception, its traceback attached as the cause (`RemoteTraceback`).
        ValueError: a `world_size` below 1, or a `device` the backend or machine cannot serve.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed: world_size must be a positive int, got {world_size!r}")
    _check_device(device, backend, world_size)
    reuse = init and not fresh
    key = (world_size, backend, device)
    pool = _pools.get(key) if reuse else None
    if pool is None:
        pool = _RankPool(world_size, backend, init, pg_timeout, device)
        if reuse:
            _pools[key] = pool
    try:
        return pool.run(fn, args, timeout)
    finally:
        if not reuse or pool.broken:
            pool.close(kill=pool.broken)
            if reuse:
                _pools.pop(key, None)


def _check_device(device: str, backend: str, world_size: int) -> None:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"run_distributed: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("run_distributed: device='cuda' but CUDA is not available")
    if backend == "nccl" and (device != "cuda" or world_size > torch.cuda.device_count()):
        raise ValueError(
            f"run_distributed: backend='nccl' needs device='cuda' and a GPU per rank (world_size={world_size}, "
            f"{torch.cuda.device_count()} GPUs): NCCL refuses two ranks on one GPU; use gloo to share one"
        )
