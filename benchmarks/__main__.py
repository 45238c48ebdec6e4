"""``python -m benchmarks``: lists the benchmarks; ``python -m benchmarks NAME [options]`` runs one;
``python -m benchmarks all --quick`` runs every one at smoke size, each in its own process, with a progress bar.

Every ``benchmarks/bench_<name>.py`` that defines ``QUESTION`` is a benchmark called ``<name>``: adding a file is
all it takes to register one (see `benchmarks.lib.cli` for what the module defines). A run imports its own module
only, and ``all`` none (importing one costs seconds: torch), so there every ``bench_*.py`` counts as a benchmark.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

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


def run_all(names: list[str], options: list[str]) -> int:
    """Runs each benchmark as ``python -m benchmarks NAME <options>`` in a fresh process; reports failures."""
    failed = []
    for name in progress(names, desc="benchmarks"):
        began = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "benchmarks", name, *options], cwd=HERE.parent)
        status = "ok" if done.returncode == 0 else f"FAILED (exit status {done.returncode})"
        print(f"== {name}: {status} in {time.monotonic() - began:.0f} s", flush=True)
        if done.returncode:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


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
