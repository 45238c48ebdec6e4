"""One job per `--out` (issue 23, defect 7): a second `ddpkit train` given the folder of a running job stops at
once with a message naming the job that holds it, and the first job's checkpoints are untouched; once that job
has ended, the folder can be used (resumed) again."""

import time

import pytest
from test_train_cli import DDPKIT, LONG_RUN, procs, wait_for  # noqa: F401  (fixture)


@pytest.mark.long  # CI time (28 s)
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
    again = procs([*DDPKIT, "train", *LONG_RUN, "--epochs", "1", "--timeout", "20", "--out", out], "again").wait(180)
    assert "is in use" not in again.stderr, str(again)  # the locks went with the first job's processes
