"""A fault-tolerant job's shared secret: what its peers exchange is authenticated with it.

Across sites, the job's store and its ranks' ports can be reached by more machines than the job's own. Given a secret
(the environment variable ``DDPKIT_JOB_SECRET``, or a file named by ``DDPKIT_JOB_SECRET_FILE``; the same on every
machine, the launcher's included), a job authenticates what its peers exchange with HMAC-SHA256 (RFC 2104):

- every value written into the job's store (`SignedStore`: the rounds' decisions, arrivals, verdicts and reports,
  the settings every rank must share, the addresses the rounds' gloo groups connect to) carries a tag over its key
  and its bytes, checked by every reader; a value without a valid tag raises `UnsignedValue`, naming the key. Values
  appended to a list key are tagged one by one;
- the live state a member sends to a joiner, and what the members broadcast to agree, carry a tag over their bytes
  and what they are (`seal`, `unseal`).

A rank started without the job's secret, or with another, is refused at its first read of the store, by name.

What it does not protect: confidentiality (values and tensors travel in clear: run the job inside a VPN or a TLS
tunnel where that matters); availability (whoever reaches the store can delete keys, or add to the counters that are
not tagged: a rank's heartbeat and a replica's start count, which can only make rounds wait or fail); and the
gradients and parameters the rounds' collectives send (their bytes arrive from the connections the tagged addresses
named).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SECRET_VARIABLE = "DDPKIT_JOB_SECRET"
SECRET_FILE_VARIABLE = "DDPKIT_JOB_SECRET_FILE"
MIN_SECRET_BYTES = 16
MARK = b"\x1eddpkit-hmac\x1f"  # starts each tagged value in the store
_TAG = hashlib.sha256().digest_size
_LENGTH = struct.Struct(">I")


class UnsignedValue(RuntimeError):
    """A value in the job's store, or a message from a peer, whose tag is missing or wrong: written by a process
    without the job's secret (or with another), or changed on its way."""


def secret_from_environment(environ: Any = None) -> bytes | None:
    """The job's secret, from ``DDPKIT_JOB_SECRET`` (its UTF-8 bytes) or the file ``DDPKIT_JOB_SECRET_FILE`` names
    (its bytes without a trailing newline); None when neither is set.

    Args:
        environ: the environment to read (default: this process's).

    Returns:
        The secret's bytes, or None.

    Raises:
        ValueError: both variables are set, the file cannot be read, or the secret is shorter than 16 bytes.
    """
    environ = os.environ if environ is None else environ
    text, path = environ.get(SECRET_VARIABLE), environ.get(SECRET_FILE_VARIABLE)
    if text is not None and path is not None:
        raise ValueError(f"set one of {SECRET_VARIABLE} and {SECRET_FILE_VARIABLE}, not both")
    if path is not None:
        try:
            with open(path, "rb") as file:
                secret = file.read().rstrip(b"\r\n")
        except OSError as exc:
            raise ValueError(f"{SECRET_FILE_VARIABLE}={path}: cannot read the job's secret ({exc})") from exc
        where = f"the file {path} ({SECRET_FILE_VARIABLE})"
    elif text is not None:
        secret, where = text.encode(), SECRET_VARIABLE
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the job's secret in {where} has {len(secret)} bytes; give at least {MIN_SECRET_BYTES} "
            "(for instance the output of `openssl rand -hex 32`)"
        )
    return secret


def _tag(secret: bytes, context: bytes, data: bytes | memoryview) -> bytes:
    mac = hmac.new(secret, _LENGTH.pack(len(context)) + context, hashlib.sha256)
    mac.update(data)
    return mac.digest()


