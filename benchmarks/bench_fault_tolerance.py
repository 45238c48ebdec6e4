"""fault_tolerance: what `ddpkit train --fault-tolerant` costs when nothing fails, and what a lost rank costs, beside
torchft 0.2.0 on the same model and failure schedule.

Every ddpkit figure comes from the real command (`python -m ddpkit train`) on this machine, 2 ranks, SGD (lr 0.05,
momentum 0.9; AdamW lr 0.001 inside DiLoCo), for each workload of `--workloads`:

* ``digits``: `ddpkit train`'s default model and data (an MLP on the digits, 85,002 parameters), batch 16 per rank:
  steps of a few ms, where any per-step cost shows;
* ``gpt``: the byte GPT (``--model gpt --data text``, 2 layers of width 128, 4 heads, context 64), batch 16 per
  rank: steps of 60-120 ms on one core here (2 ranks, ddp; two measurements under different loads),

and each mode of `--modes`, beside torchft's counterpart (`benchmarks/ft_torchft_worker.py`):

* ``ddp``: a quorum, an average and a commit every step; torchft: DistributedDataParallel + OptimizerWrapper;
* ``slowmo``: local SGD, the parameters averaged every `--outer-every` (H) steps (SlowMo with slow momentum 0 and slow
  lr 1); torchft: LocalSGD(sync_every=H);
* ``diloco``: the same with DiLoCo's outer step (``--slowmo-nesterov --slowmo-lr 0.7 --slowmo-momentum 0.9``: ddpkit's
  slow step is torch's Nesterov SGD on the pseudo-gradient); torchft: DiLoCo with an outer SGD(lr=0.7,
  momentum=0.9, nesterov=True) over the model, sync_every=H.

**The clock**, one for all: the training loop's wall time, everything after each step included (the commit, the
averaging, a membership change), without held-out evaluations. ddpkit's is ``training_seconds`` of metrics.json,
for plain and fault-tolerant runs alike; torchft's worker times its loop from its first step to its last.

* **Overhead** (nothing fails): for each of `--rounds` rounds, plain ddpkit, ddpkit ``--fault-tolerant`` and
  torchft, on 2 local processes, each run N and 2N steps; the figure is (T(2N) - T(N)) / N, so that what a run
  spends once (its first steps, the first round's group) cancels out (a 600-step plain SlowMo run spent 0.96 s of
  its 1.8 s outside its steps, the fault-tolerant one 0.29 s). N is `--steps` for digits (3x for the local modes,
  whose steps are shorter) and `--gpt-steps` for gpt. The plain runs have ``--no-checkpoints``: with `--out` they
  would write a checkpoint at every epoch end (45 digits steps), which fault-tolerant runs do not, and which grows
  with the run (0.064 s per epoch over 33 epochs, 0.127 s over 133).
* **A lost rank**: two ranks, each started by its own launcher as on two machines (loopback, one thread each),
  with ``--fault-tolerant``; after `--kill-after` rounds (`--gpt-kill-after`; the local modes: that many steps'
  worth of rounds) the second one's launcher and rank get SIGKILL (the machine is gone) and the same command is
  started again at once. Digits' local modes run 4x `--kill-steps`: their local steps are so fast that the
  restarted process would otherwise arrive after the end. Against an uninterrupted run of the same length: the
  survivor's extra training time, the seconds it waited for the lost rank, whether the two replicas end
  bit-identical, the held-out loss of both runs, and the bytes sent per step. torchft: two replica groups of one
  process, its lighthouse hosted by this process (heartbeat timeout 5 s, as torchft's default), killed and
  restarted on the same schedule; its survivor may fail when its peer is killed, which is recorded as the result.

Without failures torchft trains exactly what ddpkit trains (its replicas built from the same seed, so without
torchft's initial sync, which would overwrite replica 1's first round): after 100 digits steps the held-out loss of
each mode equals ddpkit's to 1e-6. ``diloco`` steps AdamW (lr 0.001) inside, as the DiLoCo paper: with the SGD
of the other modes inside it diverges on digits on both sides alike (held-out loss 2.34 after 1,500 steps).
torchft's rows are left out, with the reason, where it does not import.

``--quick`` is a smoke test, not a measurement, sized to stay under 30 s on 2 cores although every run spends
seconds of CPU starting (torch, the data, the first backward): digits and ddp only, one run of N steps per
configuration on one rank of one thread (T(N) / N, its set-up included), the overhead's runs and the lost rank at
once, the lost rank without its uninterrupted twin and not restarted (the run is over before it could be back),
torchft skipped with the reason "--quick".
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist  # here: imported in the lost-rank thread, it started that section seconds late

from benchmarks.lib import plotting
from benchmarks.lib.cli import UsageError, progress
from benchmarks.lib.tables import markdown, num
from ddpkit.distributed.launch import free_port

QUESTION = "fault_tolerance: what does --fault-tolerant cost per step when nothing fails, and per lost rank?"
QUICK = {
    "workloads": "digits",
    "modes": "ddp",
    "rounds": 1,
    "steps": 40,
    "kill_steps": 100,
    "kill_after": 30,
    "quorum_timeout": 1.0,
}
MODES = ("ddp", "slowmo", "diloco")
TORCHFT = {"ddp": "ddp", "slowmo": "localsgd", "diloco": "diloco"}  # torchft's counterpart of each mode


@dataclass(frozen=True)
class Workload:
    label: str  # how the plot names it
    fields: dict[str, Any]  # its TrainConfig fields (flags of `ddpkit train`), beside the mode's
    local_scale: int  # overhead: the local modes' runs are this many times longer (their steps are shorter)
    kill_scale: int  # a lost rank: the same, so that the restarted rank is back before the end


GPT = {"model": "gpt", "data": "text", "gpt_layers": 2, "gpt_width": 128, "gpt_heads": 4, "context": 64}
WORKLOADS = {
    "digits": Workload("digits MLP", {"batch_size": 16}, local_scale=3, kill_scale=4),
    "gpt": Workload("byte GPT", {**GPT, "batch_size": 16}, local_scale=1, kill_scale=1),
}
OPTIMIZER = {"optimizer": "sgd", "lr": 0.05}
DILOCO_INNER = {"optimizer": "adamw", "lr": 0.001}  # DiLoCo's inner AdamW (with SGD inside it diverges on digits)
SECTIONS = ("overhead", "lost_rank")
WINDOW = 10  # ddp's windowed figure: steps per window (`windowed_ms`)
COMMON = ["--epochs", "1000", "--no-progress", "--eval-every", "0", "--timeout", "60"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="digits,gpt", help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=3, help="overhead: rounds of plain, fault-tolerant, torchft")
    parser.add_argument("--steps", type=int, default=2000, help="digits overhead: runs of N and 2N steps (local 3x)")
    parser.add_argument("--gpt-steps", type=int, default=100, help="gpt overhead: runs of N and 2N steps")
    parser.add_argument("--outer-every", type=int, default=50, help="slowmo, diloco: steps between averagings (H)")
    parser.add_argument("--kill-steps", type=int, default=3000, help="digits: steps of each lost-rank run (local 4x)")
    parser.add_argument("--kill-after", type=int, default=300, help="digits: steps before the second rank is killed")
    parser.add_argument("--gpt-kill-steps", type=int, default=400, help="gpt: steps of each lost-rank run")
    parser.add_argument("--gpt-kill-after", type=int, default=100, help="gpt: steps before the second rank is killed")
    parser.add_argument("--quorum-timeout", type=float, default=5.0, help="--quorum-timeout of the runs")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")


# ---------------------------------------------------------------------------------------------------------------
# What runs: a workload in a mode, for how many steps


def _names(text: str, known: tuple[str, ...], option: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"{option}: {', '.join(unknown) or 'none given'}; choose from {', '.join(known)}")
    return names


def _cases(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(workload, mode) pairs to run; checks that every local mode's run is a whole number of rounds."""
    cases = [
        (w, m)
        for w in _names(args.workloads, tuple(WORKLOADS), "--workloads")
        for m in _names(args.modes, MODES, "--modes")
    ]
    for workload, mode in cases:
        for steps in (_overhead_steps(args, workload, mode), _kill_plan(args, workload, mode)[0]):
            if mode != "ddp" and steps % args.outer_every:
                raise UsageError(f"{workload} {mode}: {steps} steps is not a multiple of --outer-every")
    return cases


