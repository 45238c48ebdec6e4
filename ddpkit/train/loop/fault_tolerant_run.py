"""One process of `ddpkit train --fault-tolerant`: train with whoever is alive, rejoin from live state, report.

The process joins no job-wide process group: it reaches the job's store (`ddpkit.fault_tolerance.job_store`), trains its
own replica and meets the others in rounds (`ddpkit.train.loop.fault_tolerant_sync`). Locally it runs a process
group of one (so the trainer's own bookkeeping works unchanged), or with --strategy oss / sharded a group of its
machine's processes, which are together one replica sharding the optimizer state (`sharded_replicas`:
`ddpkit.fault_tolerance.replica_membership`; the machine's index is then its rank in the rounds). If the job is already
under way (a round was decided), the process joins from live state instead of starting. At the end the lowest member
of the final quorum that never had to rejoin writes the outputs, with every member's figures from the store and
every membership change (metrics.json's ``membership``, ``never_joined`` and ``trained_ranks``, steps.csv's
``members`` and ``membership_change``). The rounds are the library's `Manager`'s; its settings are the plain job's
agreement (`job_settings`), compared at the first round and by every rank that joins later.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.algorithms.pseudo_gradient_settings import OuterSyncSettings
from ddpkit.algorithms.slow_momentum import SlowMoRule
from ddpkit.distributed import threads
from ddpkit.distributed.launch import Placement, choose_gloo_interface
from ddpkit.distributed.objects import broadcast_object
from ddpkit.distributed.rank_guard import say, tell
from ddpkit.fault_tolerance import job_secret, job_store
from ddpkit.fault_tolerance.etcd_store import EtcdStore
from ddpkit.fault_tolerance.manager import Manager
from ddpkit.fault_tolerance.membership import Quorum
from ddpkit.fault_tolerance.replica_membership import join_replica
from ddpkit.train.checkpoints import out_job
from ddpkit.train.checkpoints.checkpoint_files import resume_settings
from ddpkit.train.checkpoints.live_checkpoint import LiveCheckpoints
from ddpkit.train.checkpoints.out_fence import fenced
from ddpkit.train.checkpoints.out_lock import claim_out
from ddpkit.train.loop.callbacks import MetricsRecorder
from ddpkit.train.loop.fault_tolerant_sync import FaultTolerantSync, GossipSchedule, OuterSchedule
from ddpkit.train.loop.job import JobParts, run_job
from ddpkit.train.loop.report import (
    format_summary,
    gather_per_rank,
    optimizer_state_bytes,
    parameter_digest,
    peak_memory_mb,
    write_metrics,
)
from ddpkit.train.loop.strategies import AMP_DTYPES, OPTIMIZER_CLASSES, build_strategy, optimizer_arguments
from ddpkit.train.loop.summary import shared_memory_per_step
from ddpkit.train.loop.summary import summarize as summarize_run
from ddpkit.train.loop.trainer import Callback, Trainer
from ddpkit.train.settings.agreement import job_settings
from ddpkit.train.settings.config import TrainConfig, sharded_replicas
from ddpkit.train.workloads.workload import Workload, build_workload

MACHINE_KEYS = job_store.PREFIX + "machine/"  # each rank's machine identity: who shares whose cores


def _slow_rule(cfg: TrainConfig) -> SlowMoRule | None:
    slow = cfg.slowmo_momentum != 0 or cfg.slowmo_lr != 1 or cfg.slowmo_nesterov
    return SlowMoRule(cfg.slowmo_momentum, cfg.slowmo_lr, cfg.slowmo_nesterov) if slow else None


def outer_schedule(cfg: TrainConfig) -> OuterSchedule | None:
    """SlowMo's sync schedule and slow-momentum rule for local SGD; None for per-step rounds (ddp, sgp)."""
    if cfg.strategy != "slowmo" or cfg.slowmo_base == "sgp":
        return None
    sync = OuterSyncSettings(
        cfg.slowmo_compression,
        cfg.slowmo_compression_block,
        cfg.slowmo_error_feedback,
        cfg.slowmo_fragments,
        cfg.slowmo_sync_delay,
        cfg.slowmo_merge_alpha,
    )
    return OuterSchedule(cfg.localsgd_frequency, cfg.slowmo_frequency, _slow_rule(cfg), sync)