def _as_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SignedStore(dist.Store):
    """A job's store whose values carry an HMAC tag over their key and bytes (module doc): values are tagged as they
    are written and checked as they are read; counters (``add``) and key operations pass through unchanged.

    Usable wherever the store it wraps is (a `Manager`'s store, the store a gloo group meets in). Each value costs
    ``len(MARK) + 36`` bytes more in the store.

    Args:
        inner: the store the values live in (TCPStore, HashStore, `ddpkit.fault_tolerance.etcd_store.EtcdStore`).
        secret: the job's secret (`secret_from_environment`).

    Raises:
        UnsignedValue: from a read, when a value's tag is missing or wrong (naming the key).

    Example:
        Every rank and the launcher of one job, given the same ``DDPKIT_JOB_SECRET``::

            store = protect(torch.distributed.TCPStore(host, port, is_master=False))
            manager = Manager(store, rank, max_world=3)
    """

    def __init__(self, inner: Any, secret: bytes) -> None:
        super().__init__()
        self.inner, self.secret = inner, secret

    def __getattr__(self, name: str) -> Any:  # the wrapped store's own attributes (host, port, url, endpoints)
        if name in ("inner", "secret"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- tags ------------------------------------------------------------------------------------------------------

    def _sealed(self, key: str, value: str | bytes | bytearray | list[int]) -> bytes:
        data = _as_bytes(value)
        return MARK + _tag(self.secret, b"store\0" + key.encode(), data) + _LENGTH.pack(len(data)) + data

    def _opened(self, key: str, raw: bytes) -> bytes:
        """The bytes of every tagged piece of `raw` (one, or several appended), each checked; UnsignedValue else."""
        pieces, at, head = [], 0, len(MARK) + _TAG + _LENGTH.size
        while at < len(raw):
            if raw[at : at + len(MARK)] != MARK or len(raw) < at + head:
                raise self._refused(key, "has no tag")
            tag = raw[at + len(MARK) : at + len(MARK) + _TAG]
            (length,) = _LENGTH.unpack_from(raw, at + len(MARK) + _TAG)
            data = raw[at + head : at + head + length]
            if len(data) != length or not hmac.compare_digest(tag, _tag(self.secret, b"store\0" + key.encode(), data)):
                raise self._refused(key, "has a wrong tag")
            pieces.append(data)
            at += head + length
        return b"".join(pieces)

    @staticmethod
    def _refused(key: str, why: str) -> UnsignedValue:
        return UnsignedValue(
            f"the value of {key!r} in the job's store {why}: it was written by a process without this job's secret "
            f"or with another ({SECRET_VARIABLE} / {SECRET_FILE_VARIABLE}), or changed since; give every rank and "
            "the launcher of one job the same secret"
        )

    # -- torch's Store API -----------------------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, self._sealed(key, value))

    def get(self, key: str) -> bytes:
        return self._opened(key, bytes(self.inner.get(key)))

    def get_if_present(self, key: str) -> bytes | None:
        raw = self.inner.get_if_present(key)
        return None if raw is None else self._opened(key, bytes(raw))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        expected = _as_bytes(expected_value)
        sealed_expected = self._sealed(key, expected) if expected else b""  # (empty: "no such key")
        raw = bytes(self.inner.compare_set(key, sealed_expected, self._sealed(key, desired_value)))
        return self._opened(key, raw) if raw else raw

    def append(self, key: str, value: str | bytes) -> None:
        self.inner.append(key, self._sealed(key, value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._opened(key, bytes(raw)) for key, raw in zip(keys, self.inner.multi_get(keys), strict=True)]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self.inner.multi_set(keys, [self._sealed(k, v) for k, v in zip(keys, values, strict=True)])

    def add(self, key: str, value: int) -> int:
        return int(self.inner.add(key, value))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return self.inner.timeout

    def clone(self) -> SignedStore:
        """Another connection to the same store (the wrapped store's `clone()`), tagging with the same secret."""
        return SignedStore(self.inner.clone(), self.secret)

    def __repr__(self) -> str:
        return f"SignedStore({self.inner!r})"


def protect(store: Any, secret: bytes | None = None) -> Any:
    """`store` as a `SignedStore` with `secret` (default: `secret_from_environment()`); `store` itself when there
    is no secret or it is signed already.

    Args:
        store: a client of the job's store.
        secret: the job's secret; None reads it from the environment.

    Returns:
        The store to use.

    Raises:
        ValueError: the environment's secret is malformed (`secret_from_environment`).
    """
    if isinstance(store, SignedStore):
        return store
    secret = secret if secret is not None else secret_from_environment()
    return store if secret is None else SignedStore(store, secret)


def is_tagged(value: bytes) -> bool:
    """Whether `value`, read from a store without a secret, was written with one (a `SignedStore`'s value)."""
    return value.startswith(MARK)


def unsigned(store: Any) -> Any:
    """The store under a `SignedStore` (for the untagged counters: heartbeats), else `store` itself."""
    return store.inner if isinstance(store, SignedStore) else store


def secret_of(store: Any) -> bytes | None:
    """The secret `store` tags with (None: it does not)."""
    return store.secret if isinstance(store, SignedStore) else None


def seal(payload: torch.Tensor, secret: bytes | None, context: str) -> torch.Tensor:
    """`payload` (uint8, one dimension) with the tag of its bytes and `context` (what it is: a round's heal, a
    broadcast's label) in front; `payload` itself without a secret."""
    if secret is None:
        return payload
    tag = _tag(secret, b"message\0" + context.encode(), payload.numpy().data)
    return torch.cat([torch.frombuffer(bytearray(tag), dtype=torch.uint8), payload])


def unseal(message: torch.Tensor, secret: bytes | None, context: str) -> torch.Tensor:
    """The payload of a `seal`-ed `message`, its tag checked; `message` itself without a secret.

    Raises:
        UnsignedValue: the tag is missing or wrong (the sender has no secret or another, or the bytes changed).
    """
    if secret is None:
        return message
    payload = message[_TAG:]
    tag = bytes(message[:_TAG].numpy().tobytes())
    if len(message) < _TAG or not hmac.compare_digest(
        tag, _tag(secret, b"message\0" + context.encode(), payload.numpy().data)
    ):
        raise UnsignedValue(
            f"a peer's {context} arrived without a valid tag: it was sent by a process without this job's secret or "
            f"with another ({SECRET_VARIABLE} / {SECRET_FILE_VARIABLE}), or changed on its way"
        )
    return payload
