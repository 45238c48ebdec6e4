"""One process of `ddpkit train`: join the job, build data, model and strategy, train, summarise."""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from typing import Any

import torch

from ddpkit.distributed import allocator, ledger, segment_files
from ddpkit.distributed.launch import (
    LaunchError,
    Placement,
    debug_mode,
    exit_without_teardown,
    explain_failure,
    join,
    leave,
    pick_backend,
    rejoin_blocked_note,
)
from ddpkit.distributed.objects import broadcast_object
from ddpkit.distributed.rank_guard import guard_rank, say
from ddpkit.distributed.threads import share_cores, share_cores_with_peers
from ddpkit.fault_tolerance.job_store import refuse_plain_rank
from ddpkit.nn import SlowMoDistributedDataParallel
from ddpkit.train.checkpoints import checkpoint_files
from ddpkit.train.checkpoints.checkpoint import load_checkpoint
from ddpkit.train.checkpoints.checkpoint_files import resume_settings
from ddpkit.train.checkpoints.out_lock import holding_out
from ddpkit.train.loop.callbacks import Checkpointer, MetricsRecorder
from ddpkit.train.loop.job import JobParts, run_job
from ddpkit.train.loop.report import format_summary, write_metrics
from ddpkit.train.loop.strategies import build_strategy
from ddpkit.train.loop.summary import group_figures, summarize
from ddpkit.train.loop.trainer import Callback, Trainer
from ddpkit.train.settings.agreement import check_job_agrees
from ddpkit.train.settings.config import TrainConfig
from ddpkit.train.workloads.workload import Workload, build_workload

DIAGNOSIS_SECONDS = 3.0
"""How long a failing rank waits for the others' ledger entries (`ddpkit.distributed.ledger.diagnose`)."""


def rank_device(cfg: TrainConfig, placement: Placement, backend: str) -> torch.device:
    """This rank's device: its own GPU with NCCL; with gloo the CPU, or with ``--device cuda`` a GPU (shared when
    there are fewer GPUs than local processes)."""
    if backend != "nccl" and cfg.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", placement.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def train(cfg: TrainConfig, placement: Placement, backend: str, started: float | None = None) -> dict[str, Any]:
    """Trains on this rank (the process group is joined) and returns the run's summary. `started`: when the
    command began (``time.time()``), for the summary's wall time; None: now."""
    started = time.time() if started is None else started
    device = rank_device(cfg, placement, backend)
    work = build_workload(cfg, device)
    check_job_agrees(cfg, backend, work)  # every rank, before the wrappers' first collective
    with holding_out(cfg.out or None, placement.rank):  # before anything is written: a second job stops here
        summary = run_job(cfg, placement, work, PlainJob(cfg, placement, backend, device), started)
    assert summary is not None
    return summary


class PlainJob:
    """The plain job's part of `run_job`: the strategy's wrapped model and optimizer over the job's process group,
    checkpoints in --out (`Checkpointer`), --resume (or a torchrun restart) from the newest, and the summary every
    rank computes (a collective) and rank 0 prints and writes."""

    def __init__(self, cfg: TrainConfig, placement: Placement, backend: str, device: torch.device) -> None:
        self.cfg, self.placement, self.backend, self.device = cfg, placement, backend, device
        self.settings = resume_settings(cfg)

    def parts(self, work: Workload) -> JobParts:
        cfg, world = self.cfg, self.placement.world_size
        self.work, self.strategy = work, build_strategy(cfg, work.module, self.device)
        adascale = self.strategy.optimizer if cfg.adascale else None
        model, optimizer = self.strategy.model, self.strategy.optimizer
        label = f"{cfg.strategy} x{world}"
        return JobParts(
            model,
            optimizer,
            self.strategy.scaler,
            self.strategy.amp_dtype,
            adascale,
            label,
            self.placement.rank,
            world,
            cfg.progress,
        )

    def callbacks(self, parts: JobParts, recorder: MetricsRecorder, total_steps: int) -> list[Callback]:
        cfg = self.cfg
        if not (cfg.out and cfg.checkpoints):
            return []
        size = len(self.work.train)
        saving = Checkpointer(
            cfg.out, self.strategy, recorder, self.settings, keep=cfg.keep, every=cfg.checkpoint_every, epoch_size=size
        )
        return [saving]

    def fit(self, trainer: Trainer) -> None:
        cfg = self.cfg
        note = rejoin_blocked_note()
        if note and self.placement.rank == 0:
            say(f"ddpkit: note: {note}")
        if cfg.resume or resume_elastic(cfg, self.placement):
            assert cfg.out is not None
            trainer.state = load_checkpoint(cfg.out, self.strategy, self.settings)
        trainer.fit(cfg.epochs, cfg.max_steps)
        if isinstance(self.strategy.model, SlowMoDistributedDataParallel):
            self.strategy.model.average_parameters()  # one model at the end, whatever step the run stopped at

    def finish(self, trainer: Trainer, recorder: MetricsRecorder, started: float) -> dict[str, Any]:
        cfg, placement = self.cfg, self.placement
        figures = group_figures(trainer, recorder)
        summary = summarize(cfg, placement, self.backend, trainer, recorder, started, figures)
        if placement.rank == 0:
            print(format_summary(summary), flush=True)
            if cfg.out:
                history, steps = trainer.state.history, recorder.step_rows()
                for path in write_metrics(cfg.out, summary, history, steps, recorder.heldout_rows()):
                    print(f"wrote {path}")
        return summary


