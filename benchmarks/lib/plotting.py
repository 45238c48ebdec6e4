"""One plot style for every benchmark, and titles that name the workload, the world size and the machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.lib.results import FIGURES, describe_machine


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, with the benchmarks' style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "figure.dpi": 100,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "legend.fontsize": 8,
            "axes.titlesize": 10,
            "figure.titlesize": 11,
        }
    )
    return plt


def title(workload: str, world_size: int | str, report: dict[str, Any]) -> str:
    """ "<workload>, <world size> ranks, <machine> (torch <version>, <date>)"."""
    machine = describe_machine(report["machine"])
    return f"{workload}, {world_size} ranks; {machine}; torch {report['torch']}, {report['date']}"


def save(fig: Any, name: str, out_dir: str | Path | None = None) -> Path:
    """Writes `fig` as ``<out_dir or benchmarks/figures>/<name>.png`` and closes it."""
    import matplotlib.pyplot as plt

    path = (Path(out_dir) if out_dir else FIGURES) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return path
