"""The advisor: fitting a link, the step-time prediction, the recommendation, the bench's step budget, and the
bench's per-strategy figures (wire bytes, messages) counted at 2 ranks against what each strategy must send."""

from __future__ import annotations

import os
import re
import statistics
import sys
from pathlib import Path

import pytest
import warm_processes

from ddpkit.measure import advisor
from ddpkit.measure.advisor import Link, advise, fit_link, link_from_mbit, predict_seconds
from ddpkit.testing import run_distributed
from ddpkit.train.loop import bench
from ddpkit.train.settings.config import STRATEGIES

HERE = Path(__file__).resolve().parent


FAST = Link(1e9, 1e-4, "test")


def _result(name, step_ms, wire, messages, memory, link=FAST, **more):
    figures = {"step_ms": step_ms, "wire_bytes_per_step": wire, "messages_per_step": messages, **more}
    link_fields = {"bandwidth": link.bandwidth, "latency": link.latency, "source": link.source}
    return {"strategy": name, **figures, "peak_memory_mb": memory, "link": link_fields}


def test_fit_link_recovers_bandwidth_and_latency():
    bandwidth, latency = 12.5e6, 2e-3
    points = [(w, latency + w / bandwidth) for w in (4096.0, 4 << 20)]
    link = fit_link(points[0], points[1], "test")
    assert link.bandwidth == pytest.approx(bandwidth) and link.latency == pytest.approx(latency)
    assert link.mbit == pytest.approx(100.0)
    noisy = fit_link((4096.0, 0.01), (1e6, 0.009), "test")  # the large call was faster: no latency to separate
    assert noisy.bandwidth == pytest.approx(1e6 / 0.009) and noisy.latency == 0.0
    assert link_from_mbit(100, 0.5) == Link(12.5e6, 5e-4, "given")
    with pytest.raises(ValueError, match="--link-mbit must be > 0"):
        link_from_mbit(0)


def test_prediction_formula():
    here = Link(1e9, 1e-4, "loopback")
    there = Link(12.5e6, 1e-3, "given")
    r = _result("ddp", step_ms=30.0, wire=2.5e6, messages=4, memory=100, link=here)
    compute = 0.030 - (2.5e6 / 1e9 + 4 * 1e-4)
    assert predict_seconds(r, here, there) == pytest.approx(compute + 2.5e6 / 12.5e6 + 4 * 1e-3)
    assert predict_seconds(r, here, here) == pytest.approx(0.030)  # the link it was measured on: as measured
    tiny = _result("ddp", step_ms=0.1, wire=2.5e6, messages=4, memory=100, link=here)
    assert predict_seconds(tiny, here, there) == pytest.approx(0.2 + 0.004)  # compute never below zero
    # ... nor below the bare model's measured step: the link model took more than the whole 0.1 ms step
    floored = _result("ddp", step_ms=0.1, wire=2.5e6, messages=4, memory=100, link=here, local_compute_ms=0.08)
    assert predict_seconds(floored, here, there) == pytest.approx(0.08e-3 + 0.2 + 0.004)
    assert predict_seconds(floored, here, here) >= 0.08e-3
    # a floor timed above the whole step (a cold process, a loaded moment) is capped at the step
    cold = _result("ddp", step_ms=0.1, wire=2.5e6, messages=4, memory=100, link=here, local_compute_ms=9.0)
    assert predict_seconds(cold, here, there) == pytest.approx(0.1e-3 + 0.2 + 0.004)


