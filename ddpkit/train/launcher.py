"""Starting `ddpkit train`: under torchrun in this process, otherwise one spawned process per local rank."""

from __future__ import annotations

import dataclasses
import os

from ddpkit.distributed.launch import exit_without_teardown, free_port, from_torchrun, spawn
from ddpkit.train.config import TrainConfig, validate
from ddpkit.train.run import process_main, run_placed

DEFAULT_MULTINODE_PORT = 29500


def launch_training(cfg: TrainConfig) -> None:
    """Runs the training job `cfg` describes; returns when every local process has finished."""
    if cfg.debug:
        os.environ["DDPKIT_DEBUG"] = "1"  # the ranks inherit it
    placement = from_torchrun()
    if placement is not None:  # torchrun (or a scheduler) already started one process per rank
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cfg = dataclasses.replace(
            cfg, nproc_per_node=local, nnodes=placement.world_size // local, node_rank=placement.rank // local
        )
        validate(cfg)
        run_placed(cfg, placement)
        exit_without_teardown()  # this process is torchrun's worker: done, and the group left
    port = cfg.master_port
    if port is None:
        port = free_port() if cfg.nnodes == 1 else DEFAULT_MULTINODE_PORT
    spawn(process_main, cfg.nproc_per_node, (cfg, port))
