"""Starting `ddpkit train`: under torchrun in this process, otherwise one spawned process per local rank.

The spawning launcher loads no torch (only its ranks do, and `job_store` where node 0 hosts a fault-tolerant
job's store): torch's import is seconds of a short job's start.
"""

from __future__ import annotations

import dataclasses
import os
import time

from ddpkit.distributed.allocator import huge_pages_environment
from ddpkit.distributed.launch import (
    LaunchError,
    Placement,
    exit_without_teardown,
    free_port,
    from_slurm,
    from_torchrun,
)
from ddpkit.distributed.local_processes import spawn
from ddpkit.distributed.rank_guard import say
from ddpkit.train.settings.config import TrainConfig, sharded_replicas, validate

RANK_MAIN = "ddpkit.train.loop.run:process_main"
"""What each spawned rank runs, by name: the launcher itself never imports torch, so the ranks start at once."""

DEFAULT_MULTINODE_PORT = 29500


IMPORT_LAG_SECONDS = 5.0
"""More than this between the process's start and ddpkit's import means the process ran something else first."""


def command_started() -> float:
    """When this command began (``time.time()``): the process's start as the kernel records it, so the wall time
    includes the interpreter's start and torch's import; but ddpkit's first import when that came more than
    `IMPORT_LAG_SECONDS` later, which happens when a shell ran other commands and then exec'd this one (bash runs
    the last command of ``bash -c 'pip install ... && ddpkit train'`` in its own process)."""
    import ddpkit

    process_start = time.time() - seconds_since_process_start()
    imported = ddpkit._imported_at
    return imported if imported - process_start > IMPORT_LAG_SECONDS else process_start


def seconds_since_process_start() -> float:
    """How long this process has run, from the kernel's record of its start (Linux's /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name (field 2) may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # fields[19]: starttime, field 22
    except (OSError, ValueError, IndexError):
        return 0.0


STOPPED_GRACE_SECONDS = 15.0
"""How long past --timeout the launcher lets a stopped (SIGSTOP) rank be before it ends the job's local processes."""


def launch_training(cfg: TrainConfig) -> None:
    """Runs the training job `cfg` describes; returns when every local process has finished."""
    started = command_started()  # the summary's wall time counts from here
    if cfg.debug:
        os.environ["DDPKIT_DEBUG"] = "1"  # the ranks inherit it
    placement = from_torchrun()
    if placement is None and (placement := from_slurm(cfg.master_port)) is not None and cfg.fault_tolerant:
        raise ValueError(
            "--fault-tolerant under srun's tasks: start one torchrun per machine instead "
            "(srun --ntasks-per-node 1 torchrun --nproc-per-node N -m ddpkit train --fault-tolerant ...)"
        )
    if cfg.fault_tolerant and placement is not None:  # one torchrun per machine, meeting at `ddpkit store`
        from ddpkit.train.loop.run import run_placed

        cfg, placement = fault_tolerant_under_torchrun(cfg, placement)
        run_placed(cfg, placement, started)
        exit_without_teardown()
    if placement is None and cfg.maps_large_blocks:  # this process starts the ranks: they start with its environment
        os.environ.update(huge_pages_environment(os.environ))
    if cfg.fault_tolerant:
        launch_fault_tolerant(cfg, started)
        return
    if placement is not None:  # torchrun (or srun) already started one process per rank
        from ddpkit.train.loop.run import run_placed

        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cfg = dataclasses.replace(
            cfg, nproc_per_node=local, nnodes=placement.world_size // local, node_rank=placement.rank // local
        )
        validate(cfg)
        run_placed(cfg, placement, started)
        exit_without_teardown()  # this process is torchrun's worker: done, and the group left
    port = job_port(cfg)
    # a rank stopped this long is past every peer's --timeout (and its ledger diagnosis): end it, say so
    spawn(RANK_MAIN, cfg.nproc_per_node, (cfg, port, started), stopped_limit=cfg.timeout + STOPPED_GRACE_SECONDS)


def job_port(cfg: TrainConfig) -> int:
    """--master-port, else a free port on one machine and torchrun's 29500 across machines."""
    if cfg.master_port is not None:
        return cfg.master_port
    return free_port() if cfg.nnodes == 1 else DEFAULT_MULTINODE_PORT


