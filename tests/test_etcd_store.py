"""`ddpkit.fault_tolerance.etcd_store.EtcdStore`: torch's Store API kept in a real etcd cluster.

The reference is torch's own in-memory store (`HashStore`): every operation the fault-tolerant rounds use
(set, get, check, wait, compare_set, add, append, multi_get, multi_set, delete_key, num_keys) must answer on
EtcdStore exactly as on HashStore for the same sequence of calls. Then what etcd adds: jobs named apart never
meet, a gloo process group meets through it, a lost member changes nothing, and a store cut off from the
cluster's majority raises `StoreCutOff` within its timeout instead of answering.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpkit.fault_tolerance.etcd_store import EtcdStore, StoreCutOff, parse_url
from ddpkit.testing.etcd_cluster import EtcdCluster


def _script(store: Any) -> list[Any]:
    """One sequence of the Store calls the rounds make, with what each returned."""
    seen: list[Any] = []
    store.set("a", "1")
    seen += [store.get("a"), store.check(["a"]), store.check(["a", "missing"])]
    seen += [store.compare_set("cas", "", "first"), store.compare_set("cas", "", "second")]
    seen += [store.compare_set("cas", "first", "third"), store.compare_set("cas", "nope", "x")]
    seen += [store.compare_set("absent", "expected", "x"), store.check(["absent"])]
    seen += [store.add("n", 2), store.add("n", -5), store.add("n", 0)]
    store.append("list", "1,")
    store.append("list", b"2,")
    seen.append(store.get("list"))
    store.multi_set(["m1", "m2"], ["u", b"v"])
    seen.append(store.multi_get(["m1", "m2", "a"]))
    seen += [store.delete_key("m1"), store.delete_key("m1"), store.check(["m1"])]
    seen.append(store.num_keys())
    store.set("bytes", bytes(range(256)))
    seen.append(store.get("bytes"))
    try:
        store.wait(["never"], timedelta(seconds=0.2))
        seen.append("no timeout")
    except dist.DistStoreError:
        seen.append("timed out")
    return seen


def test_every_call_answers_as_torchs_hashstore(etcd):
    assert _script(EtcdStore(etcd.url("script"), timeout=10)) == _script(dist.HashStore())


def test_jobs_named_apart_never_meet_and_clear_removes_only_ones_own(etcd):
    one, other = EtcdStore(etcd.url("job-one")), EtcdStore(etcd.url("job-two"))
    one.set("ddpkit/ft/latest", "7")
    assert not other.check(["ddpkit/ft/latest"]) and other.num_keys() == 0
    other.set("x", "y")
    assert one.clear() == 1 and not one.check(["ddpkit/ft/latest"]) and other.check(["x"])


def test_a_get_waits_for_its_key_and_additions_from_threads_never_lose_one(etcd):
    url = etcd.url("threads")
    store = EtcdStore(url)
    threading.Timer(0.3, lambda: EtcdStore(url).set("late", "here")).start()
    since = time.monotonic()
    assert store.get("late") == b"here" and time.monotonic() - since >= 0.25

    def add(n: int) -> None:
        client = EtcdStore(url)
        for _ in range(n):
            client.add("counter", 1)

    threads = [threading.Thread(target=add, args=(15,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert int(store.get("counter")) == 60  # each addition a transaction retried on a race: none lost


def test_a_gloo_group_meets_through_it(etcd):
    url, results = etcd.url("gloo"), {}

    def rank(r: int) -> None:
        etcd_client = EtcdStore(url, timeout=20)  # (held: a PrefixStore keeps no Python object alive)
        group = dist.ProcessGroupGloo(dist.PrefixStore("round-3/", etcd_client), r, 3, timedelta(seconds=20))
        x = torch.full((4,), float(r + 1))
        group.allreduce([x]).wait()
        results[r] = x

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(torch.equal(results[r], torch.full((4,), 6.0)) for r in range(3)), results


def test_one_member_lost_changes_nothing_and_a_lost_majority_cuts_the_store_off_within_its_timeout():
    with EtcdCluster(3) as cluster:
        store = EtcdStore(cluster.url("quorum"), timeout=30)  # (time for an election on a loaded machine)
        store.set("before", "1")
        cluster.kill(0)
        assert store.compare_set("decision", "", "[1, 2]") == b"[1, 2]" and store.get("before") == b"1"
        cluster.kill(1)  # one of three left: no majority, so no write and no linearizable read
        store.set_timeout(timedelta(seconds=2))
        since = time.monotonic()
        with pytest.raises(StoreCutOff, match=r"cut off from the job's etcd store .* no member answered within 2 s"):
            store.compare_set("decision-2", "", "[2]")
        assert 1.5 < time.monotonic() - since < 10


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:2379", "expected etcd://HOST:PORT"),
        ("etcd://", "names no etcd endpoint"),
        ("etcd://h", "'h' in 'etcd://h' is not HOST:PORT"),
        ("etcd://h:port", "is not HOST:PORT"),
        ("etcd://h:1/a b", "may hold only letters"),
    ],
)
def test_a_malformed_url_is_refused_naming_what_is_wrong(url, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_url(url)


def test_the_url_names_endpoints_and_job():
    assert parse_url("etcd://a:1,b:2/run-7") == ([("a", 1), ("b", 2)], "run-7")
    assert parse_url("etcd://[::1]:2379") == ([("::1", 2379)], "default")


def test_a_heartbeat_on_etcd_is_a_lease_that_the_cluster_ends_when_the_rank_stops(etcd):
    """On etcd a rank's heartbeat key lives on a lease each beat renews: once the rank stops beating, the cluster
    deletes the key when the lease runs out, so even a reader that never saw it beat counts the rank gone (a
    counter's staleness needs a reader that watched it for a while)."""
    from ddpkit.fault_tolerance.liveness import LEASE_SECONDS, Heartbeat, Liveness

    url = etcd.url("leases")
    beating = Heartbeat(EtcdStore(url), "ddpkit/ft/", 3)
    reader = EtcdStore(url)
    deadline = time.monotonic() + 10
    while not reader.check(["ddpkit/ft/alive/3"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not Liveness("ddpkit/ft/").gone(reader, [3])  # beating: not gone
    time.sleep(LEASE_SECONDS + 0.5)
    assert reader.check(["ddpkit/ft/alive/3"])  # renewed past its first lease's end
    beating.stop(wait=True)
    deadline = time.monotonic() + LEASE_SECONDS + 5
    while reader.check(["ddpkit/ft/alive/3"]):
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.1)
    assert Liveness("ddpkit/ft/").gone(reader, [3])  # a fresh reader: absent means gone


class _LeaseEndsAfterTheFirstLook(EtcdStore):
    """An etcd client after whose first request the lease of the key it looked at ends: a rank's heartbeat lease
    that runs out while a reader asks about it, made certain."""

    lease = ""

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = super()._post(path, body)
        if self.lease:
            super()._post("/v3/lease/revoke", {"ID": self.lease})
            self.lease = ""
        return answer


def test_a_beat_whose_lease_ends_while_it_is_read_is_seen_or_absent_never_an_error(etcd):
    """A quorum asks whether the missing ranks are gone; a rank's lease that ran out between the look at its key
    and the read of it made that question raise ('key was deleted while it was read') and ended the asking rank
    (a CI run of machine 0 and an etcd member lost). What the reader saw counts: beating when its one read found
    the key, gone once the key is absent."""
    from ddpkit.fault_tolerance.liveness import Liveness, alive_key

    url = etcd.url("lease-race")
    writer, reader = EtcdStore(url), _LeaseEndsAfterTheFirstLook(url, timeout=3)
    lease = writer.grant_lease(30)
    writer.put_leased(alive_key("ddpkit/ft/", 3), "7", lease)
    reader.lease = lease
    liveness = Liveness("ddpkit/ft/")
    assert not liveness.gone(reader, [3])  # seen: it beats as far as this reader knows
    assert not writer.check([alive_key("ddpkit/ft/", 3)])  # (the lease ended right after that look)
    assert liveness.gone(reader, [3])


class _AnswerLosingProxy:
    """A TCP relay on loopback in front of one etcd member that passes every request on but, once armed, drops the
    answer of the next transaction (``/v3/kv/txn``) and closes the client's connection: the request was applied,
    and the client never heard so (a lost answer, as a network that fails between the two)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.armed = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            drop = threading.Event()
            threading.Thread(target=self._requests, args=(client, upstream, drop), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client, drop), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, drop: threading.Event) -> None:
        while data := _recv(client):
            if self.armed and b"POST /v3/kv/txn" in data:
                self.armed = False
                drop.set()
            upstream.sendall(data)
        upstream.close()

    def _answers(self, upstream: socket.socket, client: socket.socket, drop: threading.Event) -> None:
        while data := _recv(upstream):
            if drop.is_set():
                client.shutdown(socket.SHUT_RDWR)
                break
            client.sendall(data)
        client.close()

    def close(self) -> None:
        self.listener.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def test_an_addition_or_append_whose_answer_was_lost_is_applied_once(etcd):
    """The answer of an addition's (and an append's) transaction is lost after etcd applied it; the client retries
    on the next member, whose compare fails on its own write. It is applied once: n == 1, the entry listed once
    (the retry saw a conflict and added again before: n == 2)."""
    member = etcd.members[0]
    proxy = _AnswerLosingProxy(member.client_port)
    try:
        store = EtcdStore(f"etcd://127.0.0.1:{proxy.port},{member.client_address}/lost-answers")
        store.set("warm", "1")  # (the connection to the relay is up)
        proxy.armed = True
        assert store.add("n", 1) == 1
        assert store._endpoint == 1 and not proxy.armed  # (the answer was lost, and retried elsewhere)
        assert EtcdStore(etcd.url("lost-answers")).get("n") == b"1"
        store._endpoint = 0
        store._drop_connection()
        store.append("list", "3,")
        proxy.armed = True
        store.append("list", "4,")
        assert not proxy.armed and EtcdStore(etcd.url("lost-answers")).get("list") == b"3,4,"
        assert store.add("n", 1) == 2  # and the next addition adds as usual
    finally:
        proxy.close()


def test_a_silent_member_never_lets_a_healthy_ranks_lease_run_out():
    """The etcd member a rank's heartbeat talks to goes silent (SIGSTOP: it accepts connections and answers
    nothing, as a machine powered off or cut off by a DROP rule does). The client fails over within its request
    deadline, well inside the lease, so another rank never sees the beating rank gone (with a failover slower than
    the lease, its key vanished and it counted gone)."""
    from ddpkit.fault_tolerance.liveness import LEASE_SECONDS, Heartbeat, Liveness

    with EtcdCluster(3) as cluster:
        addresses = [m.client_address for m in cluster.members]
        beating = Heartbeat(EtcdStore("etcd://" + ",".join(addresses) + "/silent"), "ddpkit/ft/", 3)
        reader = EtcdStore("etcd://" + ",".join(addresses[1:] + addresses[:1]) + "/silent")  # (member 1 first)
        liveness = Liveness("ddpkit/ft/")
        deadline = time.monotonic() + 10
        while not reader.check(["ddpkit/ft/alive/3"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cluster.pause(0)
        try:
            watched_until = time.monotonic() + 2 * LEASE_SECONDS
            while time.monotonic() < watched_until:
                assert reader.check(["ddpkit/ft/alive/3"]), "the healthy rank's lease ran out"
                assert not liveness.gone(reader, [3]), "the healthy rank counted as gone"
                time.sleep(0.1)
        finally:
            cluster.resume(0)
            beating.stop(wait=True)


def test_a_store_that_requires_its_jobs_incarnation_writes_nothing_once_the_jobs_keys_were_cleared(etcd):
    """Every transaction of a client that `require`s the job's incarnation compares it: once the job's keys are
    cleared and written again by another run under the same name, a decision (compare_set), an addition and an
    append raise `StoreReplaced` naming both and write nothing; its clones compare it too."""
    from ddpkit.fault_tolerance import store_identity
    from ddpkit.fault_tolerance.etcd_store import StoreReplaced

    url = etcd.url("identity")
    store = EtcdStore(url)
    mine = store_identity.claim(store)
    store.require(store_identity.INCARNATION_KEY, mine.encode())
    assert store.compare_set("members", "", "[0, 1]") == b"[0, 1]" and store.add("n", 1) == 1
    other = EtcdStore(url)
    other.clear()
    theirs = store_identity.claim(other)
    for clone in (store, store.clone()):
        for call in (lambda s: s.compare_set("m2", "", "[1]"), lambda s: s.add("n", 1), lambda s: s.append("l", "1,")):
            with pytest.raises(StoreReplaced, match=f"this rank's is '{mine}'") as raised:
                call(clone)
            assert theirs in str(raised.value)
    assert not other.check(["m2"]) and not other.check(["n"]) and not other.check(["l"])
