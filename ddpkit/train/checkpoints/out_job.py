"""Which fault-tolerant job a `--out` folder belongs to: the incarnation of the job's store, recorded there.

A fault-tolerant job's `--out` outlives its ranks, and its store may not: when machine 0 (which hosts the embedded
store) is lost and its command started again, the new launcher hosts a new, empty store, and the rank started
with it would begin a new job from step 0 in the same folder, over the outputs of the job it was part of. So each
rank that writes `--out` records there the incarnation of the store it met in
(`ddpkit.fault_tolerance.store_identity`, ``OUT/.ddpkit-job``), and a rank that finds another job's record, one
that did not finish, refuses to start (`OutHoldsAnotherJob`) unless it was told to `--resume` (a new job from that
job's newest checkpoint, which it then says plainly). A job that finished marks its record so; a later run in
the folder is a new job as before.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ddpkit.distributed.launch import LaunchError

JOB_FILE = ".ddpkit-job"


class OutHoldsAnotherJob(LaunchError):
    """`--out` holds the outputs of a fault-tolerant job that did not finish, met in another store."""


def recorded(out: str) -> dict[str, Any] | None:
    """The job record of `out` (None: none, or unreadable)."""
    try:
        with open(os.path.join(out, JOB_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def refuse_another_job(out: str, resume: bool) -> None:
    """For a launcher about to host a new store (whose incarnation no record can hold yet): raises
    `OutHoldsAnotherJob` when `out` holds a job that did not finish and `resume` is False, before anything starts."""
    record = recorded(out)
    if record is not None and not record.get("finished") and not resume:
        raise OutHoldsAnotherJob(_another_job(out, record.get("incarnation"), "a new store"))


def _another_job(out: str, theirs: Any, mine: str) -> str:
    return (
        f"--out {out} holds the outputs of a fault-tolerant job that did not finish (its store: {theirs}), and "
        f"this rank meets in {mine}: the job's store was started again empty, so this would be a new job from "
        "step 0 over that one's outputs. Pass --resume to start a new job from its newest checkpoint, or give "
        f"another --out (or remove {os.path.join(out, JOB_FILE)} to start afresh)"
    )


def claim(out: str, incarnation: str, resume: bool) -> str | None:
    """Records that `out` belongs to the job whose store has `incarnation`.

    Args:
        out: the job's output folder.
        incarnation: this rank's store's incarnation.
        resume: whether the run resumes from `out`'s checkpoint (a new job may then take a folder over).

    Returns:
        A line to tell the user when a new job takes over the folder of one that did not finish (else None).

    Raises:
        OutHoldsAnotherJob: `out` belongs to another job that did not finish, and `resume` is False.
    """
    record = recorded(out)
    if record is None or record.get("incarnation") == incarnation:
        if record is None:
            _write(out, {"incarnation": incarnation, "finished": False})
        return None
    theirs = record.get("incarnation")
    if not record.get("finished") and not resume:
        raise OutHoldsAnotherJob(_another_job(out, theirs, f"another store ({incarnation})"))
    _write(out, {"incarnation": incarnation, "finished": False})
    if record.get("finished"):
        return None
    return (
        f"--out {out} held a job that did not finish (its store: {theirs}); this run is a new job "
        f"({incarnation}) resuming from its newest checkpoint"
    )


def finished(out: str, incarnation: str) -> None:
    """Marks `out`'s record finished, if it is still the record of the job whose store has `incarnation`."""
    record = recorded(out)
    if record is not None and record.get("incarnation") == incarnation:
        _write(out, {"incarnation": incarnation, "finished": True})


def _write(out: str, record: dict[str, Any]) -> None:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, JOB_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
