"""The key-value store a fault-tolerant job meets in: hosted by the launcher of node 0, outliving every rank.

`ddpkit train --fault-tolerant` forms no process group over the whole job (a lost rank would break it). Its ranks
meet through a TCPStore that node 0's launcher hosts (`host`) and every rank reaches as a client (`connect`): a
rank's death does not take it down, and a rank started again finds the job where it is. The launcher keeps it up
until the job is over: every rank of the final quorum has said it finished (`finish`, `wait_until_finished`), or
no rank is left. Losing node 0's launcher (its machine) ends the job, as losing torchft's lighthouse does.
Memory: the keys of the quorums (`ddpkit.distributed.membership`), a few bytes per rank and round.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.distributed.membership import DEFAULT_PREFIX, ENDED, LATEST

PREFIX = DEFAULT_PREFIX
FINAL_KEY = PREFIX + "final"  # the members of the job's last round, as a JSON list


def host(port: int, timeout: float) -> dist.TCPStore:
    """Starts the job's store on `port` of every address of this machine (the launcher of node 0 calls it)."""
    return dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))


def connect(address: str, port: int, timeout: float) -> dist.TCPStore:
    """A client of the job's store at `address`:`port`; waits up to `timeout` seconds for it to be up."""
    return dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout))


def finish(store: Any, rank: int, members: list[int], report: dict[str, Any]) -> None:
    """Says that `rank` finished the job, whose final quorum is `members`, leaving its `report` for the writer."""
    store.compare_set(FINAL_KEY, "", json.dumps(members))
    store.set(f"{PREFIX}report/{rank}", json.dumps(report))


def reports(store: Any, members: list[int], timeout: float) -> dict[int, dict[str, Any]]:
    """The reports of the final quorum's `members` that arrive within `timeout` seconds, by rank."""
    keys = [f"{PREFIX}report/{r}" for r in members]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except dist.DistStoreError:
        pass
    return {r: json.loads(store.get(k)) for r, k in zip(members, keys, strict=True) if store.check([k])}


def wait_until_finished(store: Any, timeout: float) -> None:
    """Blocks while the job runs (node 0's launcher calls it once its own ranks ended): until every member of the
    final quorum finished, the job ended (fewer ranks than its minimum), or no round was decided anywhere for
    `timeout` seconds (other machines' ranks may train on without this machine's)."""
    quiet_since, latest = time.monotonic(), None
    while not store.check([PREFIX + ENDED]):  # too few ranks were left: every rank stops
        if store.check([FINAL_KEY]):
            members = json.loads(store.get(FINAL_KEY))
            if store.check([f"{PREFIX}done/{r}" for r in members]):
                return
        now_latest = store.get(PREFIX + LATEST) if store.check([PREFIX + LATEST]) else None
        if now_latest != latest:
            quiet_since, latest = time.monotonic(), now_latest
        elif time.monotonic() - quiet_since > timeout:
            return
        time.sleep(0.2)


def done(store: Any, rank: int) -> None:
    """Says that `rank` read everything it needed from the store: the launcher may take it down."""
    store.set(f"{PREFIX}done/{rank}", "1")
