"""benchmarks/ cannot rot: every benchmark runs at smoke size through ``python -m benchmarks all --quick`` and
writes its result file with the fields the README's record relies on; the shared timing helpers and the
network-namespace hosts (set up, and torn down on an error or SIGTERM) are checked on their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpkit.measure import timing

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
FIELDS = ("benchmark", "command", "date", "commit", "torch", "machine", "config", "figures")


def benchmarks_here() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks").glob("bench_*.py"))


def netns_unavailable() -> str | None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.lib import netns

    return netns.unavailable()


def test_listing_names_every_benchmark_with_its_question(capsys):
    """``python -m benchmarks`` (its `main`, called here: the argument handling, not the process, is the point)
    lists every benchmark with its question; an unknown name and a bad option exit 2 naming them."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.__main__ import main

    assert main([]) == 0
    listing = capsys.readouterr().out
    for name in benchmarks_here():
        line = next((x for x in listing.splitlines() if x.strip().startswith(name + " ")), None)
        assert line is not None and len(line.split(maxsplit=1)[1]) > 20, listing
    assert main(["nosuch"]) == 2 and "unknown benchmark 'nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["sharding", "--world-size", "1"])
    assert exited.value.code == 2 and "--world-size" in capsys.readouterr().err


def _toy_benchmark(runs: list):
    """A benchmark module of the smallest shape `benchmarks.lib.cli` accepts: one option, a smoke size."""

    def add_arguments(parser):
        parser.add_argument("--steps", type=int, default=10)

    def plot(report, out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "toy.png").write_bytes(b"png")

    return SimpleNamespace(
        QUESTION="does a toy run write where it should?",
        QUICK={"steps": 1},
        add_arguments=add_arguments,
        run=lambda args: runs.append(args.steps) or {"steps": args.steps},
        table=lambda report: f"steps {report['figures']['steps']}",
        plot=plot,
    )