def test_recommendation_picks_fastest_then_least_memory_and_says_why():
    results = [
        _result("ddp", 20.0, 8e6, 2, 1000),
        _result("oss", 22.0, 12e6, 6, 800),
        _result("sharded", 15.0, 8e6, 6, 700),
        _result("slowmo", 19.0, 8e6 / 3, 1, 1000),
    ]
    here = advise(results, None)
    assert here.strategy == "sharded" and here.seconds["ddp"] == pytest.approx(0.020)
    assert here.reason.startswith("sharded: 0.75x ddp's step time and 0.70x its peak memory measured here")
    assert "slowmo (local SGD, averaging every 3 steps) runs at 1.1x" in here.reason
    only_ddp = advise([_result("ddp", 20.0, 8e6, 2, 1000)], None)
    assert only_ddp.strategy == "ddp" and only_ddp.reason == "ddp: the fastest, 20.0 ms per step measured here"
    slow = advise(results, link_from_mbit(100, 0.5))  # 8 MB per step at 12.5 MB/s: DDP is communication-bound
    assert slow.strategy == "slowmo" and slow.seconds["slowmo"] < slow.seconds["ddp"] / 2
    assert "DDP is communication-bound" in slow.reason and "check that your model converges" in slow.reason
    fast = advise(results, Link(1e12, 0.0, "given"))
    assert fast.strategy == "sharded" and "compute-bound" in fast.reason and "slowmo (local SGD" in fast.reason
    near = advise([_result("ddp", 20.0, 0, 0, 1000), _result("sharded", 20.5, 0, 0, 600)], None)
    assert near.strategy == "sharded"  # within 5% of the fastest: the smaller memory wins
    assert near.reason.startswith("no clear winner: ddp, sharded within 5% of the fastest step time")
    assert "no clear winner" not in here.reason  # sharded 15 ms, slowmo 19 ms: 27% apart
    # noisy windows widen the margin: half-IQRs of 6% and 9% make 15%; 22 ms is within it, 23.5 ms is not
    noisy = [_result("ddp", 20.0, 0, 0, 1000, step_spread=0.06), _result("oss", 22.0, 0, 0, 800, step_spread=0.09)]
    assert advise(noisy, None).strategy == "oss" and "within 15%" in advise(noisy, None).reason
    noisy[1]["step_ms"] = 23.5
    assert advise(noisy, None).strategy == "ddp" and "no clear winner" not in advise(noisy, None).reason
    text = advisor.format_advice(results, link_from_mbit(100, 0.5))
    assert "predicted for 100 Mbit/s" in text and text.splitlines()[-1].startswith("recommendation: slowmo")


def test_the_recommendation_follows_from_the_table_it_prints():
    """Crafted results: the advice may never call a strategy "the fastest" that its own table shows
    slower, and where time and peak memory tie, the strategy holding less optimizer state wins (the least memory
    wins), then the faster one, whatever the order of the results."""
    noisy = {"step_spread": 0.25}  # windows this noisy put all three within the margin
    results = [
        _result("ddp", 2257.5, 0, 0, 1000, optimizer_state_bytes_per_rank=8e6, **noisy),
        _result("oss", 1506.0, 0, 0, 980, optimizer_state_bytes_per_rank=4e6, **noisy),
        _result("sharded", 1808.0, 0, 0, 990, optimizer_state_bytes_per_rank=4e6, **noisy),
    ]
    for ordered in (results, results[::-1]):
        advice = advise(ordered, None)
        assert advice.strategy == "oss", advice.reason  # half ddp's state, and faster than sharded
        assert "ddp: the fastest" not in advice.reason and "least optimizer state" in advice.reason
    # ddp chosen while not the fastest: the reason says how it compares, not "the fastest"
    heavy = [_result("ddp", 2257.5, 0, 0, 500, optimizer_state_bytes_per_rank=8e6, **noisy), *results[1:]]
    advice = advise(heavy, None)
    assert advice.strategy == "ddp"
    assert "; ddp: 2257.5 ms per step measured here, 1.50x the fastest (oss, 1506.0 ms)" in advice.reason
    # the fastest among equals on memory and state
    tie = [
        _result("ddp", 20.0, 0, 0, 600, optimizer_state_bytes_per_rank=1e6),
        _result("sharded", 19.5, 0, 0, 600, optimizer_state_bytes_per_rank=1e6),
    ]
    assert advise(tie, None).strategy == "sharded" and advise(tie[::-1], None).strategy == "sharded"


