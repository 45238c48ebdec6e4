"""Signals and exits of `ddpkit train`: a stopped rank ends every other one within --timeout whatever the strategy
(SlowMo's node groups included), SIGTERM or SIGKILL to the launcher leaves no rank running, and no shared-memory
segment outlives a job; a later job sweeps what a killed one left.

Jobs run side by side two at a time (each spends most of its life starting Python and torch or waiting out the
timeout), with a tiny model, a 6 s timeout and a checkpoint every 5 steps so that training is seen early.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from test_train_cli import DDPKIT, LONG_RUN, _proc_table, wait_for, wait_gone, workers

from ddpkit.distributed.env import job_timeout
from ddpkit.distributed.groups import make_node_groups
from ddpkit.distributed.launch import explain_failure
from ddpkit.distributed.segment_files import SHM_DIR, pid_namespace, remove_own_files
from ddpkit.distributed.shared_memory import SharedSegments
from ddpkit.testing import run_distributed

pytestmark = pytest.mark.slow

TIMEOUT = 6
SLACK = 20.0  # a loaded 2-core machine: the failing rank's teardown, the launcher noticing, stopping the rest
RUN = [*LONG_RUN, "--timeout", TIMEOUT, "--checkpoint-every", "5", "--slowmo-frequency", "4"]
RUN += ["--localsgd-frequency", "2"]


def segment_files(pids):
    """The /dev/shm files of ddpkit segments whose writer is one of `pids`."""
    pattern = re.compile(rf"ddpkit-[0-9a-f]{{32}}-{pid_namespace()}-(\d+)-.+")
    names = os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []
    return [n for n in names if (m := pattern.fullmatch(n)) and int(m.group(1)) in pids]


def start_job(procs, tmp_path, name, *flags, warm=True):
    out = tmp_path / name
    job = procs([*DDPKIT, "train", *RUN, "--out", out, *flags], name, warm=warm)
    return job, out


def test_explain_failure_gives_ddpkits_cause_without_torchs_source_locations():
    exc = RuntimeError(
        "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms"
    )
    assert explain_failure(exc, 6) == (
        "RuntimeError: Timed out waiting 6000ms (a peer rank did not answer within --timeout 6 s: stopped, hung or "
        "unreachable)"
    )
    exc = RuntimeError("[a/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer. This is typically caused")
    assert explain_failure(exc, 6).endswith("(a peer rank ended: killed, crashed or its machine is gone)")
    assert explain_failure(ValueError("bad"), 6) == "ValueError: bad"


def _groups_and_segments(rank, world):
    groups = make_node_groups(2, rank, world)
    timeouts = {job_timeout(groups.local), job_timeout(None)}
    if groups.master is not None:
        timeouts.add(job_timeout(groups.master))
    segments = SharedSegments.agree(groups.world, 1024)
    path = None
    if segments is not None:  # an exception between creating a segment and unlinking it leaves nothing behind
        try:
            segments.create(f"probe{rank}", 16, torch.float32)
            path = segments._path(f"probe{rank}", rank)
            raise RuntimeError("a failure while the segment exists")
        except RuntimeError:
            assert os.path.exists(path)
            assert path in remove_own_files()
    return timeouts, path is None or not os.path.exists(path), segments is not None


def test_node_groups_inherit_the_job_timeout_and_segments_go_on_every_exit():
    """torch gives groups made with new_group a 30-minute timeout unless told; SlowMo's must fail with the job's."""
    for timeouts, gone, shared in run_distributed(_groups_and_segments, 4):
        assert timeouts == {timedelta(seconds=60)}, timeouts  # run_distributed's default pg_timeout
        assert gone and shared


# (each stops one rank of a two-process job; test_train_cli.py stalls one on another machine)
@pytest.mark.parametrize("pair", [("ddp", "slowmo"), ("oss", "sharded")])
def test_a_stopped_rank_ends_every_other_rank_within_the_timeout(tmp_path, procs, pair):
    """SIGSTOP to rank 1: rank 0 fails with ddpkit's message within --timeout (SlowMo's node and master groups
    inherit it: with torch's default they would wait 30 minutes), the launcher ends the stopped rank, exits 1 with
    its own one-line cause last, no torch C++ stack trace, no process and no shared-memory file is left."""
    jobs = {s: start_job(procs, tmp_path, s, "--strategy", s) for s in pair}
    for job, out in jobs.values():
        wait_for(out / "checkpoint" / "step-*" / "COMMIT.json", [job])
    stopped = {}
    for strategy, (job, _) in jobs.items():
        ranks = workers(job)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGSTOP)
        stopped[strategy] = time.monotonic()
    for strategy, (job, _) in jobs.items():
        result = job.wait(TIMEOUT + 120)
        took = time.monotonic() - stopped[strategy]
        assert result.returncode == 1, str(result)
        lines = result.stderr.strip().splitlines()
        assert re.search(rf"ddpkit: rank 0 failed: .*did not answer within --timeout {TIMEOUT} s", result.stderr)
        assert lines[-1].startswith("ddpkit: error: local process"), str(result)
        assert "Exception raised from" not in result.stderr and "frame #" not in result.stderr, str(result)
        assert "Traceback" not in result.stderr, str(result)
        assert took < TIMEOUT + SLACK, f"{strategy}: {took:.1f} s\n{result}"
        assert not wait_gone(job.seen), f"{strategy}: processes outlived the job"
        assert not segment_files({pid for pid, _ in job.seen}), strategy


def test_sigterm_to_the_launcher_stops_every_rank_and_sweeps_segments(tmp_path, procs):
    """SIGTERM (what kill, timeout and schedulers send) stops every local rank and exits 143; a segment file a
    killed process left (its writer gone) is removed by the next job, whatever its strategy (here ddp)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    litter = Path(SHM_DIR) / f"ddpkit-{'0' * 32}-{pid_namespace()}-{int(dead.stdout)}-litter"
    litter.write_bytes(b"x")
    try:
        job, out = start_job(procs, tmp_path, "term", "--strategy", "ddp")
        wait_for(out / "checkpoint" / "step-*" / "COMMIT.json", [job])
        assert not litter.exists(), "the job did not sweep the killed job's segment"
        assert len(workers(job)) == 2
        os.kill(job.pid, signal.SIGTERM)
        result = job.wait(60)
        assert result.returncode == 128 + signal.SIGTERM, str(result)
        assert result.stderr.strip().splitlines()[-1] == "ddpkit: SIGTERM received; stopped every local process"
        assert "Traceback" not in result.stderr, str(result)
        assert not wait_gone(job.seen, timeout=10), "processes outlived SIGTERM"
    finally:
        litter.unlink(missing_ok=True)


