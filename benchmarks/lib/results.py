"""Results as data: every run writes ``benchmarks/results/NAME.json`` with its figures and where they came from.

The file holds ``benchmark``, ``command`` (the exact command line, to copy), ``date`` (UTC), ``commit`` (with
``dirty`` when the worktree had changes), ``torch``, ``machine`` (cores, memory, GPU name or None, load average at
the start and the end), ``config`` (every option the run used) and ``figures`` (what the benchmark measured).
Plots are drawn from this file, so ``--plot-only`` redraws them without running anything. torch is imported where
it is used: ``python -m benchmarks all`` and the hosts' launchers import this module and need no torch (seconds).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.memory import total_memory_gb

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "benchmarks" / "figures"
SCRATCH = ROOT / "benchmarks" / "scratch"  # git-ignored: --quick runs and runs at other settings
REQUIRED = ("benchmark", "command", "date", "commit", "torch", "machine", "config", "figures")


def gpu_name() -> str | None:
    """The first CUDA device's name, or None without one."""
    import torch

    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # a broken driver is "no GPU" for the record
        return None


def machine(load_start: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """The machine a figure was measured on; the load average shows whether others were using it."""
    return {
        "cores": os.cpu_count(),
        "memory_gb": round(total_memory_gb(), 1),
        "gpu": gpu_name(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_start": list(load_start) if load_start else None,
        "load_average_end": list(os.getloadavg()),
    }


def describe_machine(info: dict[str, Any]) -> str:
    """A short line for plot titles and tables: "2 cores, 8 GB, no GPU"."""
    gpu = info.get("gpu") or "no GPU"
    return f"{info.get('cores')} cores, {info.get('memory_gb'):.0f} GB, {gpu}"


def commit() -> dict[str, Any]:
    """The git commit of the checkout, and whether it had uncommitted changes outside the result and figure
    folders (None outside git)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    outputs = (":!benchmarks/results", ":!benchmarks/figures")  # what runs write is not a change to the code
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs)
    return {"commit": head, "dirty": bool(status) if status is not None else None}


def command_line(argv: list[str] | None = None) -> str:
    """How this run was started, as a command to copy (``python -m benchmarks ...`` when run through it)."""
    args = sys.argv[1:] if argv is None else argv
    return "python -m benchmarks " + shlex.join(args) if args else "python -m benchmarks"


class Recorder:
    """Collects a run's context at its start and writes the result file at its end."""

    def __init__(self, name: str, config: dict[str, Any], out_dir: str | Path | None = None) -> None:
        self.name = name
        self.config = config
        self.out_dir = Path(out_dir) if out_dir else RESULTS
        self.started = time.time()
        self.load_start = os.getloadavg()
        self.commit = commit()  # the code that runs is the code at the start

    @property
    def path(self) -> Path:
        return self.out_dir / f"{self.name}.json"

    def write(self, figures: dict[str, Any], command: str | None = None) -> Path:
        import torch

        report = {
            "benchmark": self.name,
            "command": command or command_line(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.started)),
            "seconds": round(time.time() - self.started, 1),
            **self.commit,
            "torch": torch.__version__,
            "machine": machine(self.load_start),
            "config": self.config,
            "figures": figures,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(report, indent=1, default=_plain) + "\n")
        print(f"wrote {self.path}", flush=True)
        return self.path


def _plain(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def load(name: str, out_dir: str | Path | None = None) -> dict[str, Any]:
    """A benchmark's result file, checked to hold every field a result must have."""
    path = (Path(out_dir) if out_dir else RESULTS) / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no results for {name!r} at {path}: run `python -m benchmarks {name}` first")
    report = json.loads(path.read_text())
    missing = [key for key in REQUIRED if key not in report]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    return report
