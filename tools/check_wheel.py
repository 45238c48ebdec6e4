"""Checks an installed ddpkit the way a user gets it: run it with the Python of a fresh environment into which only
the wheel (and torch) was installed, from a folder outside the repository.

Every module of the package imports, except the integrations whose library is not installed, which must refuse
with an ImportError that names the pip extra to install; the version is the one the wheel's metadata declares;
`py.typed` ships; the console command exists, says its version and runs the README's main job (two steps of it)
without any extra installed. Exit status 0 when all holds, else 1 with what failed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import pkgutil
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

EXTRAS = {"lightning", "lightning_fault_tolerant", "accelerate", "torchbearer"}  # modules of optional libraries


def main() -> int:
    import ddpkit

    problems = []
    where = Path(ddpkit.__file__).parent
    if "site-packages" not in str(where):
        problems.append(f"ddpkit imported from {where}, not from an installed wheel")
    if importlib.metadata.version("ddpkit") != ddpkit.__version__:
        problems.append(f"metadata version {importlib.metadata.version('ddpkit')} != __version__ {ddpkit.__version__}")
    if not (where / "py.typed").is_file():
        problems.append("py.typed is missing")
    if shutil.which("ddpkit") is None:
        problems.append("the ddpkit console command is not installed")
    imported = 0
    for module in pkgutil.walk_packages(ddpkit.__path__, "ddpkit."):
        try:
            importlib.import_module(module.name)
            imported += 1
        except ImportError as exc:
            if module.name.rsplit(".", 1)[-1] in EXTRAS and 'pip install "ddpkit[' in str(exc):
                continue  # the integration's library is not installed: refused with how to install it
            problems.append(f"{module.name}: {type(exc).__name__}: {exc}")
    problems += _main_job(ddpkit.__version__)
    print(f"ddpkit {ddpkit.__version__} from {where}: {imported} modules imported")
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


def _main_job(version: str) -> list[str]:
    """`ddpkit --version`, then the README's main job (`ddpkit train --out runs/digits`) stopped after two steps."""
    command = shutil.which("ddpkit")
    if command is None:
        return []
    said = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=120)
    problems = [] if said.stdout.startswith(f"ddpkit {version} (torch ") else [f"ddpkit --version said {said!r}"]
    with tempfile.TemporaryDirectory() as folder:
        run = subprocess.run(
            [command, "train", "--out", "runs/digits", "--max-steps", "2", "--no-progress"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=folder,
        )
        metrics = Path(folder) / "runs" / "digits" / "metrics.json"
        if run.returncode != 0 or not metrics.is_file():
            return [*problems, f"ddpkit train failed ({run.returncode}): {run.stderr[-2000:]}"]
        steps = json.loads(metrics.read_text())["summary"]["steps"]
        if steps != 2:
            problems.append(f"ddpkit train ran {steps} steps, not 2")
    return problems


if __name__ == "__main__":
    sys.exit(main())
