"""Tables as the README shows them: Markdown, numbers formatted one way, a dash where a figure is missing."""

from __future__ import annotations

from collections.abc import Sequence


def num(value: float | None, spec: str = ".2f") -> str:
    """`value` formatted with `spec`, or "-" when it is missing."""
    return "-" if value is None else format(value, spec)


def markdown(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table: a header row, the separator, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
