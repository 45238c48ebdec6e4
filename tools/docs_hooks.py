"""mkdocs hooks: the site's Benchmarks page is benchmarks/README.md itself (the current record), its figures and
the CHANGELOG beside it, taken from where they live in the repository rather than copied into docs/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
TAKEN = {"benchmarks.md": ROOT / "benchmarks" / "README.md", "changelog.md": ROOT / "CHANGELOG.md"}


def on_files(files: Files, config: Any) -> Files:
    for uri, source in TAKEN.items():
        files.append(File.generated(config, uri, abs_src_path=str(source)))
    for figure in sorted((ROOT / "benchmarks" / "figures").glob("*.png")):
        files.append(File.generated(config, f"figures/{figure.name}", abs_src_path=str(figure)))
    return files
