"""Standby stores: where a fault-tolerant job's ranks meet again when the machine that hosts its store is lost.

A fault-tolerant job meets in one key-value store (`ddpkit.distributed.job_store`), hosted by node 0's launcher or
`ddpkit store`: without a fallback, losing that machine ends the job. With standby stores, every rank also hosts
an empty store of its own from the start (a TCPStore server on a free port of this machine) and publishes where
it listens (`publish`); every rank keeps the addresses of the job's ranks it has met (`learn`). When the job's
store is lost, every survivor connects to the standby of the lowest-ranked member it knows whose standby answers
(`meet`): the lowest survivor, the same for every survivor. The survivors then settle the round that was open and
re-seed the new store from what they hold (`ddpkit.distributed.manager.Manager`).

A process started again with the job's first address (the lost machine's command, run again) finds a fresh
store there, hosted by its own launcher. The rank whose standby the job meets in keeps looking for a store at that
address (`beacon`, once a second) and writes into it where the job meets now (the key ``moved``); the new process
reads it while the job's first round waits (`StoreMoved`), connects to the survivors' store and joins them from
live state, and its launcher stops waiting on the fresh store (`job_store.wait_until_finished` says "moved").

Sends: one key per rank at publish, one read per new rank at learn; nothing per round; after a loss, one
connection attempt per second to the first address. Holds: one idle TCPStore server (a listening socket and its
thread) per rank.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


class StoreLost(RuntimeError):
    """The job's store is gone and no standby store of a known member answered."""


MOVED = "moved"  # key (under the prefix) of a fresh store at the job's first address: where the job meets now
BEACON_SECONDS = 1.0


class StoreMoved(Exception):
    """The store this process reached is a fresh one at the job's first address, and the job meets elsewhere (at
    `address`, a survivor's standby store) since the machine that hosted its store was lost."""

    def __init__(self, address: str) -> None:
        super().__init__(f"the job's store moved to {address} (its first machine was lost)")
        self.address = address


def moved_to(store: Any, prefix: str) -> str | None:
    """The address the job meets at if `store` is a fresh store that the survivors told where they went."""
    return store.get(prefix + MOVED).decode() if store.check([prefix + MOVED]) else None


def connect_moved(address: str, timeout: float) -> Any:
    """A client of the standby store at `address` ("host:port")."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))


def beacon(home: tuple[str, int], prefix: str, address: str) -> threading.Event:
    """After the survivors moved to the standby at `address`: a daemon thread that looks every `BEACON_SECONDS`
    for a store at the job's first address `home` (the lost machine's launcher started again hosts a fresh one)
    and writes there where the job meets now, so a process started again with the job's first address finds the
    survivors. Set the returned event to stop it. Sends: one connection attempt per second, one key when found."""
    stop = threading.Event()

    def look() -> None:
        while not stop.wait(BEACON_SECONDS):
            with contextlib.suppress(dist.DistError, RuntimeError, OSError):
                if _answer(home[0], home[1], BEACON_SECONDS) == "yes":
                    client = dist.TCPStore(home[0], home[1], is_master=False,
                                           timeout=timedelta(seconds=BEACON_SECONDS))  # fmt: skip
                    client.set(prefix + MOVED, address)

    threading.Thread(target=look, name="ddpkit-beacon", daemon=True).start()
    return stop


def _answer(host: str, port: int, timeout: float) -> str:
    """ "yes" if something listens at `host`:`port`, "refused" if the machine says nothing does, "silent" if it
    does not answer within `timeout` seconds (it is gone, or cut off)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "yes"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def is_store_loss(exc: BaseException) -> bool:
    """Whether `exc` says the store's connection broke (its host is gone), not a wait that timed out."""
    return isinstance(exc, dist.DistNetworkError)


