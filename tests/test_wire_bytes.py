"""What CommStats counts is what crosses the wire: measured on the loopback of a fresh network namespace."""

import json
import os
import subprocess
import sys
import uuid

import pytest
import warm_processes

pytestmark = pytest.mark.netns


@pytest.fixture
def namespace():
    name = f"ddpkit-wire-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"network namespaces not permitted here: {made.stderr.strip() or made.returncode}")
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_sends_exactly_ddp_bytes_on_the_wire(namespace, world):
    """Over gloo (as between hosts) ShardedDataParallel + OSS puts DDP's bytes on the wire; on one host, signals."""
    probe = os.path.join(os.path.dirname(__file__), "wire_probe.py")
    command = ["ip", "netns", "exec", namespace, sys.executable, probe, str(world)]
    done = warm_processes.run(command, dict(os.environ), os.getcwd(), 180)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    payload = result["payload"]
    ideal = 2 * (world - 1) * payload  # a ring all-reduce of every gradient
    for name in ("ddp", "sharded"):
        assert result[name]["counted"] == pytest.approx(ideal), result  # CommStats, summed over ranks
        assert result[name]["wire"] >= ideal, result  # nothing escapes the count
    # ours: the kernel's count adds only TCP/IP headers and the fencing barriers, a few percent at most. (torch
    # DDP's own traffic is not bounded above here: under load it was seen 9% above its all-reduce, once.) Against
    # DDP's measured wire the same allowance: idle, sharded is 0.999x DDP's, but a loaded run once put sharded's
    # kernel count 2.4% above its exact CommStats count (TCP retransmissions) while DDP's stayed at 0.4%.
    assert result["sharded"]["wire"] <= ideal * 1.05, (result["sharded"]["wire"] / ideal, result)
    assert result["sharded"]["wire"] <= result["ddp"]["wire"] * 1.05, result
    # On one host (the default) parameters and gradients go through shared memory: on the wire only 1-byte
    # signals (a "full" and an "added" per gradient bucket and sender) and the barriers, with their TCP headers.
    shm = result["sharded_shm"]
    assert shm["counted"] == 2 * (world - 1) * result["buckets"], result
    assert shm["counted"] <= shm["wire"] <= 0.05 * ideal, (shm["wire"] / ideal, result)