def _fields(workload: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """The run's TrainConfig fields: the workload's, SGD's and the mode's (ddpkit's flags, torchft's config)."""
    fields = {**WORKLOADS[workload].fields, **OPTIMIZER}
    if mode == "ddp":
        return {**fields, "strategy": "ddp"}
    h = args.outer_every
    outer = (
        {"slowmo_momentum": 0.0}
        if mode == "slowmo"
        else {**DILOCO_INNER, "slowmo_momentum": 0.9, "slowmo_lr": 0.7, "slowmo_nesterov": True}
    )
    return {**fields, "strategy": "slowmo", "localsgd_frequency": h, "slowmo_frequency": h, **outer}


def _flags(fields: dict[str, Any]) -> list[str]:
    """`ddpkit train`'s flags for TrainConfig `fields` (True: the bare flag)."""
    from ddpkit.train.settings.config import flag

    words = []
    for name, value in fields.items():
        words += [flag(name)] if value is True else [flag(name), str(value)]
    return words


def _overhead_steps(args: argparse.Namespace, workload: str, mode: str) -> int:
    steps = args.gpt_steps if workload == "gpt" else args.steps
    return steps * (WORKLOADS[workload].local_scale if mode != "ddp" else 1)


def _kill_plan(args: argparse.Namespace, workload: str, mode: str) -> tuple[int, int]:
    """(steps of each lost-rank run, rounds before the kill)."""
    if workload == "gpt":
        steps, after = args.gpt_kill_steps, args.gpt_kill_after
    else:
        steps, after = args.kill_steps, args.kill_after
    if mode == "ddp":
        return steps, after
    return steps * WORKLOADS[workload].kill_scale, max(1, after // args.outer_every)


# ---------------------------------------------------------------------------------------------------------------
# Running `ddpkit train`


def _env() -> dict[str, str]:
    """The children's environment: this repository importable (the torchft worker), no torchrun variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), env.get("PYTHONPATH")]))
    return env


def _train(flags: list[str], out: Path, threads: int | None = None) -> subprocess.Popen:
    """`ddpkit train` with `flags`, its output in OUT.log; `threads`: OMP_NUM_THREADS of its ranks (None: ddpkit
    shares the cores)."""
    env = _env() | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    with open(out.with_suffix(".log"), "w") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "train", *COMMON, *flags, "--out", str(out)],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 900) -> None:
    """Waits for the run writing to `out`; raises with its log's end if it failed."""
    if proc.wait(timeout) != 0:
        log = out.with_suffix(".log").read_text()[-3000:]
        raise RuntimeError(f"ddpkit train failed (exit {proc.returncode}):\n{log}")


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "metrics.json").read_text())["summary"]


