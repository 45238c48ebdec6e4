"""Hosts on one machine: network namespaces joined by shaped links, always torn down, and jobs run across them.

``with Hosts(2, rate="100mbit") as hosts:`` creates the namespaces ``ddpk<pid>h0``, ``ddpk<pid>h1``, ... and a
veth pair per host into a bridge in a further namespace ``ddpk<pid>sw`` (the "switch"); host k has the address
``10.77.0.<k+1>/24`` on its interface ``hosts.ifnames[k]``. Each veth end is shaped with ``tc qdisc ... root tbf
rate <rate> burst <burst> latency <latency>``, so every host sends and receives at most `rate`. Nothing outside
these namespaces is touched. Leaving the block deletes them (the veth pairs and the bridge go with them) on a
normal exit, an error, Ctrl-C, SIGTERM or SIGHUP; namespaces left by a process that was killed with SIGKILL are
removed by `remove_stale` (called on entry). Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2:
`unavailable` says why not, so a benchmark or test can skip cleanly.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

PREFIX = "ddpk"
SUBNET = "10.77.0"
CAUGHT = (signal.SIGTERM, signal.SIGHUP)


class LinkError(RuntimeError):
    """A namespace, link or shaping step failed (the message names the command and its error)."""


def sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise LinkError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        sh("ip", "netns", "add", probe)
    except LinkError as exc:
        return f"`ip netns add` is not permitted here ({exc}); run in a VM or a --privileged container"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def remove_stale() -> list[str]:
    """Deletes this module's namespaces whose creating process is gone; returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    removed = []
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        match = re.fullmatch(rf"{PREFIX}(\d+)(h\d+|sw)", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            removed.append(name)
    return removed


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `with` block, which tears the hosts down


def add_link_arguments(parser: argparse.ArgumentParser, run_timeout: float, per: str, tbf: bool = True) -> None:
    """The options of a benchmark across namespace hosts: the links' tbf burst and latency (`tbf`), and its time
    limits (`run_timeout` seconds per `per`, and per collective)."""
    if tbf:
        parser.add_argument("--burst", default="64kb", help="tbf burst")
        parser.add_argument("--latency", default="50ms", help="tbf latency (queue limit)")
    parser.add_argument("--run-timeout", type=float, default=run_timeout, help=f"seconds per {per}")
    parser.add_argument("--pg-timeout", type=float, default=300.0, help="seconds per collective")


class Hosts:
    """`count` network namespaces, each joined to a shared bridge by a link shaped to `rate` both ways."""

    def __init__(self, count: int, rate: str = "100mbit", burst: str = "64kb", latency: str = "50ms") -> None:
        if not isinstance(count, int) or not 2 <= count <= 200:
            raise ValueError(f"Hosts: count must be an int in 2..200; got {count!r}")
        tag = f"{PREFIX}{os.getpid()}"
        self.count, self.rate, self.burst, self.latency = count, rate, burst, latency
        self.switch = f"{tag}sw"
        self.namespaces = [f"{tag}h{k}" for k in range(count)]
        self.ifnames = [f"dk{os.getpid()}h{k}"[-15:] for k in range(count)]
        self.addresses = [f"{SUBNET}.{k + 1}" for k in range(count)]
        self._created: list[str] = []
        self._handlers: dict[int, Any] = {}

    def __enter__(self) -> Hosts:
        for signum in CAUGHT:
            self._handlers[signum] = signal.signal(signum, _raise_exit)
        try:
            remove_stale()
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _namespace(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self._created.append(name)

    def _tbf(self, namespace: str, ifname: str, rate: str, verb: str) -> list[str]:
        """The command that shapes `ifname` in `namespace` to `rate` (`verb`: tc's add or change)."""
        tbf = ["rate", rate, "burst", self.burst, "latency", self.latency]
        return ["ip", "netns", "exec", namespace, "tc", "qdisc", verb, "dev", ifname, "root", "tbf", *tbf]

    def _shape(self, namespace: str, ifname: str, rate: str) -> None:
        sh("ip", "-n", namespace, "link", "set", ifname, "up")
        sh(*self._tbf(namespace, ifname, rate, "add"))

    def rate_commands(self, k: int, rate: str) -> list[list[str]]:
        """The commands that reshape host `k`'s link, both ways, to `rate` (e.g. a straggler: one host on a slower
        link), for a job to run between its runs: a process on any of the hosts may run them (as root)."""
        if not 0 <= k < self.count:
            raise ValueError(f"Hosts.rate_commands: k must be in [0, {self.count}), got {k!r}")
        return [
            self._tbf(self.namespaces[k], self.ifnames[k], rate, "change"),
            self._tbf(self.switch, f"port{k}", rate, "change"),
        ]

    def _open(self) -> None:
        self._namespace(self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for k, (ns, ifname, address) in enumerate(zip(self.namespaces, self.ifnames, self.addresses, strict=True)):
            self._namespace(ns)
            port = f"port{k}"
            sh("ip", "-n", ns, "link", "add", ifname, "type", "veth", "peer", "name", port, "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", ifname)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._shape(ns, ifname, self.rate)  # what the host sends
            self._shape(self.switch, port, self.rate)  # what the host receives

    def close(self) -> None:
        """Deletes every namespace this object created; never raises; restores the signal handlers."""
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._created.clear()
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers.clear()

    def exists(self) -> bool:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        return any(line.split()[0] in (self.switch, *self.namespaces) for line in listed.splitlines() if line)

    def prefix(self, k: int) -> list[str]:
        """The command prefix that runs a program on host `k`."""
        return ["ip", "netns", "exec", self.namespaces[k]]

    def describe(self, rates: dict[int, str] | None = None) -> str:
        """The hosts and their links as made, or with host k's link at ``rates[k]`` (`rate_commands`)."""
        text = f"{self.count} hosts, each link tbf {self.rate} (burst {self.burst}, latency {self.latency}) both ways"
        others = [f"host {k} at {rate}" for k, rate in sorted((rates or {}).items()) if rate != self.rate]
        return text + (f" except {', '.join(others)}" if others else "")


def run_job(commands: Sequence[Sequence[str]], env: Sequence[dict[str, str]], timeout: float, name: str) -> None:
    """Starts every command at once (each in its own session); waits for all of them. If one fails or the
    `timeout` passes, kills the others and raises RuntimeError/TimeoutError; on any exit none is left running."""
    procs: list[subprocess.Popen] = []
    try:
        for cmd, environment in zip(commands, env, strict=True):
            procs.append(subprocess.Popen(list(cmd), env=environment, start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                raise RuntimeError(f"{name}: a process failed (exit codes {[p.returncode for p in procs]})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: did not finish within {timeout:.0f} s")
            time.sleep(0.1)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{name}: a process failed (exit codes {[p.returncode for p in procs]})")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the session of a process this function started
                p.wait(timeout=10)