class Standby:
    """This rank's standby store and the addresses of the job's others (module doc). `address`: the address the
    other ranks reach this machine at (the one it reaches the job's store from)."""

    def __init__(self, rank: int, address: str, prefix: str) -> None:
        self.rank, self.prefix = rank, prefix
        self.server: Any = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        self.address = f"{address}:{self.server.port}"
        self.known: dict[int, str] = {rank: self.address}
        self.host: int | None = None  # whose standby the job meets in now (None: the job's own store)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}standby/{rank}"

    def publish(self, store: Any) -> None:
        """Tells the job where this rank's standby listens."""
        store.set(self._key(self.rank), self.address)

    def learn(self, store: Any, ranks: list[int]) -> None:
        """Reads the standby addresses of `ranks` this rank does not know yet (those that published one)."""
        new = [r for r in ranks if r not in self.known]
        present = [r for r in new if store.check([self._key(r)])]
        if present:
            for rank, value in zip(present, store.multi_get([self._key(r) for r in present]), strict=True):
                self.known[rank] = value.decode()

    def meet(self, candidates: list[int], timeout: float) -> Any:
        """A client of the standby of the lowest of `candidates` (with a known address) that answers within
        `timeout` seconds each; raises `StoreLost` naming the addresses tried when none does."""
        tried, unreachable = [], set()
        for rank in sorted(r for r in candidates if r in self.known):
            host, port = self.known[rank].rsplit(":", 1)
            tried.append(f"rank {rank} at {self.known[rank]}")
            if host in unreachable:
                continue
            answer = _answer(host, int(port), timeout)
            if answer != "yes":  # a refused port is skipped at once; a silent machine is waited for once
                unreachable |= {host} if answer == "silent" else set()
                continue
            with contextlib.suppress(dist.DistError, RuntimeError):
                client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
                self.host = rank
                return client
        raise StoreLost("no standby store answered (" + ("; ".join(tried) or "none known") + ")")

    def close(self) -> None:
        """Stops this rank's standby server (a rank that ends; the others may no longer meet there)."""
        self.server = None


@dataclass
class Settlement:
    """What the survivors of a lost store agreed on (`settle`): the latest round any of them took part in
    (`open_round`), the ranks whose last round it was (`in_step`: they go on holding live state), and every
    verdict any of them knew, by round (a round nobody knew the verdict of was committed nowhere)."""

    open_round: int
    in_step: list[int]
    verdicts: dict[int, bool]

    def verdict(self, round_: int) -> bool:
        return self.verdicts.get(round_, False)


def settle(
    store: Any,
    rank: int,
    prefix: str,
    epoch: int,
    last_round: int,
    verdicts: dict[int, bool],
    expected: list[int],
    timeout: float,
    can_decide: bool,
) -> Settlement:
    """The survivors' agreement in the new store after their store was lost (`epoch`: how many times before).
    Each reports its last round and the verdicts it knows, then waits up to `timeout` for the reports of
    `expected` (its last round's members: the lost ones never report); the first rank that finishes waiting and
    `can_decide` (it holds live state) writes the reports it saw as the decision (compare-and-set), which every
    rank reads. Sends: one key per rank, one decision."""
    base = f"{prefix}recovery/{epoch}/"
    report = {"round": last_round, "verdicts": {str(r): v for r, v in verdicts.items()}}
    store.set(f"{base}{rank}", json.dumps(report))
    decision = base + "decision"
    if can_decide:
        with contextlib.suppress(dist.DistStoreError):
            store.wait([f"{base}{r}" for r in expected], timedelta(seconds=timeout))
        ranks = sorted({*expected, rank})
        seen = {r: json.loads(store.get(f"{base}{r}")) for r in ranks if store.check([f"{base}{r}"])}
        store.compare_set(decision, "", json.dumps(seen))
    store.wait([decision], timedelta(seconds=max(timeout, 60.0)))
    decided = {int(r): v for r, v in json.loads(store.get(decision)).items()}
    open_round = max(v["round"] for v in decided.values())
    known: dict[int, bool] = {}
    for value in decided.values():
        for r, verdict in value["verdicts"].items():
            known[int(r)] = known.get(int(r), False) or bool(verdict)
    in_step = sorted(r for r, v in decided.items() if v["round"] == open_round)
    return Settlement(open_round, in_step, known)