def _linger(proc: subprocess.Popen, seconds: float) -> None:
    """Gives a restarted rank `seconds` to end after the survivor did; then SIGKILL (it came back too late)."""
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _ddpkit_run(flags: list[str], prefix: Path, threads: int | None, steps: int) -> dict[str, Any]:
    """The summary of `ddpkit train` with `flags` for `steps` steps, written to PREFIX-STEPS, with ``step_ends``:
    the loop's time at each step's end (steps.csv's ``loop_seconds``)."""
    out = prefix.with_name(f"{prefix.name}-{steps}")
    _finish(_train([*flags, "--max-steps", str(steps)], out, threads), out)
    with open(out / "steps.csv") as rows:
        ends = [float(row["loop_seconds"]) for row in csv.DictReader(rows)]
    return {**_summary(out), "step_ends": ends}


def windowed_ms(ends: list[float], window: int) -> float:
    """ms per step: the median, over the run's windows of `window` consecutive steps after a warm-up (the first
    tenth of the run, at least one window), of each window's mean. A window as long as the averaging period holds
    one averaging, so periodic costs count in full while a burst of the machine's other work moves one window only
    (which the median leaves out)."""
    start = max(window, len(ends) // 10)
    spans = [(ends[i + window] - ends[i]) / window for i in range(start, len(ends) - window, window)]
    return 1000 * statistics.median(spans) if spans else float("nan")


def _per_step_ms(
    run: Callable[[int], dict[str, Any]], steps: int, once: bool, window: int
) -> tuple[float, float, dict[str, Any]]:
    """(ms per step, windowed ms per step, the last run's figures): (T(2 x steps) - T(steps)) / steps of the runs'
    `training_seconds`, so that what a run spends once cancels out, and `windowed_ms` of the longer run; with
    `once` (--quick), T(steps) / steps of one run."""
    first = run(steps)
    if once:
        return 1000 * first["training_seconds"] / steps, windowed_ms(first["step_ends"], window), first
    second = run(2 * steps)
    difference = 1000 * (second["training_seconds"] - first["training_seconds"]) / steps
    return difference, windowed_ms(second["step_ends"], window), second


def _together(calls: dict[str, Callable[[], Any]], at_once: bool) -> dict[str, Any]:
    """Each call's result by name: one after another, or with `at_once` (--quick: a smoke test, not a measurement,
    and each run spends seconds of CPU on its imports) all at once, in threads."""
    if not at_once:
        return {name: call() for name, call in calls.items()}
    with ThreadPoolExecutor(len(calls)) as pool:
        running = {name: pool.submit(call) for name, call in calls.items()}
    return {name: future.result() for name, future in running.items()}


# ---------------------------------------------------------------------------------------------------------------
# Overhead: plain, --fault-tolerant and torchft, nothing failing


def overhead(args: argparse.Namespace, work: Path, torchft_skipped: str | None) -> list[dict[str, Any]]:
    """Per workload, mode and round: ms per step of plain ddpkit, fault-tolerant ddpkit and torchft (unless
    `torchft_skipped` says why not)."""
    runs = [(w, m, r) for w, m in _cases(args) for r in range(args.rounds)]
    return [
        {"workload": w, "mode": m, "round": r, **_overhead_round(args, work, w, m, r, torchft_skipped)}
        for w, m, r in progress(runs, desc="overhead")
    ]


def _overhead_round(
    args: argparse.Namespace, work: Path, workload: str, mode: str, r: int, torchft_skipped: str | None
) -> dict[str, Any]:
    fields, steps, name = _fields(workload, mode, args), _overhead_steps(args, workload, mode), f"{workload}-{mode}-{r}"
    # --quick: one rank of one thread per run, the runs at once (each rank spends ~6 s of CPU starting: torch, the
    # data, the first backward); else 2 ranks sharing the cores as ddpkit shares them
    ranks, threads = (1, 1) if args.quick else (2, None)
    flags = [*_flags(fields), "--nproc-per-node", str(ranks)]
    runs = {
        kind: partial(_ddpkit_run, [*flags, extra], work / f"{name}-{kind}", threads)
        for kind, extra in (("plain", "--no-checkpoints"), ("fault_tolerant", "--fault-tolerant"))
    }
    if not torchft_skipped:
        runs["torchft"] = partial(_torchft_job, args, work, f"torchft-{name}", mode, fields, None)
    window = WINDOW if mode == "ddp" else args.outer_every
    timed = _together(
        {kind: partial(_per_step_ms, run, steps, args.quick, window) for kind, run in runs.items()}, args.quick
    )
    (plain_ms, plain_window, plain), (ft_ms, ft_window, ft) = timed["plain"], timed["fault_tolerant"]
    torchft = timed.get("torchft", (None, None, None))
    return {
        "steps": steps,
        "ranks": ranks,
        "once": args.quick,
        "window": window,
        "plain_ms": plain_ms,
        "fault_tolerant_ms": ft_ms,
        "ratio": ft_ms / plain_ms,
        "torchft_ms": torchft[0],
        "plain_window_ms": plain_window,
        "fault_tolerant_window_ms": ft_window,
        "torchft_window_ms": torchft[1],
        "plain_bytes": plain["sent_bytes_per_step"],
        "fault_tolerant_bytes": ft["sent_bytes_per_step"],
    }


# ---------------------------------------------------------------------------------------------------------------
# A lost rank: ddpkit


def _latest_round(store: Any) -> int:
    return int(store.get("ddpkit/ft/latest")) if store.check(["ddpkit/ft/latest"]) else -1


def _wait_for(
    done: Callable[[], bool], proc: subprocess.Popen, error: Callable[[], Exception], limit: float = 600
) -> None:
    """Polls `done` until it holds; raises error() if `proc` ends first or `limit` s pass."""
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise error()
        time.sleep(0.05)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL to each process group still running (a run that failed leaves none behind)."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _two_nodes(flags: list[str], work: Path, name: str, kill_after: int | None, restart: bool) -> dict[str, Any]:
    """A 2-rank fault-tolerant job, one launcher per rank; with `kill_after`, the second is killed after that many
    rounds (and with `restart`, started again at once). The survivor's summary (it writes the outputs)."""
    port = free_port()
    where = [
        "--fault-tolerant",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    # one thread per rank: two launchers on this machine would each take every core (two machines have their own)
    procs = [_train([*flags, *where, "--node-rank", str(n)], work / f"{name}-{n}", 1) for n in range(2)]
    try:
        if kill_after is not None:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
            _wait_for(
                lambda: _latest_round(store) >= kill_after,
                procs[0],
                lambda: RuntimeError(f"{name}: no round {kill_after}"),
            )
            _kill_all(procs[1:])
            if restart:
                procs[1] = _train([*flags, *where, "--node-rank", "1"], work / f"{name}-1-again", 1)
        _finish(procs[0], work / f"{name}-0")
        if kill_after is None:
            _finish(procs[1], work / f"{name}-1")
        elif restart:  # its rejoining is read from the survivor's record
            _linger(procs[1], 300)
    finally:
        _kill_all(procs)
    return _summary(work / f"{name}-0")


def _lost_rank_row(calm: dict[str, Any] | None, hit: dict[str, Any]) -> dict[str, Any]:
    events = hit["membership"]
    return {
        "calm_training_s": calm["training_seconds"] if calm else None,
        "killed_training_s": hit["training_seconds"],
        "extra_s": hit["training_seconds"] - calm["training_seconds"] if calm else None,
        "waited_s": sum(e["waited_seconds"] for e in events),
        "held_up_s": sum(e["blocked_seconds"] for e in events),
        "left": [e["round"] for e in events if e["left"]],
        "joined": [e["round"] for e in events if e["joined"]],
        "dropped_rounds": sum(1 for e in events if e["committed"] is False),
        "replicas_equal": hit["replicas_equal"],
        "calm_test_loss": calm["test_loss"] if calm else None,
        "killed_test_loss": hit["test_loss"],
        "bytes_per_step": hit["sent_bytes_per_step"],
    }


def lost_rank(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Per workload and mode: the survivor of a killed and restarted rank against an uninterrupted run (at --quick
    the killed rank alone, not restarted)."""
    rows = []
    for workload, mode in progress(_cases(args), desc="lost rank"):
        steps, kill_after = _kill_plan(args, workload, mode)
        flags = [
            *_flags(_fields(workload, mode, args)),
            "--max-steps",
            str(steps),
            "--quorum-timeout",
            str(args.quorum_timeout),
        ]
        calm = None if args.quick else _two_nodes(flags, work, f"{workload}-{mode}-calm", None, False)
        # --quick: the run is over before a restarted rank could be back
        hit = _two_nodes(flags, work, f"{workload}-{mode}-killed", kill_after, restart=not args.quick)
        rows.append(
            {
                "workload": workload,
                "mode": mode,
                "steps": steps,
                "killed_after_round": kill_after,
                **_lost_rank_row(calm, hit),
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------------------------
# torchft: the same runs under its Manager


def _torchft_missing() -> str | None:
    """Why torchft cannot run here, or None."""
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse (hosted here) would log every quorum to stderr
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return f"torchft does not import ({exc}); pip install torchft==0.2.0 with torch pinned"
    return None


class TorchftFailed(RuntimeError):
    """A torchft replica ended with an error (or before it should have): which one, and its log's last line."""

    def __init__(self, replica: int, log: str) -> None:
        lines = [line for line in log.splitlines() if line.strip()]
        self.replica, self.last_line = replica, lines[-1] if lines else "(no output)"
        super().__init__(f"torchft replica {replica} failed; its log ends:\n{log[-3000:]}")


def _torchft_job(
    args: argparse.Namespace,
    work: Path,
    name: str,
    mode: str,
    fields: dict[str, Any],
    kill_after: int | None,
    steps: int,
) -> dict[str, Any]:
    """Two torchft replicas of `mode`'s counterpart on `fields`' workload for `steps` steps (files NAME-STEPS*);
    with `kill_after`, replica 1 is killed after that many rounds and started again. Replica 0's figures."""
    from torchft._torchft import LighthouseServer

    name = f"{name}-{steps}"
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=5000)
    config, go = work / f"{name}.config.json", work / f"{name}.go"
    config.write_text(json.dumps(fields))

    def start(replica: int, tag: str) -> subprocess.Popen:
        command = [
            sys.executable,
            "-m",
            "benchmarks.ft_torchft_worker",
            TORCHFT[mode],
            str(replica),
            "2",
            str(steps),
            lighthouse.address(),
            str(work / f"{name}-{replica}{tag}.json"),
            str(args.quorum_timeout),
            str(go),
            str(config),
        ]
        with open(work / f"{name}-{replica}{tag}.log", "w") as log:
            return subprocess.Popen(command, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def failed(replica: int, tag: str = "") -> Callable[[], TorchftFailed]:
        return lambda: TorchftFailed(replica, (work / f"{name}-{replica}{tag}.log").read_text())

    procs, tags = [], ["", ""]
    try:
        procs = [start(0, ""), start(1, "")]
        for r in range(2):
            _wait_for((work / f"{name}-{r}.json.ready").exists, procs[r], failed(r))
        go.touch()
        if kill_after is not None:
            marker = work / f"{name}-0.json.step"
            _wait_for(lambda: marker.exists() and int(marker.read_text() or -1) >= kill_after, procs[0], failed(0))
            _kill_all(procs[1:])
            tags[1] = "-again"
            procs[1] = start(1, tags[1])
        for r, proc in enumerate(procs):
            if proc.wait(900) != 0:
                raise failed(r, tags[r])()
    finally:
        _kill_all(procs)
        lighthouse.shutdown()
    return json.loads((work / f"{name}-0.json").read_text())


def _torchft_lost_rank_row(calm: dict[str, Any], hit: dict[str, Any]) -> dict[str, Any]:
    return {
        "calm_training_s": calm["training_seconds"],
        "killed_training_s": hit["training_seconds"],
        "extra_s": hit["training_seconds"] - calm["training_seconds"],
        "one_participant_rounds": sum(1 for n in hit["participants"] if n < 2),
        "calm_test_loss": calm["test_loss"],
        "killed_test_loss": hit["test_loss"],
    }


def torchft_lost_rank(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Per workload and mode: torchft's survivor against its uninterrupted run, or how the survivor failed."""
    rows = []
    for workload, mode in progress(_cases(args), desc="torchft lost rank"):
        steps, kill_after = _kill_plan(args, workload, mode)
        fields, name = _fields(workload, mode, args), f"torchft-{workload}-{mode}"
        row = {"workload": workload, "mode": mode, "torchft": TORCHFT[mode], "killed_after_round": kill_after}
        calm = _torchft_job(args, work, f"{name}-calm", mode, fields, None, steps)
        try:
            hit = _torchft_job(args, work, f"{name}-killed", mode, fields, kill_after, steps)
        except TorchftFailed as exc:  # torchft's survivor itself may fail when its peer is killed: that is a result
            who = "its survivor" if exc.replica == 0 else "the restarted replica"
            rows.append({**row, "failed": f"{who} failed: {exc.last_line}"})
            continue
        rows.append({**row, **_torchft_lost_rank_row(calm, hit)})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    _cases(args)  # the options are checked before anything starts
    chosen = _names(args.sections, SECTIONS, "--sections")
    skipped = _torchft_missing() or ("--quick" if args.quick else None)
    with tempfile.TemporaryDirectory(prefix="ddpkit-ft-bench-") as tmp:
        work = Path(tmp)
        sections = {"overhead": partial(overhead, args, work, skipped), "lost_rank": partial(lost_rank, args, work)}
        figures = _together({name: sections[name] for name in chosen}, args.quick)
        figures.setdefault("overhead", [])
        figures.setdefault("lost_rank", [])
        lost = [] if skipped or "lost_rank" not in chosen else torchft_lost_rank(args, work)
        figures["torchft"] = {"skipped": skipped, "lost_rank": lost}
    return figures


# ---------------------------------------------------------------------------------------------------------------
# The tables


def table(report: dict[str, Any]) -> str:
    figures = report["figures"]
    torchft = figures["torchft"]
    parts = [_overhead_table(figures["overhead"]), _lost_rank_table(figures["lost_rank"])]
    if torchft.get("skipped"):
        parts.append(f"torchft: skipped: {torchft['skipped']}")
    elif "lost_rank" not in torchft:
        parts.append("torchft: a result file from before the lost-rank rows per mode (rerun for them)")
    else:
        parts.append(_torchft_lost_rank_table(torchft["lost_rank"]))
    return "\n\n".join(parts)


def _key(row: dict[str, Any]) -> tuple[str, str]:
    return row.get("workload", "digits"), row["mode"]  # (results from before the gpt workload: digits)


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """`rows` by (workload, mode), in their order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_key(row), []).append(row)
    return groups


def _overhead_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for (workload, mode), mine in _groups(rows).items():
        for label, kind in (
            ("ddpkit plain", "plain"),
            ("ddpkit --fault-tolerant", "fault_tolerant"),
            (f"torchft {TORCHFT[mode]}", "torchft"),
        ):
            cells = []
            for key, plain in ((f"{kind}_ms", "plain_ms"), (f"{kind}_window_ms", "plain_window_ms")):
                timed = [r for r in mine if r.get(key) is not None and r.get(plain)]
                ratios = _ratios(mine, key, plain)
                cells += (
                    [
                        num(statistics.median(r[key] for r in timed)),
                        num(statistics.median(ratios), ".3f"),
                        " ".join(num(x, ".3f") for x in ratios),
                    ]
                    if timed
                    else ["", "", ""]
                )
            if any(cells):
                lines.append([workload, mode, label, *cells])
    header = [
        "workload",
        "mode",
        "run",
        "ms/step (T(2N)-T(N))/N",
        "x plain",
        "x plain per round",
        "ms/step windowed",
        "x plain",
        "x plain per round",
    ]
    return f"{_method(rows)}\n\n{markdown(header, lines)}"


def _ratios(rows: list[dict[str, Any]], key: str, plain: str) -> list[float]:
    """Each row's `key` figure against its round's plain figure `plain` (rows without either left out)."""
    return [r[key] / r[plain] for r in rows if r.get(key) is not None and r.get(plain)]


def _method(rows: list[dict[str, Any]]) -> str:
    """How the overhead figures were made, with N of each workload and mode."""
    n = ", ".join(f"{w} {m} {mine[0].get('steps', '?')}" for (w, m), mine in _groups(rows).items())
    ranks = rows[0].get("ranks", 2) if rows else 2
    if rows and rows[0].get("once"):
        return (
            f"ms/step: one run of N steps on {ranks} rank(s), T(N) / N, its set-up included (--quick: a smoke "
            f"test, not a measurement); N: {n}"
        )
    return (
        f"ms/step on {ranks} ranks: (T(2N) - T(N)) / N, T the training loop's wall time, and windowed: the "
        f"median over the 2N run's windows of {WINDOW} steps (ddp) or H steps (local modes) of each window's "
        f"mean, the same loop's clock at each step's end; medians over rounds; N: {n}"
    )


def _lost_rank_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        [
            *_key(r),
            r["killed_after_round"],
            num(r["calm_training_s"], ".1f"),
            num(r["killed_training_s"], ".1f"),
            num(r["extra_s"], ".1f"),
            num(r["waited_s"], ".1f"),
            num(r["held_up_s"], ".1f"),
            r["dropped_rounds"],
            "yes" if r["replicas_equal"] else "NO",
            num(r["calm_test_loss"], ".4f"),
            num(r["killed_test_loss"], ".4f"),
            num(r["bytes_per_step"] / 1e3, ".1f"),
        ]
        for r in rows
    ]
    header = [
        "workload",
        "mode",
        "killed after round",
        "calm s",
        "with a loss s",
        "extra s",
        "waited s",
        "held up s",
        "dropped rounds",
        "replicas equal",
        "calm held-out loss",
        "held-out loss",
        "kB/step",
    ]
    return f"ddpkit --fault-tolerant, a lost rank:\n\n{markdown(header, lines)}"


def _torchft_lost_rank_table(rows: list[dict[str, Any]]) -> str:
    done = [r for r in rows if "failed" not in r]
    lines = [
        [
            r["workload"],
            r["mode"],
            r["torchft"],
            r["killed_after_round"],
            num(r["calm_training_s"], ".1f"),
            num(r["killed_training_s"], ".1f"),
            num(r["extra_s"], ".1f"),
            r["one_participant_rounds"],
            num(r["calm_test_loss"], ".4f"),
            num(r["killed_test_loss"], ".4f"),
        ]
        for r in done
    ]
    header = [
        "workload",
        "mode",
        "torchft 0.2.0",
        "killed after round",
        "calm s",
        "with a loss s",
        "extra s",
        "rounds with one replica",
        "calm held-out loss",
        "held-out loss",
    ]
    failures = [
        f"torchft {r['torchft']} on {r['workload']}, with a lost replica: {r['failed']}" for r in rows if "failed" in r
    ]
    return "\n".join([f"torchft, a lost replica:\n\n{markdown(header, lines)}", *failures])


# ---------------------------------------------------------------------------------------------------------------
# The plot


def plot(report: dict[str, Any], out_dir: Path) -> None:
    plt = plotting.pyplot()
    rows = report["figures"]["overhead"]
    groups = _groups(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups)), 3.5))
    for i, mine in enumerate(groups.values()):
        for offset, key, plain, how, filled in (
            (-0.12, "ms", "plain_ms", "(T(2N)-T(N))/N", False),
            (0.12, "window_ms", "plain_window_ms", "windowed", True),
        ):
            for kind, color, marker, name in (
                ("fault_tolerant", "C0", "o", "ddpkit --fault-tolerant"),
                ("torchft", "C1", "x", "torchft"),
            ):
                ratios = _ratios(mine, f"{kind}_{key}", plain)
                style = (
                    {"color": color}
                    if marker == "x"
                    else {"edgecolors": color, "facecolors": color if filled else "none"}
                )
                ax.scatter(
                    [i + offset] * len(ratios),
                    ratios,
                    marker=marker,
                    label=f"{name}, {how}" if ratios else "_",
                    alpha=1.0 if filled else 0.5,
                    **style,
                )
    handles, names = ax.get_legend_handles_labels()
    once = dict(zip(names, handles, strict=True))  # each label once
    ax.legend(once.values(), once.keys())
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks(range(len(groups)), [f"{w}\n{m}" for w, m in groups])
    ax.set_ylabel("time per step / plain ddpkit's")
    labels = " and ".join(dict.fromkeys(WORKLOADS[w].label for w, _ in groups))
    ranks = rows[0].get("ranks", 2) if rows else 2
    ax.set_title(plotting.title(f"{labels}, fault-tolerant vs plain", ranks, report).replace("; ", "\n", 1), fontsize=8)
    plotting.save(fig, "fault_tolerance", out_dir)
