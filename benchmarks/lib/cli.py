"""The command line every benchmark shares: its own options with their defaults, ``--quick``, ``--out``,
``--plot-only``; a run writes the result file, prints the table and draws the plot from the file.

A run at the benchmark's defaults writes the record (``benchmarks/results``, ``benchmarks/figures``); a
``--quick`` run, or one with other options, writes to the git-ignored ``benchmarks/scratch`` unless ``--record``
(or ``--out``) says otherwise.

A benchmark module defines ``QUESTION`` (one line: what it answers), ``QUICK`` (option values for the smoke size),
``add_arguments(parser)``, ``run(args) -> figures``, ``table(report) -> str`` and ``plot(report, out_dir)``;
optionally ``result_name(args)`` where variants of one benchmark keep separate result files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from benchmarks.lib import results

T = TypeVar("T")


class UsageError(ValueError):
    """Raised by a benchmark's ``run``, before it starts anything, for options that do not fit together: the
    command prints the usage and the message and exits with status 2."""


class Skip(Exception):
    """Raised by a benchmark's ``run`` when it cannot run here (e.g. no root for network namespaces): the reason
    is printed and the command exits with status 0 after writing nothing."""


def progress(items: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """A tqdm progress bar on stderr (leaves stdout to the tables)."""
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none (None) or it is a flag's False."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser(name: str, module: ModuleType, quick: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks {name}",
        description=module.QUESTION,
        formatter_class=_Help,
    )
    module.add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="smoke size: " + _quick_text(module.QUICK))
    parser.add_argument(
        "--out",
        default=None,
        help="write NAME.json and the plots here (default: benchmarks/results, benchmarks/figures)",
    )
    parser.add_argument("--plot-only", action="store_true", help="redraw the table and plots from the result file")
    parser.add_argument(
        "--record",
        action="store_true",
        help="write to the record (benchmarks/results, benchmarks/figures) although options differ from the "
        "defaults; a run at the defaults does so by itself, a --quick run never",
    )
    if quick:
        parser.set_defaults(**module.QUICK)
    return parser


def _quick_text(values: dict[str, Any]) -> str:
    flags = {f"--{k.replace('_', '-')}": v for k, v in values.items()}
    return ", ".join(flag if value is True else f"{flag} {value}" for flag, value in flags.items())


NOT_SETTINGS = ("out", "plot_only", "record")
"""Options that say where a run writes, not what it measures."""


def changed_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The options of `args` that differ from the benchmark's own defaults (a --quick run: just ``--quick``)."""
    if args.quick:
        return ["--quick"]
    defaults = vars(parser.parse_args([]))
    return [
        f"--{key.replace('_', '-')}"
        for key, value in vars(args).items()
        if key not in NOT_SETTINGS and value != defaults.get(key)
    ]


def destination(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Path, Path, list[str]]:
    """Where a run writes its result file and its figures, and why not the record (the options that differ from
    the defaults; empty for the record). ``--out`` wins; then the record, for a run at the defaults or with
    ``--record``; else the git-ignored ``benchmarks/scratch``, so that a smoke-size or exploratory run never
    replaces the published figures by accident."""
    if args.record and args.quick:
        raise UsageError("--record: a --quick run is a smoke test, never the record")
    if args.out:
        return Path(args.out), Path(args.out), []
    changed = changed_options(args, parser)
    if args.record or not changed:
        return results.RESULTS, results.FIGURES, []
    return results.SCRATCH, results.SCRATCH, changed


def main(name: str, module: ModuleType, argv: list[str]) -> int:
    """Runs benchmark `name` (``python -m benchmarks NAME ...``); returns the exit status."""
    parser = build_parser(name, module, quick="--quick" in argv)
    args = parser.parse_args(argv)
    try:
        results_dir, figures_dir, changed = destination(args, build_parser(name, module, quick=False))
    except UsageError as exc:
        parser.error(str(exc))
    result = module.result_name(args) if hasattr(module, "result_name") else name  # variants keep their own file
    if args.plot_only:
        report = results.load(result, results_dir)
    else:
        recorder = results.Recorder(result, _config(args), results_dir)
        try:
            figures = module.run(args)
        except UsageError as exc:
            parser.error(str(exc))
        except Skip as reason:
            print(f"{name}: skipped: {reason}", flush=True)
            return 0
        recorder.config = _config(args)  # as the run completed it (e.g. defaults that depend on other options)
        recorder.write(figures, command=results.command_line([name, *argv]))
        report = results.load(result, results_dir)
    print(module.table(report), flush=True)
    module.plot(report, figures_dir)
    if changed and not args.plot_only:
        print(
            f"not the record ({', '.join(changed)}: not the defaults): wrote {results_dir}; "
            "benchmarks/results is unchanged (--record replaces it)",
            flush=True,
        )
    return 0


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}