def resume_elastic(cfg: TrainConfig, placement: Placement) -> bool:
    """Whether this torchrun job restarts with fault tolerance (``--max-restarts`` > 0, or already restarted) and
    --out holds a complete checkpoint, as rank 0 sees it (a collective): then every rank resumes from it."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) + int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    if not cfg.out or restarts == 0:
        return False
    found = checkpoint_files.latest(cfg.out) is not None if placement.rank == 0 else None
    return bool(broadcast_object(found, 0))


def run_fault_tolerant(cfg: TrainConfig, placement: Placement, started: float | None) -> dict[str, Any] | None:
    """`run_placed` for ``--fault-tolerant``: no job-wide group to join; fewer live ranks than --min-replicas, or
    the job's store gone, end this rank with a message."""
    from ddpkit.fault_tolerance.membership import JobFinished, TooFewReplicas
    from ddpkit.train.loop.fault_tolerant_run import train_fault_tolerant

    try:
        return train_fault_tolerant(cfg, placement, time.time() if started is None else started)
    except JobFinished as exc:  # a restart that came as the job ended: done, nothing to do
        say(f"ddpkit: rank {placement.rank}: {exc}")
        return None
    except TooFewReplicas as exc:
        say(f"ddpkit: rank {placement.rank} stops: {exc} (--min-replicas {cfg.min_replicas})")
        sys.exit(1)
    except Exception as exc:
        if debug_mode():
            raise
        say(f"ddpkit: rank {placement.rank} failed: {explain_failure(exc, cfg.timeout)}")
        sys.exit(1)
    finally:
        leave()


def process_main(local_rank: int, cfg: TrainConfig, master_port: int, started: float | None = None) -> None:
    """Entry point of each process `ddpkit train` spawns on this machine (`started`: when the command began)."""
    placement = Placement(
        rank=cfg.node_rank * cfg.nproc_per_node + local_rank,
        world_size=cfg.world_size,
        local_rank=local_rank,
        master_addr=cfg.master_addr,
        master_port=master_port,
    )
    run_placed(cfg, placement, started)
    exit_without_teardown()  # done and the group left: torch's teardown at exit may abort (see its docstring)


def use_allocator(cfg: TrainConfig, rank: int) -> None:
    """Maps large blocks alone where `cfg` asks (`TrainConfig.maps_large_blocks`; ddpkit.distributed.allocator):
    with ``auto`` only where this process started with glibc's huge pages (which `ddpkit train`'s launcher gives
    where the machine has them), with ``mapped`` in any case, noting on rank 0 when the pages are small (slower)."""
    if not cfg.maps_large_blocks:
        return
    started = allocator.started_environment()  # (read once: what glibc read when this process started)
    huge = allocator.started_with_huge_pages(started)
    if cfg.allocator == "auto" and not huge:
        return
    if allocator.map_large_blocks(environ=started) and not huge and rank == 0:
        say(
            "ddpkit: note: --allocator mapped without huge pages: large blocks are faulted in 4 KiB pages each step, "
            "which slows the steps (huge pages need glibc 2.35+, transparent huge pages 'always' or 'madvise', and "
            "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 where the process starts: torchrun's environment, under torchrun)"
        )


def run_placed(cfg: TrainConfig, placement: Placement, started: float | None = None) -> dict[str, Any] | None:
    """Joins, trains and leaves; any failure ends this process with a message naming the rank. `started`: when
    the command began (``time.time()``), for the summary's wall time; None: now.

    A crash inside torch's C++ (SIGSEGV, SIGABRT, ...) prints every thread's Python stack to stderr, so the
    report says where the process was. SIGTERM, SIGHUP or the launcher's death end the rank at once
    (`guard_rank`); shared-memory files it created are removed on every way out."""
    guard_rank(f"rank {placement.rank}", segment_files.remove_own_files)
    segment_files.sweep_stale(min_age=0)  # what a killed job on this host left, whatever this job's strategy
    faulthandler.enable()
    share_cores(cfg.nproc_per_node)  # until the job's layout is known
    use_allocator(cfg, placement.rank)
    backend = pick_backend(cfg.backend, cfg.nproc_per_node, cfg.device)
    if cfg.fault_tolerant:
        return run_fault_tolerant(cfg, placement, started)
    try:
        if placement.rank != 0 and cfg.nnodes > 1:  # (a client of another machine's store: is it a plain job's?)
            refuse_plain_rank(placement.master_addr, placement.master_port, cfg.timeout)
        join(placement, backend, cfg.timeout, multi_node=cfg.nnodes > 1)
        share_cores_with_peers()  # ranks started apart may share this machine's cores
        return train(cfg, placement, backend, started)
    except LaunchError as exc:
        say(f"ddpkit: {exc}")
        sys.exit(1)
    except Exception as exc:
        where = ledger.diagnose(timeout=DIAGNOSIS_SECONDS) if ledger.is_peer_failure(exc) else []
        for line in where:
            say(f"ddpkit: rank {placement.rank} saw {line}")
        if debug_mode():
            raise
        say(f"ddpkit: rank {placement.rank} failed: {explain_failure(exc, cfg.timeout)}")
        sys.exit(1)
    finally:
        segment_files.remove_own_files()
        leave()