def test_only_a_run_at_the_defaults_or_with_record_changes_the_record(tmp_path, monkeypatch, capsys):
    """--quick and other options write into the scratch folder; the defaults, or --record, into the record;
    --out wins; --record with --quick is refused before anything runs."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.lib import cli, results

    folders = {name: tmp_path / name for name in ("results", "figures", "scratch")}
    monkeypatch.setattr(results, "RESULTS", folders["results"])
    monkeypatch.setattr(results, "FIGURES", folders["figures"])
    monkeypatch.setattr(results, "SCRATCH", folders["scratch"])
    runs: list = []
    toy = _toy_benchmark(runs)

    def written():
        found = {name: sorted(p.name for p in folder.glob("*")) for name, folder in folders.items()}
        found = {name: names for name, names in found.items() if names}
        for folder in folders.values():
            for path in folder.glob("*"):
                path.unlink()
        return found

    assert cli.main("toy", toy, ["--quick"]) == 0
    assert written() == {"scratch": ["toy.json", "toy.png"]} and runs == [1]
    assert "not the record (--quick: not the defaults)" in capsys.readouterr().out
    assert cli.main("toy", toy, ["--steps", "3"]) == 0
    assert written() == {"scratch": ["toy.json", "toy.png"]}
    assert "not the record (--steps: not the defaults)" in capsys.readouterr().out
    assert cli.main("toy", toy, []) == 0
    assert written() == {"results": ["toy.json"], "figures": ["toy.png"]}
    assert cli.main("toy", toy, ["--steps", "3", "--record"]) == 0
    assert written() == {"results": ["toy.json"], "figures": ["toy.png"]}
    assert cli.main("toy", toy, ["--quick", "--out", str(folders["scratch"] / "mine")]) == 0
    assert json.loads((folders["scratch"] / "mine" / "toy.json").read_text())["config"]["steps"] == 1
    with pytest.raises(SystemExit) as refused:
        cli.main("toy", toy, ["--quick", "--record"])
    assert refused.value.code == 2 and "--record: a --quick run is a smoke test" in capsys.readouterr().err
    assert runs == [1, 3, 10, 3, 1]


# every benchmark at smoke size, two at once: 80 s alone on 2 idle cores (150 s of CPU), far longer under load
QUICK_ALL_SECONDS = 1500


@pytest.mark.slow
@pytest.mark.timeout(QUICK_ALL_SECONDS + 120)  # beyond the suite's 300 s, which this test always needed
def test_every_benchmark_quick_writes_its_result_file(tmp_path):
    began = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "all", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=QUICK_ALL_SECONDS,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    skipped_link = netns_unavailable()
    from benchmarks.lib import cgroup

    no_cgroup = cgroup.unavailable()
    for name in benchmarks_here():
        path = tmp_path / f"{name}.json"
        if name in ("slowmo_link", "advisor", "sgp", "diloco", "hosts") and skipped_link:
            assert not path.exists() and f"{name}: skipped" in done.stdout
            continue
        if name == "memory" and no_cgroup:  # the job's peak needs a memory cgroup (root)
            assert not path.exists() and "memory: skipped" in done.stdout
            continue
        report = json.loads(path.read_text())
        assert all(report.get(key) is not None for key in FIELDS if key != "commit"), (name, report.keys())
        assert report["benchmark"] == name and report["command"].startswith(f"python -m benchmarks {name} --quick")
        assert report["machine"]["cores"] >= 1 and report["machine"]["memory_gb"] > 0 and "gpu" in report["machine"]
        assert report["config"]["quick"] is True and report["figures"]
        assert time.strptime(report["date"], "%Y-%m-%d %H:%M UTC").tm_year >= time.gmtime(began).tm_year
        assert list(tmp_path.glob("*.png")), "plots are drawn from the result file"
    sharding = json.loads((tmp_path / "sharding.json").read_text())["figures"]
    rows = {r["key"]: r for r in sharding["by_world_size"]["2"]}
    assert rows["ddp"]["step_vs_ddp"] == 1.0 and rows["oss_sdp"]["state_mb"] < rows["ddp"]["state_mb"]
    assert all(r["matches_ddp"] for r in rows.values()), "every strategy computed DDP's parameters"
    # FSDP2 (reshard_after_forward=False) sends an all-gather and a reduce-scatter: DDP's all-reduce, byte for byte
    assert rows["fsdp2"]["bytes_vs_ddp"] == pytest.approx(1.0) and rows["fsdp2"]["state_mb"] < rows["ddp"]["state_mb"]
    if not skipped_link:  # hierarchical ZeRO-2: each host sends the model once, DDP's ring 1.5 times
        hosts = {r["strategy"]: r for r in json.loads((tmp_path / "hosts.json").read_text())["figures"]["rows"]}
        assert hosts["sharded"]["bytes_x_ddp"] < 0.8, hosts
    redraw = subprocess.run(
        [sys.executable, "-m", "benchmarks", "sharding", "--plot-only", "--out", str(tmp_path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert redraw.returncode == 0 and "world size 2" in redraw.stdout, redraw.stderr


def test_timed_steps_drop_the_warmup_and_keep_return_values():
    calls = []
    seconds, values = timing.timed_steps(lambda: calls.append(len(calls)) or len(calls), steps=3, warmup=2)
    assert len(calls) == 5 and values == [3, 4, 5] and len(seconds) == 3 and all(s >= 0 for s in seconds)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        timing.timed_steps(lambda: None, steps=0)


def test_the_bench_step_time_is_the_median_of_window_means():
    times = [1.0, 1.0, 4.0, 1.0, 1.0, 4.0, 9.0, 9.0, 9.0, 2.0, 2.0, 5.0, 7.0]  # 4 windows of 3, one step left over
    windows = timing.window_means(times, 3)
    assert windows == pytest.approx([2.0, 2.0, 9.0, 3.0])
    assert timing.step_time(windows) == pytest.approx(2.5)  # (2 + 3) / 2: the slow spell (9) does not count
    # quartiles of 2, 2, 3, 9 (inclusive): 2 and 4.5; half the range over the median 2.5
    assert timing.relative_spread(windows) == pytest.approx((4.5 - 2.0) / 2 / 2.5)
    assert timing.relative_spread([3.0]) == 0.0
    with pytest.raises(ValueError, match="window must be >= 1"):
        timing.window_means(times, 0)


def test_rounds_interleave_and_summarise():
    assert list(timing.interleaved(["a", "b"], 2)) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    summary = timing.RoundSummary.of([3.0, 1.0, 2.0])
    assert (summary.best, summary.median, summary.rounds) == (1.0, 2.0, (3.0, 1.0, 2.0))
    assert timing.ratio(1.0, 4.0) == 0.25 and timing.ratio(1.0, 0.0) is None and timing.ratio(None, 1.0) is None
    timer = timing.PhaseTimer()
    timer.start()
    timer.lap("forward")
    timer.stop()
    assert set(timer.medians_ms()) == {"forward", "step"} and timer.medians_ms()["step"] >= 0


HOSTS_SCRIPT = textwrap.dedent(
    """
    import sys
    from benchmarks.lib.netns import Hosts
    with Hosts(2) as hosts:
        print(" ".join([hosts.switch, *hosts.namespaces]), flush=True)
        sys.stdin.readline()  # the test looks at the namespaces, then says go (or sends SIGTERM meanwhile)
        raise RuntimeError("boom")
    """
)


@pytest.mark.netns
@pytest.mark.parametrize("ending", ["error", "sigterm"])
def test_hosts_are_torn_down_on_an_error_and_on_sigterm(ending):
    if why := netns_unavailable():
        pytest.skip(why)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOSTS_SCRIPT],
        cwd=ROOT,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    names = proc.stdout.readline().split()
    assert len(names) == 3
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(n in listed for n in names), listed
    if ending == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    assert proc.wait(timeout=60) == (128 + signal.SIGTERM if ending == "sigterm" else 1)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed
