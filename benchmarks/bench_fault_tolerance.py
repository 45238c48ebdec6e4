"""fault_tolerance: what `ddpkit train --fault-tolerant` costs when nothing fails, and what a lost rank costs.

Two measurements, each running the real command (`python -m ddpkit train`) on this machine:

* **overhead**: the same run on 2 local processes (held-out evaluations only at epoch ends) plain and with
  ``--fault-tolerant``, alternated for `--rounds` rounds, for ``ddp`` (a quorum, an average and a commit every
  step) and ``slowmo`` (local SGD averaging every `--outer-every` steps, the DiLoCo family's period). The figure
  is the time per step once running: each configuration runs `--steps` and 2 x `--steps` steps and the
  difference of their training times (the loop's wall time without evaluations, from metrics.json) is divided by
  `--steps` (slowmo: 3 x `--steps` and 6 x, its local steps being shorter), so that what a run spends once cancels
  out (a 600-step plain SlowMo run spent 0.96 s of its 1.8 s outside its steps, the fault-tolerant one 0.29 s);
  the ratio fault-tolerant / plain per round, and its median. The plain runs have ``--no-checkpoints``: with
  `--out` they would write a checkpoint at every epoch end (45 steps), which fault-tolerant runs do not, and
  which grows with the run (0.064 s per epoch over 33 epochs, 0.127 s over 133). torchft's figure is its whole
  runs' time per step.
* **a lost rank**: two ranks, each started by its own launcher as on two machines (loopback), with
  ``--fault-tolerant``; after `--kill-after` rounds the second one's launcher and rank get SIGKILL (the machine is
  gone) and the same command is started again at once (slowmo runs 4x `--kill-steps`: its local steps are so fast
  that the restarted process would otherwise arrive after the end). Against an uninterrupted run of the same
  length: the survivor's extra training time, the seconds it waited for the lost rank, whether the two replicas end
  bit-identical, the held-out loss of both runs, and the bytes sent per step.

**torchft** (0.2.0, when it is installed; its rows are left out with the reason otherwise) runs the ``ddp`` case
of both measurements on the same model, data split and optimizer (`benchmarks/ft_torchft_worker.py`): two
replica groups of one process, its lighthouse hosted by this process (heartbeat timeout 5 s, as torchft's
default), its Manager's quorum per step, DistributedDataParallel and OptimizerWrapper; killed and restarted on the
same schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.lib import plotting
from benchmarks.lib.cli import progress
from benchmarks.lib.tables import markdown, num

QUESTION = "fault_tolerance: what does --fault-tolerant cost per step when nothing fails, and per lost rank?"
QUICK = {"rounds": 1, "steps": 40, "kill_steps": 300, "kill_after": 30}
MODES = ("ddp", "slowmo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="plain/fault-tolerant pairs per mode")
    parser.add_argument("--steps", type=int, default=2000, help="overhead: runs of N and 2N steps (slowmo 3N, 6N)")
    parser.add_argument("--outer-every", type=int, default=50, help="slowmo: steps between averagings (H)")
    parser.add_argument("--kill-steps", type=int, default=3000, help="steps of each lost-rank run")
    parser.add_argument("--kill-after", type=int, default=300, help="rounds before the second rank is killed")
    parser.add_argument("--quorum-timeout", type=float, default=5.0, help="--quorum-timeout of the runs")


def _mode_flags(mode: str, outer_every: int) -> list[str]:
    if mode == "ddp":
        return ["--strategy", "ddp", "--optimizer", "sgd", "--lr", "0.05"]
    return ["--strategy", "slowmo", "--optimizer", "sgd", "--lr", "0.05", "--localsgd-frequency", str(outer_every),
            "--slowmo-frequency", str(outer_every), "--slowmo-momentum", "0.0"]  # fmt: skip


COMMON = ["--epochs", "1000", "--batch-size", "16", "--no-progress", "--eval-every", "0", "--timeout", "60"]


def _env() -> dict[str, str]:
    """The children's environment: this repository importable (the torchft worker), no torchrun variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), env.get("PYTHONPATH")]))
    return env


def _train(flags: list[str], out: Path, log: Path, threads: int | None = None) -> subprocess.Popen:
    """`ddpkit train` with `flags`; `threads`: OMP_NUM_THREADS of its ranks (None: ddpkit shares the cores)."""
    env = _env() | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    with open(log, "w") as sink:
        return subprocess.Popen([sys.executable, "-m", "ddpkit", "train", *flags, "--out", str(out)], env=env,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    if proc.wait(timeout) != 0:
        raise RuntimeError(f"ddpkit train failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "metrics.json").read_text())["summary"]


def _marginal_ms(flags: list[str], steps: int, out: Path) -> tuple[float, float]:
    """The run's time per step once it runs: (T(2 x steps) - T(steps)) / steps from two runs of the command, so
    that what a run spends once (the first steps' set-up, the first round's group) cancels out; and its bytes
    sent per step."""
    seconds = []
    for length in (steps, 2 * steps):
        run_out = out.with_name(f"{out.name}-{length}")
        log = run_out.with_suffix(".log")
        _finish(_train([*flags, "--max-steps", str(length)], run_out, log), log)
        summary = _summary(run_out)
        seconds.append(summary["training_seconds"])
    return 1000 * (seconds[1] - seconds[0]) / steps, summary["sent_bytes_per_step"]


def overhead(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    runs = [(mode, r) for mode in MODES for r in range(args.rounds)]
    for mode, r in progress(runs, desc="overhead"):
        flags = [*_mode_flags(mode, args.outer_every), *COMMON, "--nproc-per-node", "2"]
        steps = args.steps * (3 if mode == "slowmo" else 1)  # local steps are short: as long a run as ddp's
        times = {}
        # plain runs would also write a checkpoint at every epoch end (45 steps here), which --fault-tolerant does not
        for kind, extra in (("plain", ["--no-checkpoints"]), ("fault_tolerant", ["--fault-tolerant"])):
            times[kind] = _marginal_ms([*flags, *extra], steps, work / f"{mode}-{kind}-{r}")
        rows.append({"mode": mode, "round": r, "plain_ms": times["plain"][0], "fault_tolerant_ms":
                     times["fault_tolerant"][0], "ratio": times["fault_tolerant"][0] / times["plain"][0],
                     "plain_bytes": times["plain"][1], "fault_tolerant_bytes": times["fault_tolerant"][1]})  # fmt: skip
    return rows


def _latest_round(store: Any) -> int:
    return int(store.get("ddpkit/ft/latest")) if store.check(["ddpkit/ft/latest"]) else -1


def _two_nodes(flags: list[str], work: Path, name: str, kill_after: int | None) -> dict[str, Any]:
    """A 2-rank fault-tolerant job, one launcher per rank; with `kill_after`, the second is killed after that many
    rounds and started again. Returns the survivor's summary (it writes the outputs)."""
    from ddpkit.distributed.launch import free_port

    port = free_port()
    where = ["--fault-tolerant", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
             "--master-port", str(port)]  # fmt: skip
    # one thread per rank: two launchers on this machine would each take every core (two machines have their own)
    procs = [_train([*flags, *where, "--node-rank", str(n)], work / f"{name}-{n}", work / f"{name}-{n}.log", 1)
             for n in range(2)]  # fmt: skip
    if kill_after is not None:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        deadline = time.monotonic() + 600
        while _latest_round(store) < kill_after:
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError(f"{name}: the job did not reach round {kill_after}")
            time.sleep(0.1)
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        again = work / f"{name}-1-again"
        procs[1] = _train([*flags, *where, "--node-rank", "1"], again, work / f"{again.name}.log", 1)
    _finish(procs[0], work / f"{name}-0.log")
    if kill_after is None:
        _finish(procs[1], work / f"{name}-1.log")
    else:
        procs[1].wait(300)  # the rank started again: its rejoining is read from the survivor's record
    return _summary(work / f"{name}-0")


def lost_rank(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    for mode in progress(MODES, desc="lost rank"):
        steps = args.kill_steps * (4 if mode == "slowmo" else 1)  # local steps are fast: time to start again
        flags = [*_mode_flags(mode, args.outer_every), *COMMON, "--max-steps", str(steps),
                 "--quorum-timeout", str(args.quorum_timeout)]  # fmt: skip
        kill_after = args.kill_after if mode == "ddp" else max(1, args.kill_after // args.outer_every)
        calm = _two_nodes(flags, work, f"{mode}-calm", None)
        hit = _two_nodes(flags, work, f"{mode}-killed", kill_after)
        events = hit["membership"]
        rows.append({
            "mode": mode,
            "killed_after_round": kill_after,
            "calm_training_s": calm["training_seconds"],
            "killed_training_s": hit["training_seconds"],
            "extra_s": hit["training_seconds"] - calm["training_seconds"],
            "waited_s": sum(e["waited_seconds"] for e in events),
            "held_up_s": sum(e["blocked_seconds"] for e in events),
            "left": [e["round"] for e in events if e["left"]],
            "joined": [e["round"] for e in events if e["joined"]],
            "dropped_rounds": sum(1 for e in events if e["committed"] is False),
            "replicas_equal": hit["replicas_equal"],
            "calm_test_loss": calm["test_loss"],
            "killed_test_loss": hit["test_loss"],
            "bytes_per_step": hit["sent_bytes_per_step"],
        })  # fmt: skip
    return rows


def _torchft_job(args: argparse.Namespace, work: Path, name: str, steps: int, kill_after: int | None) -> dict:
    """Two torchft replicas of the ddp case; with `kill_after`, replica 1 is killed after that many steps and
    started again. Returns replica 0's figures."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=5000)

    def start(replica: int, tag: str) -> subprocess.Popen:
        command = [
            sys.executable,
            "-m",
            "benchmarks.ft_torchft_worker",
            str(replica),
            "2",
            str(steps),
            lighthouse.address(),
            str(work / f"{name}-{replica}{tag}.json"),
            str(args.quorum_timeout),
            str(work / f"{name}.go"),
        ]
        with open(work / f"{name}-{replica}{tag}.log", "w") as log:
            return subprocess.Popen(command, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    try:
        procs = [start(0, ""), start(1, "")]
        while not all((work / f"{name}-{r}.json.ready").exists() for r in range(2)):
            if any(proc.poll() is not None for proc in procs):
                raise RuntimeError(f"torchft {name}: {(work / f'{name}-0.log').read_text()[-3000:]}")
            time.sleep(0.05)
        (work / f"{name}.go").touch()
        if kill_after is not None:
            marker, deadline = work / f"{name}-0.json.step", time.monotonic() + 600
            while not (marker.exists() and marker.read_text() and int(marker.read_text()) >= kill_after):
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise RuntimeError(f"torchft {name}: replica 0 did not reach step {kill_after}")
                time.sleep(0.05)
            os.killpg(procs[1].pid, signal.SIGKILL)
            procs[1].wait()
            procs[1] = start(1, "-again")
        for proc in procs:
            if proc.wait(900) != 0:
                raise RuntimeError(f"torchft {name} failed: {(work / f'{name}-0.log').read_text()[-3000:]}")
    finally:
        lighthouse.shutdown()
    return json.loads((work / f"{name}-0.json").read_text())


def torchft_figures(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """torchft's ddp case: time per step without failures (`--rounds` runs) and the lost-rank schedule."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"torchft does not import ({exc}); pip install torchft==0.2.0 with torch pinned"}
    calm_runs = [_torchft_job(args, work, f"torchft-calm{r}", args.steps, None)
                 for r in progress(range(args.rounds), desc="torchft")]  # fmt: skip
    calm = _torchft_job(args, work, "torchft-long", args.kill_steps, None)
    try:
        hit = _torchft_job(args, work, "torchft-killed", args.kill_steps, args.kill_after)
    except RuntimeError as exc:  # torchft's survivor itself may fail when its peer is killed: that is a result
        last = [line for line in str(exc).splitlines() if line.strip()][-1:]
        return {"ms_per_step": [1000 * r["training_seconds"] / r["steps"] for r in calm_runs],
                "survivor_failed": last[0] if last else str(exc)[:200]}  # fmt: skip
    return {
        "ms_per_step": [1000 * r["training_seconds"] / r["steps"] for r in calm_runs],
        "calm_training_s": calm["training_seconds"],
        "killed_training_s": hit["training_seconds"],
        "extra_s": hit["training_seconds"] - calm["training_seconds"],
        "calm_test_loss": calm["test_loss"],
        "killed_test_loss": hit["test_loss"],
        "one_participant_steps": sum(1 for n in hit["participants"] if n < 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ddpkit-ft-bench-") as tmp:
        work = Path(tmp)
        figures = {"overhead": overhead(args, work), "lost_rank": lost_rank(args, work)}
        figures["torchft"] = torchft_figures(args, work)
    return figures


def _median_ratio(rows: list[dict[str, Any]], mode: str) -> float:
    return statistics.median(r["ratio"] for r in rows if r["mode"] == mode)


def table(report: dict[str, Any]) -> str:
    figures = report["figures"]
    rows = [[mode, num(statistics.median(r["plain_ms"] for r in figures["overhead"] if r["mode"] == mode)),
             num(statistics.median(r["fault_tolerant_ms"] for r in figures["overhead"] if r["mode"] == mode)),
             num(_median_ratio(figures["overhead"], mode), ".3f"),
             " ".join(num(r["ratio"], ".3f") for r in figures["overhead"] if r["mode"] == mode)]
            for mode in MODES]  # fmt: skip
    first = markdown(["mode", "plain ms/step", "fault-tolerant ms/step", "median ratio", "ratio per round"], rows)
    lost = [[r["mode"], r["killed_after_round"], num(r["calm_training_s"], ".1f"), num(r["killed_training_s"], ".1f"),
             num(r["extra_s"], ".1f"), num(r["waited_s"], ".1f"), num(r["held_up_s"], ".1f"), r["dropped_rounds"],
             "yes" if r["replicas_equal"] else "NO", num(r["calm_test_loss"], ".4f"), num(r["killed_test_loss"], ".4f"),
             num(r["bytes_per_step"] / 1e3, ".1f")] for r in figures["lost_rank"]]  # fmt: skip
    header = ["mode", "killed after round", "calm s", "with a loss s", "extra s", "waited s", "held up s",
              "dropped rounds",
              "replicas equal", "calm held-out loss", "held-out loss", "kB/step"]  # fmt: skip
    return f"{first}\n\n{markdown(header, lost)}\n\n{_torchft_table(figures['torchft'])}"


def _torchft_table(ft: dict[str, Any]) -> str:
    if "skipped" in ft:
        return f"torchft: skipped: {ft['skipped']}"
    if "survivor_failed" in ft:
        return (
            f"torchft 0.2.0, ddp case: {num(statistics.median(ft['ms_per_step']))} ms/step (median) without "
            f"failures; with the lost replica its survivor failed too: {ft['survivor_failed']}"
        )
    header = ["torchft 0.2.0, ddp case", "ms/step (median)", "calm s", "with a loss s", "extra s",
              "steps with one replica", "calm held-out loss", "held-out loss"]  # fmt: skip
    row = [num(statistics.median(ft["ms_per_step"])), num(ft["calm_training_s"], ".1f"),
           num(ft["killed_training_s"], ".1f"), num(ft["extra_s"], ".1f"), ft["one_participant_steps"],
           num(ft["calm_test_loss"], ".4f"), num(ft["killed_test_loss"], ".4f")]  # fmt: skip
    return markdown(header, [["torchft", *row]])


def plot(report: dict[str, Any], out_dir: Path) -> None:
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rows = report["figures"]["overhead"]
    for i, mode in enumerate(MODES):
        ratios = [r["ratio"] for r in rows if r["mode"] == mode]
        ax.scatter([i] * len(ratios), ratios, label=mode)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks(range(len(MODES)), MODES)
    ax.set_ylabel("fault-tolerant / plain time per step")
    ax.set_title(plotting.title("digits MLP, --fault-tolerant vs plain", 2, report), fontsize=8)
    plotting.save(fig, "fault_tolerance", out_dir)
