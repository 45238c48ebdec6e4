"""``python -m benchmarks``: lists the benchmarks; ``python -m benchmarks NAME [options]`` runs one;
``python -m benchmarks all --quick`` runs every one at smoke size, each in its own process, with a progress bar
(two at a time: a smoke run is not a measurement, so two may share the cores; full runs go one at a time).

Every ``benchmarks/bench_<name>.py`` that defines ``QUESTION`` is a benchmark called ``<name>``: adding a file is
all it takes to register one (see `benchmarks.lib.cli` for what the module defines). A run imports its own module
only, and ``all`` none (importing one costs seconds: torch), so there every ``bench_*.py`` counts as a benchmark.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.lib.cli import main as run_one
from benchmarks.lib.cli import progress

HERE = Path(__file__).resolve().parent


def names() -> list[str]:
    """The name of every ``bench_<name>.py``, in file-name order."""
    return [path.stem.removeprefix("bench_") for path in sorted(HERE.glob("bench_*.py"))]


def load(name: str) -> ModuleType | None:
    """Benchmark `name`'s module, or None where there is none (no such file, or no ``QUESTION`` in it)."""
    if not (HERE / f"bench_{name}.py").is_file():
        return None
    module = importlib.import_module(f"benchmarks.bench_{name}")
    return module if hasattr(module, "QUESTION") else None


def registry() -> dict[str, ModuleType]:
    """Every benchmark module by name, in file-name order."""
    return {name: module for name in names() if (module := load(name)) is not None}


def listing(benchmarks: dict[str, ModuleType]) -> str:
    width = max(map(len, benchmarks), default=0)
    lines = ["usage: python -m benchmarks NAME [options]   (NAME --help: its options and defaults)", ""]
    lines += [f"  {name:<{width}}  {module.QUESTION}" for name, module in benchmarks.items()]
    lines += ["", f"  {'all':<{width}}  every benchmark in turn (with --quick: smoke size, minutes)"]
    return "\n".join(lines)


QUICK_AT_ONCE = 2
"""How many benchmarks ``all --quick`` runs at once (each starts processes and waits on them: one alone left a
core idle much of the time)."""


def run_all(names: list[str], options: list[str]) -> int:
    """Runs each benchmark as ``python -m benchmarks NAME <options>`` in a fresh process, `QUICK_AT_ONCE` at a time
    with ``--quick`` (each one's output printed whole when it ends), else one after another; reports failures."""
    at_once = QUICK_AT_ONCE if "--quick" in options else 1
    failed = []
    waiting = list(names)
    running: dict[str, tuple[subprocess.Popen, float, Any]] = {}
    bar = progress(range(len(names)), desc="benchmarks")
    next(bar, None)  # shows the bar at 0
    while waiting or running:
        while waiting and len(running) < at_once:
            name = waiting.pop(0)
            log = tempfile.TemporaryFile("w+") if at_once > 1 else None
            command = [sys.executable, "-m", "benchmarks", name, *options]
            proc = subprocess.Popen(command, cwd=HERE.parent, stdout=log, stderr=subprocess.STDOUT if log else None)
            running[name] = (proc, time.monotonic(), log)
        name = _first_finished(running)
        proc, began, log = running.pop(name)
        if log is not None:
            log.seek(0)
            sys.stdout.write(log.read())
            log.close()
        status = "ok" if proc.returncode == 0 else f"FAILED (exit status {proc.returncode})"
        print(f"== {name}: {status} in {time.monotonic() - began:.0f} s", flush=True)
        if proc.returncode:
            failed.append(name)
        next(bar, None)
    bar.close()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _first_finished(running: dict[str, tuple[subprocess.Popen, float, Any]]) -> str:
    """Waits until one of the `running` benchmarks has ended; returns its name."""
    while True:
        for name, (proc, _, _) in running.items():
            if proc.poll() is not None:
                return name
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing(registry()))
        return 0
    name, options = argv[0], argv[1:]
    if name == "all":
        return run_all(names(), options)
    module = load(name)
    if module is None:
        print(f"unknown benchmark {name!r}\n\n{listing(registry())}", file=sys.stderr)
        return 2
    return run_one(name, module, options)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
