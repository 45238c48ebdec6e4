"""mkdocs hooks: the site's Benchmarks page is benchmarks/README.md itself (the current record), its figures and
the CHANGELOG beside it, taken from where they live in the repository rather than copied into docs/; the CLI
reference page is generated from the command's own parser, so it is always the `--help` users see."""

from __future__ import annotations

import os
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
    files.append(File.generated(config, "cli.md", content=cli_reference()))
    return files


def cli_reference() -> str:
    """The CLI reference page: each command's ``--help``, from `ddpkit.cli.build_parser`, 100 columns wide."""
    import argparse

    from ddpkit.cli import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # (argparse reads the width from here)
    try:
        parser = build_parser()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        parts = [
            "# CLI reference\n",
            "Generated from the command's own parser when the site is built: exactly what `--help` prints.\n",
            f"## ddpkit\n\n```text\n{parser.format_help()}```\n",
        ]
        parts += [f"## ddpkit {name}\n\n```text\n{cmd.format_help()}```\n" for name, cmd in commands.items()]
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(parts)
