"""Connections of their own to a fault-tolerant job's store, for the threads beside the rounds.

The heartbeat (`ddpkit.fault_tolerance.liveness`) and the deletion of old rounds' keys
(`Membership.forget_through`) each talk to the store on a connection of their own, so that they never wait behind
the rounds' long waits. A TCPStore's `clone()` would inherit the job's timeout (a minute by default) and retry a
refused connection for all of it: once the store's machine is gone, a clone made then held the process's exit up
for that long (Python waits for its worker threads at exit). `side_connection` makes them with a short timeout.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.fault_tolerance.job_secret import SignedStore

SIDE_TIMEOUT = 10.0  # seconds a side connection waits to connect, and for any call


def brief_client(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A TCPStore client of `host`:`port` with `timeout` seconds to connect and per call; the port is asked first,
    so that a machine that is gone refuses at once instead of after `timeout`. Raises OSError or the store's error
    when the store cannot be reached within `timeout`.

    Args:
        host: the store's address.
        port: the store's port.
        timeout: seconds to connect and per call.

    Returns:
        The client.
    """
    socket.create_connection((host, port), timeout=timeout).close()
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def waiting_client(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A TCPStore client of `host`:`port` once something listens there, asked every 0.2 s for up to `timeout`
    seconds (a store that is not up yet: torch's own client would log each failed try with C++ frames). Raises
    TimeoutError when nothing listens in time, or the store's error.

    Args:
        host: the store's address.
        port: the store's port.
        timeout: seconds to wait for the store, and per call.

    Returns:
        The client.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=min(1.0, timeout)).close()
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listens at {host}:{port}") from None
            time.sleep(0.2)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def side_connection(store: Any, timeout: float = SIDE_TIMEOUT) -> Any:
    """A new connection to the job's `store` for a thread beside the rounds: a TCPStore client with `timeout`
    seconds to connect and per call (module doc; its port is asked first, so that a machine that is gone refuses
    at once), another store's `clone()` (an etcd client), or the store itself where it has no second connection (a
    HashStore shared by threads). Raises OSError or the store's error when it cannot be reached within `timeout`.

    Args:
        store: the rounds' own connection to the job's store.
        timeout: seconds to connect and per call on the new connection (TCPStore).

    Returns:
        The new connection (or `store` itself).
    """
    if isinstance(store, SignedStore):
        return SignedStore(side_connection(store.inner, timeout), store.secret)
    if isinstance(store, dist.TCPStore):
        return brief_client(store.host, store.port, timeout)
    return store.clone() if hasattr(store, "clone") else store