def launch_fault_tolerant(cfg: TrainConfig, started: float) -> None:
    """Starts this machine's ranks of a fault-tolerant job; node 0 also hosts the job's store and keeps it up
    until the job is over (`ddpkit.fault_tolerance.job_store`). A lost local rank leaves the others training; this
    returns normally if any local rank finished the job, else raises the first failure."""
    port = job_port(cfg)
    store = None
    if cfg.node_rank == 0 and cfg.store is None:  # (with etcd nobody hosts the job's coordination)
        from ddpkit.fault_tolerance import job_store
        from ddpkit.train.checkpoints import out_job

        if cfg.out:  # a new store is a new job: never over the outputs of one that did not finish
            out_job.refuse_another_job(cfg.out, cfg.resume)

        store = job_store.host(port, cfg.timeout, cfg.job_id)
    if sharded_replicas(cfg):  # the machine's processes are one replica: one lost ends them all (a lost machine)
        try:
            failures = spawn(RANK_MAIN, cfg.nproc_per_node, (cfg, port, started))
        except LaunchError as exc:
            failures = [str(exc)] * cfg.nproc_per_node
    else:
        failures = spawn(RANK_MAIN, cfg.nproc_per_node, (cfg, port, started), independent=True)
    gone = ""
    if store is not None:  # the other machines' ranks may still be training
        if job_store.wait_until_finished(store, max(300.0, cfg.timeout)) == "silent":
            gone = f" (and no rank of the job was left: no heartbeat for {job_store.SILENCE_SECONDS:g} s)"
    if len(failures) == cfg.nproc_per_node:
        raise LaunchError(failures[0] + gone)
    for line in failures:
        say(f"ddpkit: {line} (fault-tolerant: the job went on without it)")


def fault_tolerant_under_torchrun(cfg: TrainConfig, torchrun: Placement) -> tuple[TrainConfig, Placement]:
    """This torchrun worker's place in a fault-tolerant job: each machine runs its own torchrun (``--nnodes 1``,
    ``--max-restarts N`` to start a lost worker again), ddpkit's --nnodes/--node-rank say which machine this is,
    and --master-addr/--master-port name the job's store, which `ddpkit store` hosts. A torchrun spanning machines
    is refused: its agents restart every worker of every machine when one fails, so no survivor would go on."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(torchrun.world_size)))
    if torchrun.world_size != local:
        raise ValueError(
            f"--fault-tolerant under torchrun needs one torchrun per machine (torchrun --nnodes 1; this one spans "
            f"{torchrun.world_size // max(local, 1)} machines, whose agents would restart every worker when one "
            "fails); give ddpkit --nnodes/--node-rank for the job's machines instead"
        )
    if cfg.master_port is None and cfg.store is None:
        raise ValueError(
            "--fault-tolerant under torchrun meets at the job's store: start `ddpkit store --port P` on one "
            "machine and give every machine's ddpkit --master-addr <its address> --master-port P"
        )
    cfg = dataclasses.replace(cfg, nproc_per_node=local)
    validate(cfg)
    rank = cfg.node_rank * local + torchrun.local_rank
    return cfg, Placement(rank, cfg.world_size, torchrun.local_rank, cfg.master_addr, cfg.master_port or 0)


def host_job_store(port: int, timeout: float, job_id: str | None = None) -> None:
    """`ddpkit store`: hosts a fault-tolerant job's store on `port` until the job is over (its final quorum
    finished, it ended with too few ranks, or no round was decided for `timeout` seconds)."""
    from ddpkit.fault_tolerance import job_store
    from ddpkit.fault_tolerance.job_secret import secret_of

    store = job_store.host(port, timeout, job_id)
    named = f" (job {job_id!r}: ranks of another --job-id are refused)" if job_id else ""
    signed = "; its values are tagged with the job's secret" if secret_of(store) is not None else ""
    say(
        f"ddpkit: the fault-tolerant job's store listens on port {port} of every address of this machine{named}{signed}"
    )
    why = job_store.wait_until_finished(store, timeout)
    time.sleep(STORE_GRACE_SECONDS)  # ranks still waiting read the end before the store goes
    if why in ("finished", "ended"):
        say(f"ddpkit: the fault-tolerant job {why}; its store stops")
        return
    lost = f"no rank started within --timeout {timeout:g} s" if why == "never started" else "every rank is gone"
    raise LaunchError(f"the fault-tolerant job's store stops: {lost}")


STORE_GRACE_SECONDS = 3.0
