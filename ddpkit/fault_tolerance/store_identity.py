"""Which store a fault-tolerant job lives in: an incarnation, so that a store restarted empty at the same address is
never taken for the job's.

A job's store is named by its address, and an address can come back with nothing behind it: a service manager
restarts `ddpkit store`, torchrun restarts node 0, a user starts machine 0's command again. A rank whose connection
broke would reconnect to the empty store and go on there (its own job of one, or healed from a model just
initialised), beside the ranks of the job it left: a split. So every store carries an incarnation, a random name
written once when the store is hosted (`job_store.host`) or by the first rank to reach it (an etcd job, a user's own
TCPStore), and every rank holds the one it found (`claim`): a rank that reconnects compares it (`Manager`), and on
etcd every decision (each transaction) compares it too (`EtcdStore.require`), so a job's keys cleared and written
again by another run cannot take the job's decisions.

Sends: one compare-and-set per process when it starts, one read per reconnect. Holds: the incarnation's 32
characters.
"""

from __future__ import annotations

import uuid
from typing import Any

INCARNATION_KEY = "ddpkit/incarnation"


def fresh() -> str:
    """A new random incarnation (128 bits, hexadecimal)."""
    return uuid.uuid4().hex


def claim(store: Any) -> str:
    """The incarnation of `store`, written by this call if the store had none (one compare-and-set: the first
    writer's is everyone's)."""
    return store.compare_set(INCARNATION_KEY, "", fresh()).decode()


def read(store: Any) -> str | None:
    """The incarnation `store` holds now (None: none, a store restarted empty)."""
    if not store.check([INCARNATION_KEY]):
        return None
    return store.get(INCARNATION_KEY).decode()
