"""One job per `--out`: a second `ddpkit train` given the folder of a running job stops at
once with a message naming the job that holds it, and the first job's checkpoints are untouched; once that job
has ended, the folder can be used (resumed) again."""

import time

import pytest
from test_train_cli import DDPKIT, LONG_RUN, procs, wait_for  # noqa: F401  (fixture)


def test_a_second_job_on_the_same_out_is_refused_while_the_first_runs(tmp_path, procs):  # noqa: F811
    out = tmp_path / "run"
    flags = [*LONG_RUN, "--timeout", "20", "--checkpoint-every", "5", "--out", out]
    first = procs([*DDPKIT, "train", *flags], "first")
    wait_for(out / "checkpoint" / "step-*" / "COMMIT.json", [first])
    began = time.monotonic()
    second = procs([*DDPKIT, "train", *flags], "second").wait(120)
    assert second.returncode == 1, str(second)
    assert f"--out {out} is in use by another ddpkit job (rank 0, pid" in second.stderr, str(second)
    assert time.monotonic() - began < 60
    assert first.popen.poll() is None, "the first job goes on"
    first.popen.terminate()
    first.wait(60)
    again = [*LONG_RUN, "--max-steps", "2", "--timeout", "20", "--out", out]
    again = procs([*DDPKIT, "train", *again], "again").wait(180)
    assert "is in use" not in again.stderr, str(again)  # the locks went with the first job's processes


def test_the_lock_is_held_for_the_run_and_released_when_it_ends(tmp_path):
    """In one process: a second claim while a run holds the folder is refused naming the holder (this pid); once
    the run's block has ended, by return or by error, the same process may claim it again (a notebook running
    `train` twice on one --out was refused by its own first run)."""
    import os

    from ddpkit.distributed.launch import LaunchError
    from ddpkit.train.checkpoints.out_lock import holding_out

    out = str(tmp_path / "out")
    with holding_out(out, 0):
        with pytest.raises(LaunchError, match=f"in use by another ddpkit job \\(rank 0, pid {os.getpid()} on"):
            with holding_out(out, 0):
                pass
        with holding_out(out, 1):  # another rank's file: the ranks of one job never collide
            pass
    with pytest.raises(RuntimeError, match="the run failed"):
        with holding_out(out, 0):
            raise RuntimeError("the run failed")
    with holding_out(out, 0):  # released after the error too
        pass
    with holding_out(None, 0):  # no --out: nothing to hold
        pass
