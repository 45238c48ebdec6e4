"""Which peers a rank can reach on the data plane, so that a round's members are ranks that can reach each other.

A fault-tolerant job's rounds are decided in its store, and a rank that reaches the store but not its peers (a
firewall, a broken route, a switch port down) arrives at every round like the others: it was decided a member
each time, and each round's collectives failed on everyone, for ever. So the data plane reports what it knows:

- each rank listens on a TCP port of its own on the address its collectives use (`ReachListener`: it accepts and
  closes, nothing more) and publishes that address in the store (``reach/<rank>``);
- a member whose round failed probes the round's other members (one connect each, at most `PROBE_SECONDS`, all
  at once) and reports those it could not reach with its verdict (`Membership.commit`);
- the next round's decider keeps, of the ranks that arrived, the largest group that can reach each other by those
  reports (`reachable_side`: the ranks named unreachable by the fewest go first), so a cut-off rank is dropped at
  the round after the failure, and the decision is still one compare-and-set: every rank reads the same members;
- a rank left out, or starting, probes the latest round's members before it asks to join (`Membership`), and
  joins once it reaches them all: a partition that heals lets it back, one that lasts keeps it waiting without
  failing anyone's rounds.

Sends: nothing while rounds succeed; after a failed round one TCP connect per member pair and one store append
per reporting member. Holds: one listening socket and its thread.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ddpkit.distributed.launch import interface_address

PROBE_SECONDS = 1.0  # how long a probe waits for a peer's connect before it counts the peer unreached
REACH = "reach/"  # key prefix (under the job's prefix) of each rank's probe address


def reach_key(prefix: str, rank: int) -> str:
    return f"{prefix}{REACH}{rank}"


def data_plane_address() -> str:
    """The address this process's collectives use: the interface gloo is pointed at (``GLOO_SOCKET_IFNAME``),
    else the one the host name resolves to (gloo's own default)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    address = interface_address(name) if name else None
    if address is not None:
        return address
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ReachListener:
    """A TCP listener on `address` (a port of its own) that accepts and closes every connection: what a peer's
    probe connects to. `close` ends it."""

    def __init__(self, address: str) -> None:
        self._socket = socket.create_server((address, 0))
        self.address = f"{address}:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="ddpkit-reach").start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return  # closed
            connection.close()

    def close(self) -> None:
        self._socket.close()


class Reachability:
    """This rank's side of the data plane's reports (module doc): its listener, published in the job's store.

    Args:
        store: the job's store.
        prefix: the job's key prefix.
        rank: this rank.
        address: the address to listen on (default: `data_plane_address`).
    """

    def __init__(self, store: Any, prefix: str, rank: int, address: str | None = None) -> None:
        self.prefix, self.rank = prefix, rank
        self.listener = ReachListener(address or data_plane_address())
        store.set(reach_key(prefix, rank), self.listener.address)

    def unreached(self, store: Any, ranks: list[int]) -> list[int]:
        """Those of `ranks` (not this one) whose listener does not accept a connection within `PROBE_SECONDS`,
        probed at once. A rank that published no address counts as reached (nothing is known of it)."""
        peers = [r for r in ranks if r != self.rank]
        keys = [reach_key(self.prefix, r) for r in peers]
        present = [(r, k) for r, k in zip(peers, keys, strict=True) if store.check([k])]
        if not present:
            return []
        addresses = store.multi_get([k for _, k in present])
        with ThreadPoolExecutor(len(present), thread_name_prefix="ddpkit-probe") as pool:
            reached = list(pool.map(_connects, [a.decode() for a in addresses]))
        return [r for (r, _), ok in zip(present, reached, strict=True) if not ok]

    def close(self) -> None:
        self.listener.close()


def _connects(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_SECONDS).close()
        return True
    except OSError:
        return False


def reachable_side(candidates: list[int], reports: Mapping[int, list[int]]) -> list[int]:
    """The largest group of `candidates` that can reach each other by `reports` (rank -> the peers it could not
    reach), greedily: the ranks named unreachable by the fewest others first (ties: the lower rank), each kept if
    no report separates it from those kept. With no report it is `candidates` itself.

    Args:
        candidates: the ranks that arrived at the round, sorted.
        reports: what the previous round's failed members reported.

    Returns:
        The kept ranks, sorted.
    """
    cut = {(a, b) for a, peers in reports.items() for b in peers} | {
        (b, a) for a, peers in reports.items() for b in peers
    }
    named = {r: sum(1 for a, b in cut if b == r) for r in candidates}
    kept: list[int] = []
    for rank in sorted(candidates, key=lambda r: (named[r], r)):
        if all((rank, other) not in cut for other in kept):
            kept.append(rank)
    return sorted(kept)


def parse_reports(text: str) -> dict[int, list[int]]:
    """The reports appended to a round's ``unreached`` key (``"rank:peer,peer;"`` entries)."""
    reports: dict[int, list[int]] = {}
    for entry in filter(None, text.split(";")):
        rank, _, peers = entry.partition(":")
        reports[int(rank)] = [int(p) for p in peers.split(",") if p]
    return reports


def format_report(rank: int, unreached: list[int]) -> str:
    return f"{rank}:{','.join(map(str, unreached))};"
