"""`ddpkit train` lines run on the pooled ranks of `ddpkit.testing.run_distributed` instead of as a command.

A `ddpkit train` command costs about ten seconds of CPU before its first step (three interpreters import torch,
DDP imports torch's compiler stack, every rank builds its data). Where the launch is not what a test checks, the
line goes through the command's own parser and checks (`ddpkit.cli`) and each rank's
`ddpkit.train.loop.run.train` runs on a pooled rank, whose group stands in for the launch: the same training, the
same summary printed by rank 0, the same files under ``--out``. Tests of the launch itself (signals, lost
processes, torchrun, machines) keep starting the command.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.testing import run_distributed

TIMEOUT = 240  # seconds per line: generous for a loaded machine, under pytest-timeout's 300


@dataclass
class Result:
    """What a finished command left: its exit status, its output and how long it took."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def __str__(self) -> str:
        head = f"exit {self.returncode} after {self.seconds:.1f} s"
        return f"{head}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def train_config(words: Sequence[str]) -> Any:
    """The TrainConfig `ddpkit train` makes of `words` (``train`` and its flags): its parser, a TOML file named by
    ``--config``, its checks."""
    from ddpkit.cli import build_parser, make_config

    assert words[0] == "train", words
    return make_config(build_parser().parse_args([str(w) for w in words]))


@contextlib.contextmanager
def working_directory(folder: str) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(old)


def train_rank(rank: int, world_size: int, configs: list[Any], folder: str) -> dict[str, Any]:
    """One rank of `ddpkit train` with configs[rank], on the pooled rank (its group stands in for the launch), in
    `folder` (relative paths, and modules such as ``mypkg`` found there as PYTHONPATH gives the command)."""
    from ddpkit.distributed.launch import Placement
    from ddpkit.train.loop.run import train

    placement = Placement(rank, world_size, rank, "127.0.0.1", 0)
    printed, said = io.StringIO(), io.StringIO()
    sys.path.insert(0, folder)
    try:
        with working_directory(folder), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
            summary = train(configs[rank], placement, "gloo")
    finally:
        sys.path.remove(folder)
        for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
            del sys.modules[name]
    return {"summary": summary, "printed": printed.getvalue(), "said": said.getvalue()}


def train_lines(lines: Sequence[Sequence[str]], folder: Path | str) -> list[dict[str, Any]]:
    """Each rank's `ddpkit train` line (``lines[rank]``, starting with ``train``) on as many pooled ranks, in
    `folder`; each rank's summary, what it printed and what it said on stderr."""
    configs = [train_config(words) for words in lines]
    return run_distributed(train_rank, len(lines), configs, str(folder), timeout=TIMEOUT)


def train(words: Sequence[str], folder: Path | str = ".") -> Result:
    """`ddpkit train` with `words` (its flags) on as many pooled ranks as the line's world size: what the command
    would have printed (each rank's output, rank 0's first) as a finished command's `Result`."""
    began = time.monotonic()
    line = ["train", *map(str, words)]
    results = train_lines([line] * train_config(line).world_size, folder)
    out, err = ("".join(r[key] for r in results) for key in ("printed", "said"))
    return Result(0, out, err, time.monotonic() - began)