def test_step_budget():
    assert bench.step_budget(20, 3, None, 3) == (21, 3)
    assert bench.step_budget(3, 1, None, 3) == (3, 3)  # SlowMo's first averaging falls in the warm-up
    assert bench.step_budget(20, 3, 12, 3) == (9, 3)
    assert bench.step_budget(20, 6, 24, 3) == (18, 6)
    assert bench.step_budget(20, 3, 2, 3) == (2, 0)
    with pytest.raises(ValueError, match="--steps must be >= 1"):
        bench.step_budget(0, 3, None, 3)
    with pytest.raises(ValueError, match="--hosts needs 2"):
        bench.bench_config({"hosts": "10.0.0.1"})
    cfg = bench.bench_config({"hosts": "10.0.0.1,10.0.0.2", "node_rank": 1})
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.nproc_per_node) == (2, 1, "10.0.0.1", 1)
    assert bench.bench_config({"model": "gpt"}).data == "text"


def _bench_every_strategy(rank: int, world_size: int) -> list[dict]:
    from ddpkit.distributed.launch import Placement

    cfg = bench.bench_config({"nproc_per_node": world_size, "hidden": 32, "depth": 1, "batch_size": 8})
    placement = Placement(rank, world_size, rank, "127.0.0.1", 0)
    os.environ["DDPKIT_SHARED_MEMORY"] = "0"  # every byte over sockets, as between hosts
    try:
        return [bench._measure(cfg.__class__(**{**vars(cfg), "strategy": s}), 3, 3, placement) for s in STRATEGIES]
    finally:
        del os.environ["DDPKIT_SHARED_MEMORY"]


def test_bench_figures_count_what_each_strategy_sends():
    results = run_distributed(_bench_every_strategy, 2, timeout=300)
    assert results[0] == results[1]  # every figure is agreed over ranks
    by = {r["strategy"]: r for r in results[0]}
    parameter_bytes = 4 * by["ddp"]["parameters"]  # 1024 -> 32 -> 10 MLP
    assert by["ddp"]["parameters"] == 1024 * 32 + 32 + 32 * 10 + 10
    # ring all-reduce at 2 ranks: each rank sends 2 (N-1)/N = 1 copy of the gradients per step
    assert by["ddp"]["wire_bytes_per_step"] == pytest.approx(parameter_bytes)
    # ZeRO-2 over sockets: a reduce to the owner and the owner's broadcast, the all-reduce's bytes in total
    assert by["sharded"]["sent_bytes_per_step"] == pytest.approx(by["ddp"]["sent_bytes_per_step"], rel=1e-6)
    # SlowMo with one process per node: parameters all-reduced every 3rd step only
    assert by["slowmo"]["wire_bytes_per_step"] == pytest.approx(parameter_bytes / 3)
    assert by["oss"]["wire_bytes_per_step"] > by["ddp"]["wire_bytes_per_step"]  # + the parameter broadcast
    for r in results[0]:
        assert r["messages_per_step"] > 0 and r["shared_memory_bytes_per_step"] == 0
        assert r["step_ms"] > 0 and r["timed_steps"] == 3 and r["warmup_steps"] == 3
        assert r["step_ms"] == statistics.median(r["step_ms_windows"]) and len(r["step_ms_windows"]) == 1
        assert 0 < r["local_compute_ms"] and "median over windows of 3" in r["step_statistic"]
        link = Link(**r["link"])
        assert link.bandwidth > 1e6 and link.latency < 0.1  # loopback: far faster than 8 Mbit/s
    advice = advise(results[0], link_from_mbit(10, 1.0))
    ddp = by["ddp"]
    assert advice.seconds["ddp"] == pytest.approx(predict_seconds(ddp, Link(**ddp["link"]), link_from_mbit(10, 1.0)))
    assert advice.strategy == "slowmo"  # a third of the bytes on a 10 Mbit/s link


