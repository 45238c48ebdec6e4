"""The key-value store a fault-tolerant job meets in: hosted by the launcher of node 0, outliving every rank.

`ddpkit train --fault-tolerant` forms no process group over the whole job (a lost rank would break it). Its ranks
meet through a TCPStore that node 0's launcher hosts (`host`; `ddpkit store` hosts it instead when each machine
runs its own torchrun) and every rank reaches as a client (`connect`): a
rank's death does not take it down, and a rank started again finds the job where it is. The launcher keeps it up
until the job is over: every rank of the final quorum has said it finished (`finish`, `wait_until_finished`), or
no rank is left (the heartbeats the quorums read, `ddpkit.fault_tolerance.liveness`, stopped for every member of
the latest round). Losing node 0's
launcher (its machine) loses this store, and with it the job (every rank stops with `StoreLost`): a job that must
outlive any machine keeps the same keys in an etcd cluster instead (`ddpkit.fault_tolerance.etcd_store`), and
then nobody hosts anything.
Memory: the keys of the quorums (`ddpkit.fault_tolerance.membership`), a few bytes per rank and round.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.distributed.launch import LaunchError
from ddpkit.fault_tolerance import store_identity
from ddpkit.fault_tolerance.clock import Clock, SystemClock
from ddpkit.fault_tolerance.connections import brief_client, waiting_client
from ddpkit.fault_tolerance.job_secret import SECRET_FILE_VARIABLE, SECRET_VARIABLE, UnsignedValue, is_tagged, protect
from ddpkit.fault_tolerance.liveness import Liveness
from ddpkit.fault_tolerance.membership import DEFAULT_PREFIX, ENDED, FINAL, latest_members

PREFIX = DEFAULT_PREFIX
FINAL_KEY = PREFIX + FINAL  # the members of the job's last round, as a JSON list (nobody joins after it)
SILENCE_SECONDS = 20.0  # no heartbeat for this long: no rank is left, the store's host stops waiting


PROBE_SECONDS = 5.0  # how long a plain rank looks at the store before its join
MODE_KEY = "ddpkit/mode"  # "fault-tolerant" in a fault-tolerant job's store: a plain rank that reaches it is told
FAULT_TOLERANT = "fault-tolerant"
JOB_KEY = "ddpkit/job"  # the job's name (--job-id; UNNAMED without one): a rank of another job is refused by it
UNNAMED = "(unnamed)"


def host(port: int, timeout: float, job_id: str | None = None) -> Any:
    """Starts the job's store on `port` of every address of this machine (the launcher of node 0 calls it),
    marked as a fault-tolerant job's (`MODE_KEY`) and as job `job_id`'s (`JOB_KEY`: None, an unnamed job's).
    Returns the server's own client: a `ddpkit.fault_tolerance.job_secret.SignedStore` when the environment gives
    the job a secret. Raises ValueError when that secret is malformed."""
    server = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    store = protect(server)
    store_identity.claim(store)  # (this store's incarnation: a store started again here has another)
    store.set(MODE_KEY, FAULT_TOLERANT)
    store.set(JOB_KEY, job_id or UNNAMED)
    return store


def check_job(store: Any, job_id: str | None, where: str) -> None:
    """Refuses (LaunchError) a rank of job `job_id` (None: unnamed) that reached the store of another job at
    `where`. The first rank to reach a store nobody named (an etcd cluster's) names it, atomically (compare-and-set),
    so of two jobs meeting there only the first goes on. A rank whose job secret (`job_secret`) is not the store's,
    or who has none where the store's values are tagged (or the reverse), is refused too."""
    mine = job_id or UNNAMED
    try:
        answer = store.compare_set(JOB_KEY, "", mine)
    except UnsignedValue as exc:
        raise LaunchError(
            f"the store at {where} was written by a job with another secret, or without one: this rank "
            f"cannot read it ({exc})"
        ) from exc
    if is_tagged(answer):
        raise LaunchError(
            f"the store at {where} belongs to a job with a secret, and this rank was started without one: give it "
            f"the job's {SECRET_VARIABLE} or {SECRET_FILE_VARIABLE}"
        )
    theirs = answer.decode()
    if theirs != mine:

        def say(name: str) -> str:
            return "an unnamed job" if name == UNNAMED else f"job {name!r}"

        raise LaunchError(
            f"the store at {where} belongs to {say(theirs)}, and this rank was started for {say(mine)} (--job-id): "
            "give every rank of one job the same --job-id, and another job another --master-port (or etcd prefix)"
        )


def refuse_plain_rank(address: str, port: int, timeout: float) -> None:
    """For a rank of a plain job (no --fault-tolerant) about to join the store at `address`:`port` as a client:
    raises LaunchError, saying what to do, when that store is a fault-tolerant job's (the rank would wait for its
    whole --timeout for peers that never join a plain group)."""
    try:  # best effort: a store not up yet, or not reachable, is the join's to wait for and report
        client = brief_client(address, port, min(timeout, PROBE_SECONDS))
        marked = client.check([MODE_KEY])  # (its value may be tagged: job_secret)
    except (OSError, dist.DistError):
        return
    if marked:
        raise LaunchError(
            f"the job at {address}:{port} is a fault-tolerant job: start this machine with --fault-tolerant and the "
            "same flags as the others (or give this job another --master-port)"
        )


def connect(address: str, port: int, timeout: float) -> dist.TCPStore:
    """A client of the job's store at `address`:`port`; waits up to `timeout` seconds for it to be up, else raises
    LaunchError saying why that may be (node 0 not started yet, or the job over and its store gone)."""
    try:
        return waiting_client(address, port, timeout)
    except (dist.DistError, OSError) as exc:
        raise LaunchError(
            f"no fault-tolerant job's store answered at {address}:{port} within --timeout {timeout:g} s: start "
            "node 0 (whose launcher hosts it) or `ddpkit store --port P` first; if the job was running, it is over "
            f"and its store is gone ({type(exc).__name__})"
        ) from exc


def finish(store: Any, rank: int, members: list[int], report: dict[str, Any], prefix: str = PREFIX) -> None:
    """Says that `rank` finished the job, whose final quorum is `members`, leaving its `report` for the writer
    (`prefix`: the job's keys' prefix)."""
    store.compare_set(prefix + FINAL, "", json.dumps(members))
    store.set(f"{prefix}report/{rank}", json.dumps(report))


def reports(store: Any, members: list[int], timeout: float) -> dict[int, dict[str, Any]]:
    """The reports of the final quorum's `members` that arrive within `timeout` seconds, by rank."""
    keys = [f"{PREFIX}report/{r}" for r in members]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except dist.DistStoreError:
        pass
    return {r: json.loads(store.get(k)) for r, k in zip(members, keys, strict=True) if store.check([k])}


def wait_until_finished(
    store: Any, start_timeout: float, silence: float = SILENCE_SECONDS, clock: Clock | None = None
) -> str:
    """Blocks while the job runs (node 0's launcher calls it once its own ranks ended; `ddpkit store` at once) and
    says why it returned: every member of the final quorum finished ("finished"), the job ended with fewer ranks
    than its minimum ("ended"), the heartbeat of every member of the latest round stopped for `silence` seconds
    (every rank is gone: "silent"), or no round was decided within `start_timeout` seconds ("never started").
    `clock`: the time it reads (the machine's by default)."""
    clock = clock if clock is not None else SystemClock()
    liveness, started = Liveness(PREFIX, silence, clock), clock.monotonic()
    while not store.check([PREFIX + ENDED]):  # too few ranks were left: every rank stops
        if store.check([FINAL_KEY]):
            members = json.loads(store.get(FINAL_KEY))
            if store.check([f"{PREFIX}done/{r}" for r in members]):
                return "finished"
        members = latest_members(store, PREFIX)
        if members is None and clock.monotonic() - started > start_timeout:
            return "never started"
        if members is not None and liveness.gone(store, members):
            return "silent"
        clock.sleep(0.2)
    return "ended"


def choose_writer(store: Any, candidate: int) -> int:
    """The rank that writes the job's outputs: the first `candidate` proposed (compare-and-set), for everyone."""
    return int(store.compare_set(PREFIX + "writer", "", str(candidate)))


def done(store: Any, rank: int, prefix: str = PREFIX) -> None:
    """Says that `rank` read everything it needed from the store: the launcher may take it down."""
    store.set(f"{prefix}done/{rank}", "1")


def wait_for_done(store: Any, members: list[int], timeout: float) -> None:
    """Waits up to `timeout` seconds until every one of `members` said `done`."""
    try:
        store.wait([f"{PREFIX}done/{r}" for r in members], timedelta(seconds=timeout))
    except dist.DistStoreError:
        pass
