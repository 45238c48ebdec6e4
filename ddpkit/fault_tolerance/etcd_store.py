"""A ``torch.distributed`` Store kept in an etcd cluster: a fault-tolerant job's coordination with no machine special.

The embedded store of a fault-tolerant job is a TCPStore on machine 0: losing that machine loses the job's
membership, so the job ends. `EtcdStore` keeps the same keys in etcd (>= 3.5), a replicated key-value store that
decides every write by a majority of its members (Raft): any one of three etcd members may be lost and every
training machine may be lost (machine 0 included) without the job losing its coordination. A rank that is cut off
from the etcd majority cannot read or write anything (every request is linearizable), so it can never decide
alone; it stops with `StoreCutOff`.

The store speaks etcd's v3 HTTP/JSON gateway (``/v3/kv/...``) with the standard library's HTTP client: no etcd
client package. Each operation of torch's Store API maps onto etcd as follows:

- ``set``/``get``/``check``/``delete_key``/``multi_get``/``multi_set``: puts, ranges and deletes (a get waits
  for its key, as a TCPStore's does);
- ``compare_set``, ``add``, ``append``: transactions (compare the key's value or revision, then put), retried
  when another writer came first; the quorum's decisions and the commit's verdicts are these transactions;
- ``wait``: polls the keys, from 1 ms apart up to 50 ms apart.

Every key lives under ``/ddpkit/<job>/`` (the URL's path names the job), so jobs sharing a cluster never meet.
Keep a reference to the store while a ``PrefixStore`` or a process group built on it is in use: those hold the
C++ side only, and the Python methods go with the last Python reference.
The client tries the cluster's endpoints in turn: a member that refuses or goes silent is skipped (a silent one
after `REQUEST_SECONDS`, its connect and read deadline: a small fraction of a heartbeat lease,
`ddpkit.fault_tolerance.liveness.LEASE_SECONDS`, so that a rank's lease outlives its failover), and only when no
member answers for the store's `timeout` does an operation raise `StoreCutOff`. A request whose answer was lost may
have been applied: the retry of an addition or an append (a read-modify-write) must not apply it twice, so each such
transaction also writes a token of its own under this client's key (``/ddpkit-txn/<client>``, on a lease), and a retry
whose compare fails reads that key to learn whether its first try landed. Because it subclasses
``torch.distributed.Store``, it also carries the rendezvous of the rounds' gloo process groups.

Sends: one HTTP request per operation (two to three for an addition or an append), each a few hundred bytes of
JSON. Holds: one keep-alive HTTP connection per store object (`clone` opens another, for a heartbeat thread).
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import uuid
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch.distributed as dist

SCHEME = "etcd://"
DEFAULT_JOB = "default"
REQUEST_SECONDS = 1.0  # one HTTP request's connect and read limit before the next endpoint is tried
TOKEN_LEASE_SECONDS = 300  # how long a client's last transaction token lives (renewed at half of it)
FIRST_POLL, LAST_POLL = 0.001, 0.05  # seconds between a wait's looks at its keys (doubling from the first)


class StoreCutOff(dist.DistNetworkError):
    """No member of the etcd cluster answered within the store's timeout: this rank is cut off from the job's
    coordination (the cluster lost its majority, or this machine lost the network)."""


class StoreReplaced(dist.DistNetworkError):
    """A transaction found the job's identity key (`EtcdStore.require`) holding another value, or none: the job's
    keys were cleared, or written by another run under the same name. Nothing was written."""


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _as_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def parse_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """The endpoints and the job name of ``etcd://HOST:PORT[,HOST:PORT...][/JOB]``.

    Args:
        url: the cluster's client addresses (etcd's ``--listen-client-urls`` ports) and, after a slash, the
            job's name (letters, digits, ``-``, ``_``, ``.``; ``default`` when left out).

    Returns:
        ``([(host, port), ...], job)``.

    Raises:
        ValueError: the URL does not start with ``etcd://``, names no endpoint, has a port that is not a number,
            or a job name with other characters.
    """
    if not url.startswith(SCHEME):
        raise ValueError(f"store: expected etcd://HOST:PORT[,HOST:PORT...][/JOB], got {url!r}")
    rest = url[len(SCHEME) :]
    hosts, _, job = rest.partition("/")
    job = job.strip("/") or DEFAULT_JOB
    if not all(c.isalnum() or c in "-_." for c in job):
        raise ValueError(f"store: the job name {job!r} in {url!r} may hold only letters, digits, '-', '_' and '.'")
    endpoints = []
    for part in filter(None, hosts.split(",")):
        split = urlsplit("//" + part)
        try:
            port = split.port
        except ValueError:
            port = None
        if not split.hostname or port is None:
            raise ValueError(f"store: {part!r} in {url!r} is not HOST:PORT (an etcd member's client address)")
        endpoints.append((split.hostname, port))
    if not endpoints:
        raise ValueError(f"store: {url!r} names no etcd endpoint (expected etcd://HOST:PORT[,HOST:PORT...])")
    return endpoints, job


class EtcdStore(dist.Store):
    """torch's Store API over an etcd cluster (module doc): the coordination of a fault-tolerant job that survives
    the loss of any one machine.

    Args:
        url: ``etcd://HOST:PORT[,HOST:PORT...][/JOB]``: the cluster's client endpoints and the job's name, under
            which every key lives.
        timeout: seconds a ``get`` or ``wait`` waits for its keys, and seconds an operation keeps trying the
            endpoints before it raises `StoreCutOff`.

    Raises:
        ValueError: `url` is malformed (`parse_url`) or `timeout` is not positive.
        StoreCutOff: no endpoint answered within `timeout` (raised by any operation).

    Example:
        Three etcd members on machines a, b and c; every rank of the job::

            store = EtcdStore("etcd://a:2379,b:2379,c:2379/run-7", timeout=30)
            manager = Manager(store, rank, max_world=3)
    """

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        super().__init__()
        if timeout <= 0:
            raise ValueError(f"EtcdStore: timeout must be > 0 seconds, got {timeout}")
        self.url = url
        self.endpoints, self.job = parse_url(url)
        self.namespace = f"/ddpkit/{self.job}/"
        self._timeout = float(timeout)
        self._lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None
        self._endpoint = 0  # the endpoint that answered last: tried first
        self._client = uuid.uuid4().hex  # names this client's transaction tokens (module doc)
        self._tokens = 0
        self._token_lease: tuple[str, float] | None = None  # (lease ID, when granted)
        self._required: tuple[str, bytes] | None = None  # a key every transaction compares (`require`)

    # -- transport -------------------------------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One gateway request, tried on each endpoint in turn until one answers or the store's timeout passed."""
        return self._post_noting_loss(path, body)[0]

    def _post_noting_loss(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """`_post`'s answer, and whether a try before it was sent but its answer lost (it may have been applied)."""
        payload = json.dumps(body)
        deadline = time.monotonic() + self._timeout
        errors: list[str] = []
        lost = False
        with self._lock:
            while True:
                host, port = self.endpoints[self._endpoint]
                sent = False
                try:
                    if self._connection is None:
                        limit = min(REQUEST_SECONDS, max(0.1, deadline - time.monotonic()))
                        self._connection = http.client.HTTPConnection(host, port, timeout=limit)
                    self._connection.request("POST", path, payload, {"Content-Type": "application/json"})
                    sent = True
                    response = self._connection.getresponse()
                    data = response.read()
                    if response.status == 200:
                        return json.loads(data), lost
                    errors.append(f"{host}:{port} answered {response.status}: {data[:200]!r}")
                except (OSError, http.client.HTTPException) as exc:
                    lost = lost or sent
                    errors.append(f"{host}:{port}: {exc or type(exc).__name__}")
                self._drop_connection()
                self._endpoint = (self._endpoint + 1) % len(self.endpoints)
                if time.monotonic() > deadline:
                    raise StoreCutOff(
                        f"cut off from the job's etcd store {self.url}: no member answered within "
                        f"{self._timeout:g} s ({'; '.join(errors[-len(self.endpoints) :])})"
                    )
                if self._endpoint == 0:
                    time.sleep(0.05)  # every member failed once: a short pause before the next pass

    def _drop_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _key(self, key: str) -> str:
        return _b64(self.namespace + key)

    def _range(self, key: str) -> dict[str, Any] | None:
        kvs = self._post("/v3/kv/range", {"key": self._key(key)}).get("kvs")
        return kvs[0] if kvs else None

    def _txn(
        self, compare: dict[str, Any], put: tuple[str, bytes], token: str | None = None
    ) -> tuple[bool, dict[str, Any] | None, bool]:
        """One transaction: if `compare` holds, put `put` (and with `token`, this client's token: module doc);
        else read the key. Returns whether it put, the key's entry read on failure, and whether an earlier try's
        answer was lost (that try may have put)."""
        key = self._key(put[0])
        success = [{"request_put": {"key": key, "value": _b64(put[1])}}]
        if token is not None:
            success.append(
                {"request_put": {"key": _b64(self._token_key()), "value": _b64(token), "lease": self._token_lease_id()}}
            )
        compares, failure = [{"key": key, **compare}], [{"request_range": {"key": key}}]
        if self._required is not None:
            required = self._key(self._required[0])
            compares.append({"key": required, "target": "VALUE", "value": _b64(self._required[1]), "result": "EQUAL"})
            failure.append({"request_range": {"key": required}})
        body = {"compare": compares, "success": success, "failure": failure}
        answer, lost = self._post_noting_loss("/v3/kv/txn", body)
        if answer.get("succeeded"):
            return True, None, lost
        if self._required is not None:
            self._check_required(answer["responses"][1]["response_range"].get("kvs"))
        kvs = answer["responses"][0]["response_range"].get("kvs")
        return False, kvs[0] if kvs else None, lost

    def require(self, key: str, value: bytes) -> None:
        """Makes every transaction of this client and its clones (compare_set, add, append: every decision of the
        job's rounds) also compare `key` with `value` (the job's incarnation,
        `ddpkit.fault_tolerance.store_identity`): one that finds another value, or none, writes nothing and raises
        `StoreReplaced`."""
        self._required = (key, bytes(value))

    def _check_required(self, kvs: list[dict[str, Any]] | None) -> None:
        assert self._required is not None
        key, expected = self._required
        found = _unb64(kvs[0].get("value", "")) if kvs else None
        if found != expected:
            seen = "none" if found is None else repr(found[:40].decode(errors="replace"))
            raise StoreReplaced(
                f"the job {self.job!r} in {self.url} is not the one this rank belongs to: its {key} is {seen}, "
                f"this rank's is {expected[:40].decode(errors='replace')!r} (its keys were cleared, or another run "
                "took its name)"
            )

    def _token_key(self) -> str:
        """This client's token key: outside the job's keys (it is no key of the Store's), on a lease."""
        return f"/ddpkit-txn/{self._client}"

    def _landed(self, token: str) -> bool:
        """Whether the transaction that wrote `token` was applied (this client's token key holds it)."""
        kvs = self._post("/v3/kv/range", {"key": _b64(self._token_key())}).get("kvs")
        return bool(kvs) and _unb64(kvs[0].get("value", "")) == token.encode()

    def _token_lease_id(self) -> str:
        """The lease this client's token key lives on, granted anew at half its time to live."""
        now = time.monotonic()
        if self._token_lease is None or now - self._token_lease[1] > TOKEN_LEASE_SECONDS / 2:
            self._token_lease = (self.grant_lease(TOKEN_LEASE_SECONDS), now)
        return self._token_lease[0]

    def _update(self, key: str, change: Any) -> bytes:
        """Sets `key` to ``change(current value or None)`` atomically (compare the revision, retry on a race),
        exactly once however often a request is retried (module doc: a lost answer's try is found by its token)."""
        entry = self._range(key)
        while True:
            current = _unb64(entry.get("value", "")) if entry is not None else None
            new = change(current)
            if entry is None:
                compare = {"target": "CREATE", "create_revision": "0", "result": "EQUAL"}
            else:
                compare = {"target": "MOD", "mod_revision": entry["mod_revision"], "result": "EQUAL"}
            self._tokens += 1
            token = f"{self._tokens}"
            done, entry, lost = self._txn(compare, (key, new), token)
            if done or (lost and self._landed(token)):
                return new

    # -- torch's Store API -----------------------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._post("/v3/kv/put", {"key": self._key(key), "value": _b64(_as_bytes(value))})

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self.get_if_present(key)
        if value is None:  # deleted between the wait and the read
            raise dist.DistStoreError(f"EtcdStore.get: key {key!r} was deleted while it was read")
        return value

    def get_if_present(self, key: str) -> bytes | None:
        """The value of `key`, or None when it does not exist, in one request without waiting (a key on a lease
        may vanish between a `check` and a `get`: `ddpkit.fault_tolerance.liveness` reads beats this way)."""
        entry = self._range(key)
        return None if entry is None else _unb64(entry.get("value", ""))

    def _present(self, keys: list[str]) -> set[str]:
        """Which of `keys` exist, in one request: the range from the first of them to the last (in etcd's byte
        order), keys only, so that a quorum's wait for N members' arrival keys costs one request per look, not N."""
        if len(keys) == 1:
            return set(keys) if self._range(keys[0]) is not None else set()
        names = sorted(self.namespace + key for key in keys)
        first, last = names[0].encode(), names[-1].encode()
        body = {"key": _b64(first), "range_end": _b64(last + b"\0"), "keys_only": True}
        found = {_unb64(kv["key"]).decode() for kv in self._post("/v3/kv/range", body).get("kvs", [])}
        return {key for key in keys if self.namespace + key in found}

    def check(self, keys: list[str]) -> bool:
        return not keys or len(self._present(keys)) == len(set(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout if timeout is None else timeout.total_seconds()
        deadline, pause = time.monotonic() + limit, FIRST_POLL
        missing = list(keys)
        while True:
            present = self._present(missing) if missing else set()
            missing = [key for key in missing if key not in present]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"EtcdStore.wait: timed out after {limit:g} s waiting for {missing}")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(LAST_POLL, pause * 2)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        if expected:
            compare = {"target": "VALUE", "value": _b64(expected), "result": "EQUAL"}
        else:
            compare = {"target": "CREATE", "create_revision": "0", "result": "EQUAL"}
        done, entry, _ = self._txn(compare, (key, desired))  # (a lost answer's retry reads the value it wrote)
        if done:
            return desired
        return expected if entry is None else _unb64(entry.get("value", ""))

    def add(self, key: str, value: int) -> int:
        return int(self._update(key, lambda old: str(int(old or b"0") + value).encode()))

    def append(self, key: str, value: str | bytes) -> None:
        self._update(key, lambda old: (old or b"") + _as_bytes(value))

    def delete_key(self, key: str) -> bool:
        return int(self._post("/v3/kv/deleterange", {"key": self._key(key)}).get("deleted", 0)) > 0

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"EtcdStore.multi_set: {len(keys)} keys but {len(values)} values")
        puts = [
            {"request_put": {"key": self._key(k), "value": _b64(_as_bytes(v))}}
            for k, v in zip(keys, values, strict=True)
        ]
        self._post("/v3/kv/txn", {"success": puts})  # one transaction: every key or none

    def num_keys(self) -> int:
        answer = self._post("/v3/kv/range", {**self._job_range(), "count_only": True})
        return int(answer.get("count", 0))

    def count_prefix(self, prefix: str) -> int:
        """How many of this job's keys start with `prefix`, in one request that returns the count alone (a round's
        reports: `ddpkit.fault_tolerance.membership`)."""
        answer = self._post("/v3/kv/range", {**self._prefix_range(prefix), "count_only": True})
        return int(answer.get("count", 0))

    def _job_range(self) -> dict[str, str]:
        """The gateway's range of every key of this job (the namespace as a prefix)."""
        return self._prefix_range("")

    def _prefix_range(self, prefix: str) -> dict[str, str]:
        """The gateway's range of this job's keys that start with `prefix`."""
        start = (self.namespace + prefix).encode()
        return {"key": _b64(start), "range_end": _b64(start[:-1] + bytes([start[-1] + 1]))}

    # -- leases (a rank's heartbeat: `ddpkit.fault_tolerance.liveness`) -------------------------------------------

    def grant_lease(self, seconds: float) -> str:
        """A new lease of `seconds` (at least one) to live; returns its ID."""
        return str(self._post("/v3/lease/grant", {"TTL": max(1, int(-(-seconds // 1)))})["ID"])

    def keep_alive(self, lease: str) -> bool:
        """Renews `lease` for its whole time to live again; False when it had run out already (its keys are gone)."""
        answer = self._post("/v3/lease/keepalive", {"ID": lease})
        return int(answer.get("result", {}).get("TTL", 0)) > 0

    def put_leased(self, key: str, value: str | bytes, lease: str) -> None:
        """Sets `key` to `value`, attached to `lease`: etcd deletes it when the lease runs out."""
        self._post("/v3/kv/put", {"key": self._key(key), "value": _b64(_as_bytes(value)), "lease": lease})

    def clear(self) -> int:
        """Deletes every key of this job (its name may then be given to another job); returns how many."""
        return int(self._post("/v3/kv/deleterange", self._job_range()).get("deleted", 0))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return timedelta(seconds=self._timeout)

    def clone(self) -> EtcdStore:
        """Another client of the same cluster and job, with a connection of its own (for another thread)."""
        clone = EtcdStore(self.url, self._timeout)
        clone._required = self._required
        return clone

    def __repr__(self) -> str:
        return f"EtcdStore({self.url!r})"