@pytest.mark.slow
def test_bench_command_with_factories_and_a_link(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    argv = ["--model", "test_factories:regression_model", "--data", "test_factories:regression_data"]
    argv += ["--strategies", "ddp,slowmo", "--link-mbit", "100", "--max-steps", "6", "--timeout", "60"]
    argv += ["--out", str(tmp_path / "bench")]  # bench.json and bench.png go there
    done = warm_processes.run([sys.executable, "-m", "ddpkit", "bench", *argv], env, os.getcwd(), 240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "predicted for 100 Mbit/s" in done.stdout and "recommendation: " in done.stdout
    import json

    results = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert [r["strategy"] for r in results] == ["ddp", "slowmo"]
    assert all(r["timed_steps"] + r["warmup_steps"] <= 6 and r["parameters"] == 5 for r in results)
    assert results[0]["workload"] == "test_factories:regression_model on test_factories:regression_data"
    assert (tmp_path / "bench" / "bench.png").read_bytes().startswith(b"\x89PNG")
    # one statistic everywhere: the table prints each JSON step_ms, the recommendation is advise() on the JSON,
    # and no prediction falls below the bare model's measured step
    for r in results:
        assert re.search(rf"^{r['strategy']}\s+{r['step_ms']:.1f}\s", done.stdout, re.M), done.stdout
    advice = advise(results, link_from_mbit(100))
    assert f"recommendation: {advice.reason}" in done.stdout
    assert all(advice.seconds[r["strategy"]] * 1e3 >= r["local_compute_ms"] for r in results)
    assert "step ms: median over windows of 3 consecutive steps" in done.stdout


def test_plots(tmp_path):
    from ddpkit.measure.plots import plot_bench, plot_run, run_title, smooth, smoothing_weight

    assert smooth([5.0, 5.0, 5.0], 0.9) == pytest.approx([5.0, 5.0, 5.0])  # bias-corrected: no pull towards 0
    assert smooth([0.0, 10.0], 0.5) == pytest.approx([0.0, 10.0 * 0.5 / 0.75])
    assert smoothing_weight(60) == pytest.approx(1 - 10 / 60) and smoothing_weight(10**6) == 0.98
    results = [
        {
            **_result(name, 10.0, 1e6, 2, 300),
            "sent_bytes_per_step": 1e6,
            "shared_memory_bytes_per_step": shared,
            "optimizer_state_bytes_per_rank": 4e6,
            "parameters": 1e6,
            "workload": "gpt on text",
            "world_size": 2,
        }
        for name, shared in (("ddp", 0.0), ("sharded", 5e5))
    ]
    plot_bench(results, str(tmp_path / "bench.png"), link_from_mbit(100))
    summary = {"strategy": "ddp", "world_size": 2, "workload": "gpt on text", "title": "adam lr 0.001", "steps": 3}
    assert run_title(summary) == "ddp on 2 processes, gpt on text, adam lr 0.001, 3 steps"
    steps = [{"step": i, "loss": 5.0 - i, "sent_bytes": 10.0, "shared_bytes": 0.0} for i in range(3)]
    plot_run(str(tmp_path / "metrics.png"), {**summary, "heldout_bits_per_byte": 4.0}, [], steps)
    for name in ("bench.png", "metrics.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_the_bytes_panel_draws_the_summarys_means_beside_rank_0s_rows():
    """metrics.png's bytes panel: rank 0's own rows, and the means over ranks that the summary prints (ranks send
    different amounts), each named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddpkit.measure.plots import _bytes_panel

    steps = [{"step": i, "sent_bytes": 1e5, "shared_bytes": 1.56e5} for i in range(3)]
    figure, ax = plt.subplots()
    _bytes_panel(ax, steps, {"sent_bytes_per_step": 2e5, "shared_memory_bytes_per_step": 3.4e5})
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    plt.close(figure)
    assert lines["network, rank 0"] == [0.1] * 3 and lines["shared memory, rank 0 (not on the wire)"] == [0.156] * 3
    assert lines["network, mean over ranks"] == [0.2, 0.2] and lines["shared memory, mean over ranks"] == [0.34] * 2