@pytest.mark.parametrize("stopped_rank", [False, True])
def test_sigkill_to_the_launcher_leaves_no_rank_running(tmp_path, procs, stopped_rank):
    """The launcher killed outright cannot stop anything: each rank notices its parent is gone (PR_SET_PDEATHSIG,
    and polling) and ends within a second or two, removing its own segment files (sharded uses them). A rank that
    was stopped (SIGSTOP) at that moment is woken by the parent-death signal (SIGCONT) and ends too; it used to
    stay stopped, orphaned, forever."""
    job, out = start_job(procs, tmp_path, "kill", "--strategy", "sharded")
    wait_for(out / "checkpoint" / "step-*" / "COMMIT.json", [job])
    ranks = workers(job)
    assert len(ranks) == 2
    if stopped_rank:
        os.kill(ranks[1], signal.SIGSTOP)
    os.kill(job.pid, signal.SIGKILL)
    killed = time.monotonic()
    job.popen.wait(10)
    left = wait_gone(job.seen, timeout=15)
    assert not left, f"ranks outlived their launcher: {left}"
    assert time.monotonic() - killed < 15
    assert not segment_files(set(ranks)), "a rank left shared-memory files"
    assert "its launcher is gone; stopping" in job.result().stderr


def _loading_torch(pid):
    """Whether process `pid` has begun importing torch (its C library is mapped); ddpkit's import came before."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _fork_server(job):
    """The fork server of `job`'s launcher (the process that imports torch once and forks the ranks), if it runs."""
    table = _proc_table()
    found = [p for p, t in job.watch() if p in table and table[p][3] == t and "forkserver" in table[p][2]]
    return found[0] if found else None


@pytest.mark.parametrize("target", ["fork server", "rank"])
def test_a_process_stopped_while_the_ranks_start_ends_with_its_killed_launcher(tmp_path, procs, target):
    """SIGSTOP, then SIGKILL to the launcher, while the ranks start: the fork server stopped while it imports torch,
    or a rank stopped the moment it exists (before its rank guard runs). Each was armed with the parent-death
    signal (SIGCONT) at once (ddpkit's import; the fork), so it is woken and ends, and the launcher's resource
    tracker with it; such processes used to stay, stopped and orphaned, forever. (Started cold: its start-up is
    the point.)"""
    job, _ = start_job(procs, tmp_path, "startup", "--strategy", "ddp", warm=False)
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline and job.popen.poll() is None, f"no {target} appeared: {job}"
        if target == "rank" and (ranks := workers(job)):
            victim = ranks[0]
            break
        server = _fork_server(job) if target == "fork server" else None
        if server is not None and _loading_torch(server):
            victim = server
            break
        time.sleep(0.01)
    os.kill(victim, signal.SIGSTOP)
    os.kill(job.pid, signal.SIGKILL)
    job.popen.wait(10)
    left = wait_gone(job.seen, timeout=30)
    assert not left, f"processes outlived their launcher: {left}"
    if target == "rank":
        assert "its launcher is gone; stopping" in job.result().stderr
