"""How long node 0's launcher keeps a fault-tolerant job's store up (`job_store.wait_until_finished`), on simulated
time (`tests/sim_time.py`): it watches the heartbeats the quorums read (`liveness`), no second heartbeat."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist
from sim_time import SimStore, VirtualTime

from ddpkit.distributed.launch import LaunchError
from ddpkit.fault_tolerance import job_store
from ddpkit.fault_tolerance.liveness import INTERVAL, alive_key
from ddpkit.fault_tolerance.membership import DEFAULT_PREFIX, ENDED, round_key

SILENCE = 20.0


def _launcher(time: VirtualTime, store: SimStore, out: dict) -> None:
    out["why"] = job_store.wait_until_finished(store, 300.0, SILENCE, clock=time)
    out["at"] = time.now


def _decide(store: SimStore, round_: int, members: list[int]) -> None:
    store.set(round_key(DEFAULT_PREFIX, round_, "members"), json.dumps(members))
    store.set(DEFAULT_PREFIX + "latest", str(round_))


def _beat_until(time: VirtualTime, store: SimStore, rank: int, until: float) -> None:
    beats = 0
    while time.now < until:
        beats += 1
        store.set(alive_key(DEFAULT_PREFIX, rank), str(beats))
        time.sleep(INTERVAL)


def _run(*jobs) -> dict:
    time, out = VirtualTime(), {}
    store = SimStore(time)
    with time.held():
        threads = [time.start(_launcher, time, store.clone(), out)]
        threads += [time.start(job, time, store.clone()) for job in jobs]
    for thread in threads:
        thread.join(30)
    assert time.errors == []
    return out


def test_no_round_within_the_start_timeout_is_never_started():
    out = _run()
    assert out["why"] == "never started" and 300.0 < out["at"] <= 300.5


def test_every_member_silent_for_the_silence_ends_it_and_one_beating_member_keeps_it_up():
    def job(time: VirtualTime, store: SimStore) -> None:
        _decide(store, 0, [0, 1, 2])
        time.start(_beat_until, time, store.clone(), 0, 30.0)
        time.start(_beat_until, time, store.clone(), 1, 50.0)  # rank 1 beats longest: silent from t = 50
        _beat_until(time, store, 2, 10.0)
        _decide(store, 7, [0, 1])  # rank 2 left the job's rounds; the launcher watches the latest round's members

    out = _run(job)
    assert out["why"] == "silent"
    assert 50.0 + SILENCE - INTERVAL <= out["at"] <= 50.0 + SILENCE + 1.0, out


def test_the_final_members_done_finishes_it_and_too_few_replicas_ends_it():
    def finished(time: VirtualTime, store: SimStore) -> None:
        _decide(store, 0, [0, 1])
        for rank in (0, 1):
            time.start(_beat_until, time, store.clone(), rank, 8.0)
        time.sleep(5.0)
        job_store.finish(store, 0, [0, 1], {})
        job_store.done(store, 0)
        time.sleep(5.0)
        job_store.done(store, 1)

    out = _run(finished)
    assert out["why"] == "finished" and 10.0 <= out["at"] <= 10.5

    def ended(time: VirtualTime, store: SimStore) -> None:
        _decide(store, 0, [0, 1])
        for rank in (0, 1):
            time.start(_beat_until, time, store.clone(), rank, 2.0)
        time.sleep(3.0)
        store.set(DEFAULT_PREFIX + ENDED, "round 3: 1 of 2 ranks reached the quorum")

    out = _run(ended)
    assert out["why"] == "ended" and out["at"] == pytest.approx(3.0, abs=0.5)


def test_a_side_connection_to_a_store_that_is_gone_fails_within_its_own_timeout():
    """The heartbeat's and the cleaner's connections (`side_connection`): once the store's machine is gone, making
    one fails within its short timeout, not the job's minute (a TCPStore clone retried for all of it, holding a
    survivor's exit up for 60-110 s in the machine-0 scenario)."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from ddpkit.fault_tolerance.connections import side_connection

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
    side = side_connection(client, timeout=1.0)
    side.set("beat", "1")
    assert client.get("beat") == b"1"
    del server, side  # the store's machine is gone
    since = time.monotonic()
    with pytest.raises((OSError, RuntimeError, dist.DistError)):  # (refused at its port at once, on loopback)
        side_connection(client, timeout=1.0)
    assert time.monotonic() - since < 5.0


# -- the job's identity ------------------------------------------------------------------------------------------------


def test_a_rank_of_another_job_is_refused_by_name_and_the_first_rank_names_an_unnamed_store():
    hosted = job_store.host(0, 10.0, "alpha")  # as node 0's launcher or `ddpkit store --job-id alpha` hosts it
    client = dist.TCPStore("127.0.0.1", hosted.port, is_master=False, timeout=timedelta(seconds=10))
    job_store.check_job(client, "alpha", "here:1")  # the job's own rank: goes on
    with pytest.raises(
        LaunchError,
        match=r"the store at here:1 belongs to job 'alpha', and this rank was "
        r"started for job 'beta' \(--job-id\)",
    ):
        job_store.check_job(client, "beta", "here:1")
    with pytest.raises(LaunchError, match="belongs to job 'alpha', and this rank was started for an unnamed job"):
        job_store.check_job(client, None, "here:1")
    assert client.get(job_store.JOB_KEY) == b"alpha"  # the refused ranks changed nothing
    etcd_like = dist.HashStore()  # nobody hosts an etcd cluster's keys: the first rank to reach them names the job
    job_store.check_job(etcd_like, None, "etcd")
    job_store.check_job(etcd_like, None, "etcd")
    with pytest.raises(LaunchError, match="belongs to an unnamed job, and this rank was started for job 'beta'"):
        job_store.check_job(etcd_like, "beta", "etcd")