def gossip_schedule(cfg: TrainConfig) -> GossipSchedule | None:
    """SGP's graph and exact-average schedule for --slowmo-base sgp; None otherwise."""
    if cfg.strategy != "slowmo" or cfg.slowmo_base != "sgp":
        return None
    exact_every = cfg.localsgd_frequency if cfg.slowmo_sgp_average_params else 0
    return GossipSchedule(cfg.graph, cfg.peers_per_itr, cfg.slowmo_frequency, _slow_rule(cfg), exact_every)


def local_group() -> None:
    """A process group of this process alone, for the trainer's bookkeeping (its all-gathers become copies)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def train_fault_tolerant(cfg: TrainConfig, placement: Placement, started: float) -> dict[str, Any] | None:
    """Trains this rank of a fault-tolerant job; returns the summary on the rank that wrote it, else None."""
    return _train(cfg, placement, started, open_job_store(cfg, placement))


def _train(cfg: TrainConfig, placement: Placement, started: float, store: Any) -> dict[str, Any] | None:
    waits = {"start_timeout": cfg.timeout, "join_timeout": max(300.0, cfg.timeout)}
    replica, rank, world = None, placement.rank, placement.world_size
    if sharded_replicas(cfg):  # the machine is the replica: its rank is the machine's
        control_timeout = waits["join_timeout"] + cfg.timeout
        rank, world = cfg.node_rank, cfg.nnodes
        replica = join_replica(
            store, job_store.PREFIX, rank, placement.local_rank, cfg.nproc_per_node, cfg.timeout, control_timeout
        )
    else:
        local_group()
    torch.manual_seed(cfg.seed)
    work = build_workload(cfg, torch.device("cpu"))
    if cfg.out and (replica is None or replica.leads):
        claim_out(cfg.out, rank)
    manager = Manager(
        store,
        rank,
        world,
        min_replicas=cfg.min_replicas,
        quorum_timeout=cfg.quorum_timeout,
        prefix=job_store.PREFIX,
        settings=job_settings(cfg, "gloo", work),
        report=tell,
        replica=replica,
        **waits,
    )
    if cfg.out and manager.leads:
        taken_over = out_job.claim(cfg.out, manager.incarnation, cfg.resume)  # (a store started again: refused)
        if taken_over is not None:
            say(f"ddpkit: rank {rank}: {taken_over}")
    if replica is None:  # (a replica's processes were started together: they share the cores already)
        threads.publish_machine(store, MACHINE_KEYS, rank)
    job = FaultTolerantJob(cfg, placement, manager, store, sharded=replica is not None)
    return run_job(cfg, placement, work, job, started)


class FaultTolerantJob:
    """The fault-tolerant job's part of `run_job`: this replica's model and optimizer (a plain torch optimizer, or
    with a sharding strategy the machine's processes as one replica), the rounds' callback (`FaultTolerantSync`)
    with live checkpoints in --out, a start that joins a job under way from live state, and the outputs of the
    one writer the members choose (`report`)."""

    def __init__(self, cfg: TrainConfig, placement: Placement, manager: Manager, store: Any, sharded: bool) -> None:
        self.cfg, self.placement, self.manager, self.store = cfg, placement, manager, store
        self.sharded = sharded  # the machine's processes are one replica, sharding the optimizer state

    def parts(self, work: Workload) -> JobParts:
        cfg = self.cfg
        self.work = work
        if self.sharded:  # OSS (ZeRO-1) or ShardedDataParallel (ZeRO-2) over the machine's processes
            strategy = build_strategy(cfg, work.module, torch.device("cpu"))
            model, optimizer = strategy.model, strategy.optimizer
        else:
            model = work.module
            optimizer = OPTIMIZER_CLASSES[cfg.optimizer](work.module.parameters(), **optimizer_arguments(cfg))
        # fp16: torch's own loss scaler; under DDP every member unscales the same averaged gradients, so the skips
        # and the scale agree without a collective of their own, and the scale travels with the live state
        scaler = torch.amp.GradScaler("cpu") if cfg.amp == "fp16" else None  # (the fault-tolerant path runs on CPU)
        rank, world = self.placement.rank, self.placement.world_size
        label = f"{cfg.strategy} fault-tolerant, rank {rank} of {world}"
        return JobParts(model, optimizer, scaler, AMP_DTYPES[cfg.amp], None, label, 0, 1, cfg.progress and rank == 0)

    def callbacks(self, parts: JobParts, recorder: MetricsRecorder, total_steps: int) -> list[Callback]:
        cfg = self.cfg
        checkpoints = None
        if cfg.out and (cfg.checkpoint_every is not None or cfg.resume):
            checkpoints = LiveCheckpoints(cfg.out, cfg.checkpoint_every, cfg.keep, resume_settings(cfg), cfg.resume)
        overlap = cfg.grad_accum == 1 and not self.sharded  # (a replica's process averages only its own shard)
        self.sync = FaultTolerantSync(
            self.manager,
            self.work.module,
            parts.optimizer,
            recorder,
            total_steps,
            outer_schedule(cfg),
            gossip_schedule(cfg),
            checkpoints,
            overlap=overlap,
            scaler=parts.scaler,
        )
        return [self.sync]

    def fit(self, trainer: Trainer) -> None:
        manager = self.manager
        manager.membership.raise_if_finished()  # (a restart that comes as the job ends: nothing to join)
        self.sync.start(trainer, self.placement.rank)
        if not self.sharded and manager.quorum is not None:  # ranks started apart may share this machine's cores
            threads.share_cores_through_store(self.store, MACHINE_KEYS, manager.rank, manager.quorum.members)
        self.sync.fit(trainer, self.cfg.epochs, self.cfg.max_steps)

    def finish(self, trainer: Trainer, recorder: MetricsRecorder, started: float) -> dict[str, Any] | None:
        cfg, manager = self.cfg, self.manager
        final = self.sync.finish(trainer)
        summary = report(cfg, self.placement, manager.store, trainer, recorder, manager, final, started)
        if cfg.out and manager.leads:
            out_job.finished(cfg.out, manager.incarnation)
        manager.close()
        return summary


def open_job_store(cfg: TrainConfig, placement: Placement) -> Any:
    """The job's store: the etcd cluster of --store, else node 0's TCPStore at --master-addr/--master-port, signed
    with the job's secret if the environment gives one (`job_secret`); a LaunchError if it is another job's
    (`job_store.check_job`) or was written without this secret. Across machines, the rounds' gloo groups advertise
    the address that routes towards the store (the other machines')."""
    if cfg.store is not None:
        store = EtcdStore(cfg.store, cfg.timeout)
        host, port = store.endpoints[0]
    else:
        host, port = placement.master_addr, placement.master_port
    if cfg.nnodes > 1:
        choose_gloo_interface(host, port)
    if cfg.store is None:
        store = job_store.connect(host, port, cfg.timeout)
    store = job_secret.protect(store)  # (with DDPKIT_JOB_SECRET: every value tagged and checked)
    job_store.check_job(store, cfg.job_id, cfg.store or f"{host}:{port}")
    return store


def report(
    cfg: TrainConfig,
    placement: Placement,
    store: Any,
    trainer: Trainer,
    recorder: MetricsRecorder,
    manager: Manager,
    final: Quorum,
    started: float,
) -> dict[str, Any] | None:
    """Leaves this replica's figures in the store (its processes' sums: one process, or a machine's sharding
    processes); the writer (module doc) gathers them and writes the outputs, fenced by the job's `final` round
    (`out_fence`). A collective of the replica."""
    members = final.members
    steps = recorder.steps
    totals = recorder.totals()  # the loop's wall time up to now, as a plain run's summary reads it: one clock
    mine = {
        "sent_bytes_per_step": sum(gather_per_rank(statistics.fmean(r.sent_bytes for r in steps) if steps else 0.0)),
        "sent_bytes": sum(gather_per_rank(sum(r.sent_bytes for r in steps))),
        "samples": sum(gather_per_rank(sum(r.samples for r in steps))),
        "training_seconds": totals["wall_seconds"] - totals["eval_seconds"],
        "peak_memory_mb": max(gather_per_rank(peak_memory_mb())),  # (a replica's largest process)
        "optimizer_state_bytes": gather_per_rank(optimizer_state_bytes(trainer.optimizer)),  # per process
        "digest": parameter_digest(trainer.model),
        "rejoined": manager.rejoined,
        "last_epoch": trainer.state.history[-1] if trainer.state.history else None,
    }
    writer, reports = None, {}
    if manager.leads:
        job_store.finish(store, manager.rank, members, mine)
        reports = job_store.reports(store, members, cfg.quorum_timeout)
        never_rejoined = [r for r in sorted(reports) if reports[r]["rejoined"] == 0]
        candidate = (never_rejoined or sorted(reports) or [manager.rank])[0]
        writer = job_store.choose_writer(store, candidate)  # the first rank's choice is everyone's: one writer
    writer, reports = broadcast_object((writer, reports), 0)  # (to the replica's other processes)
    summary = None
    if writer == manager.rank:
        summary = summarize(cfg, placement, trainer, recorder, manager, reports, members, started)
        if not manager.leads:
            return None
        print(format_summary(summary), flush=True)
        if cfg.out:
            with fenced(cfg.out, final.round, "the job's outputs (metrics.json, steps.csv, metrics.png)") as stage:
                staged = write_metrics(
                    stage, summary, trainer.state.history, recorder.step_rows(), recorder.heldout_rows()
                )
            for path in staged:
                print(f"wrote {os.path.join(cfg.out, os.path.basename(path))}")
    if manager.leads:
        job_store.done(store, manager.rank)
    return summary


def summarize(
    cfg: TrainConfig,
    placement: Placement,
    trainer: Trainer,
    recorder: MetricsRecorder,
    manager: Manager,
    reports: dict[int, dict[str, Any]],
    members: list[int],
    started: float,
) -> dict[str, Any]:
    """`ddpkit train`'s summary for a fault-tolerant job: the members' figures (`reports`) and the membership."""
    ranks = sorted(reports)
    digests = [reports[r]["digest"] for r in ranks]
    training = max((reports[r]["training_seconds"] for r in ranks), default=0.0)
    epochs = [reports[r]["last_epoch"] for r in ranks if reports[r]["last_epoch"]]
    samples = sum(e["samples"] for e in epochs)
    figures = {
        "train_loss": sum(e["train_loss"] * e["samples"] for e in epochs) / samples if samples else math.nan,
        "samples_per_second": sum(reports[r]["samples"] for r in ranks) / max(training, 1e-9),
        "sent_bytes_per_step": statistics.fmean(reports[r]["sent_bytes_per_step"] for r in ranks),
        "sent_bytes_total": sum(reports[r]["sent_bytes"] for r in ranks),
        "shared_memory_bytes_per_step": shared_memory_per_step(recorder),  # (this replica's processes)
        "peak_memory_mb": [reports[r]["peak_memory_mb"] for r in ranks],
        "replicas_equal": len(set(digests)) == 1,
        "parameter_digests": digests,
        "final_members": members,
        "membership": [event.__dict__ for event in manager.events],
        "never_joined": manager.never_joined,
        "trained_ranks": sorted({*members, *(r for e in manager.events for r in [*e.members, *e.left])}),
        "optimizer_state_bytes": [reports[r]["optimizer_state_bytes"] for r in ranks],  # per replica, process
    }
    return summarize_run(cfg, placement, "gloo", trainer, recorder, started, figures)
