"""Every code block of README.md (and every command of benchmarks/README.md) is run or checked here, so a snippet
or a command that stops working fails the suite.

How each kind of block is exercised:

* **Python snippets** run as the README's own text (read from the file at test time, never a copy) on 2 gloo
  ranks of `ddpkit.testing.run_distributed`, with a namespace holding only what a reader supplies (``MyModel``, a
  ``loader``, ``loss_fn``, a batch ``x, y``, and the ``model``/``optimizer`` an earlier snippet made), and
  ``torch.distributed.init_process_group`` made a no-op (the ranks' group already exists). Each test then checks
  what the snippet promises (parameters moved, replicas equal, the checkpoint loads, the bytes counted).
* **Shell commands** run as written, after the mechanical substitutions of `SUBSTITUTIONS` and the flags of
  `APPENDED` (short runs, free ports, this machine instead of 10.0.0.1, files in tmp_path). Commands whose point
  is the launch (the quick start, torchrun, two machines, the GPU refusals, `ddpkit bench`) run as separate
  processes; the other `ddpkit train` lines go through the command's own parser and checks (`ddpkit.cli`) and then
  run each rank's `ddpkit.train.loop.run.train` on the 2 pooled ranks, which saves spawning 2 fresh processes per line.
* **The TOML block** is written to run.toml and run by the README's ``--config run.toml`` line.
* **The layout block** names files: each must exist.
* **benchmarks/README.md**: its quick commands are run (``--help`` of every benchmark) or claimed by
  tests/test_benchmarks.py (``all --quick``, the listing, ``--plot-only``); every full-size command is parsed by
  its benchmark's own argument parser, so a renamed or removed option fails here without a run of minutes.

`test_every_block_is_exercised` ties the two together: every command must be a key of `COMMANDS` or
`BENCH_COMMANDS` (exact text, comments dropped), every Python block must hold exactly one anchor of `SNIPPETS`, and
every key and anchor must still be in the README. A new command or snippet without a test, or an edited command,
fails it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import importlib
import io
import itertools
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pooled_train
import pytest
import test_fault_tolerant_etcd as _etcd_docs  # (its commands of docs/fault-tolerance.md)
import torch
import warm_processes
from pooled_train import working_directory
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit.distributed.launch import TORCHRUN_VARIABLES
from ddpkit.testing import run_distributed
from ddpkit.train.loop.bench import BENCH_STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCH_README = ROOT / "benchmarks" / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]  # the README and the documentation site's pages
WORLD = 2
TIMEOUT = 240  # seconds per command: generous for a loaded machine, under pytest-timeout's 300

# ---------------------------------------------------------------------------------------------------------------
# The README's blocks and commands


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: its language tag (may be empty), its text, the line its fence opens on, its file."""

    lang: str
    text: str
    line: int
    path: Path = README


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    text = path.read_text()
    found = re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1, path) for m in found]


def doc_blocks() -> list[Block]:
    """Every fenced block of the README and of the documentation's pages."""
    return [b for path in DOCS for b in blocks(path)]


def where(block: Block) -> str:
    return f"{block.path.relative_to(ROOT)} line {block.line}"


def shell_commands(block: Block) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines dropped, spaces
    collapsed (so a comment may change freely, the command may not)."""
    joined = re.sub(r"\\\n", " ", block.text)
    commands = []
    for line in joined.splitlines():
        command = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]
        if command.strip():
            commands.append(" ".join(command.split()))
    return commands


def readme_commands(path: Path | None = None) -> list[str]:
    """The commands of one Markdown file's shell blocks, or (None) of the README's and the documentation's."""
    found = blocks(path) if path is not None else doc_blocks()
    return [c for b in found if b.lang == "bash" for c in shell_commands(b)]


def command(text: str, path: Path | None = None) -> str:
    """`text` if it is one of the documented commands (a test of a command that was removed or edited fails)."""
    assert text in readme_commands(path), f"{path.name if path else 'the docs'} no longer have the command {text!r}"
    return text


class Snippet(str):
    """A Python block's text, knowing the file it comes from (for tracebacks)."""

    path: Path


def snippet(anchor: str) -> Snippet:
    """The text of the one Python block of the README or the docs that contains `anchor`, after as many blank lines
    as come before it in its file (so a traceback names the file's own line numbers)."""
    found = [b for b in doc_blocks() if b.lang == "python" and anchor in b.text]
    assert len(found) == 1, f"{len(found)} Python blocks of the README and docs contain {anchor!r}"
    text = Snippet("\n" * found[0].line + found[0].text)
    text.path = found[0].path
    return text


# ---------------------------------------------------------------------------------------------------------------
# What the tests change in a command before running it: nothing else is changed.

# (README text, what runs instead, why). {port} is a free port, {tmp} the test's folder, {mnist} a generated
# folder of the four MNIST IDX files.
SUBSTITUTIONS: tuple[tuple[str, str, str], ...] = (
    ("--host 10.0.0.1", "--host 127.0.0.1 --master-port {port}", "the other machine is this one (both started)"),
    ("--hosts 10.0.0.1,10.0.0.2", "--hosts 127.0.0.1,127.0.0.1 --master-port {port}", "both hosts are this one"),
    (
        "--nproc-per-node 4 --master-addr 10.0.0.1",
        "--nproc-per-node 1 --master-addr 127.0.0.1 --master-port {port}",
        "2 machines of 1 process (2 processes in all), both here",
    ),
    ("torchrun --nproc-per-node 4", "torchrun --nproc-per-node 2 --master-port {port}", "2 processes, a free port"),
    ("--nproc-per-node 8 --max-restarts", "--nproc-per-node 2 --max-restarts", "2 processes"),
    (
        "--rdzv-endpoint 10.0.0.1:29400",
        "--rdzv-endpoint 127.0.0.1:{port} --rdzv-conf last_call_timeout=1",
        "one host: this one; no 30 s wait for machines that will not come",
    ),
    ("$MY_ADDRESS", "127.0.0.1", "this machine's address"),
    (
        "torchrun --nproc-per-node 2 train_sharded.py --epochs 5",
        "torchrun --nproc-per-node 2 --master-port {port} train_sharded.py --epochs 1",
        "the torchrun tutorial: one epoch, a free port",
    ),
    (
        "torchrun --nproc-per-node 2 train_sharded.py --epochs 8",
        "torchrun --nproc-per-node 2 --master-port {port} train_sharded.py --epochs 2",
        "the tutorial's resumed run: one more epoch, a free port",
    ),
    (
        "python train_lightning.py --epochs 3",
        "python train_lightning.py --epochs 1",
        "the Lightning tutorial: one epoch",
    ),
    (
        "python train_lightning.py --epochs 5",
        "python train_lightning.py --epochs 2",
        "the Lightning tutorial's resumed run: one more epoch",
    ),
    ("ddpkit store --port 29510", "ddpkit store --port {port}", "the fault-tolerant loop tutorial: a free port"),
    ("train_ft.py --rank", "train_ft.py --store localhost:{port} --rank", "its replicas: the store's free port"),
    (
        "torchrun --nproc-per-node 2 train_diloco.py --epochs 20",
        "torchrun --nproc-per-node 2 --master-port {port} train_diloco.py --epochs 5",
        "the DiLoCo tutorial: 5 epochs (4 syncs), a free port",
    ),
    ("/shared/run1", "{tmp}/shared/run1", "the shared folder is a temporary one"),
    ("~/mnist", "{mnist}", "a generated MNIST-shaped folder (the files are not downloaded)"),
    ("50_000", "3", "AdaScale snippet: 3 scale-invariant steps, not 50,000"),
    ("nprocs_per_node=8", "nprocs_per_node=1", "SlowMo snippets: 2 nodes of 1 process (the test has 2 ranks)"),
    ("rank // 8, world_size // 8", "rank // 1, world_size // 1", "SGP snippet: the same, 1 process per node"),
    ("(node, nodes, 8, rank % 8,", "(node, nodes, 1, rank % 1,", "SGP snippet: the same, 1 process per node"),
)

# Flags appended to a command (argparse keeps the last value of a repeated flag).
APPENDED: dict[str, list[str]] = {
    "train": ["--max-steps", "2", "--no-progress"],  # 2 optimizer steps; no progress bar
    "bench": ["--max-steps", "3"],  # 3 timed steps per strategy
    "bench-more": ["--strategies", "ddp,slowmo"],  # every bench line after the first: 2 strategies, not 5
    "small-gpt": ["--gpt-layers", "1", "--gpt-width", "32", "--gpt-heads", "2", "--context", "32"],  # default GPT
}


def substituted(text: str, **values: str) -> str:
    """`text` with every applicable entry of `SUBSTITUTIONS` applied."""
    for old, new, _why in SUBSTITUTIONS:
        if old in text:
            text = text.replace(old, new.format(**values) if "{" in new else new)
    return text


def argv(text: str, *appended: str, **values: str) -> list[str]:
    """The argument list of a README command after `SUBSTITUTIONS`, with the `APPENDED` flags of each key."""
    words = shlex.split(substituted(text, **values))
    extra = [flag for key in appended for flag in APPENDED[key]]
    if "--model gpt" in text and "--gpt-layers" not in text:
        extra += APPENDED["small-gpt"]
    return words + extra


# ---------------------------------------------------------------------------------------------------------------
# Coverage: which test exercises which block. "CI:", "tests/..." and "not run:" entries say what covers a line
# outside this file, and why.

COMMANDS: dict[str, str] = {
    "pip install torch==2.13.0 -e . && ddpkit train --out runs/digits": "test_quick_start_trains",
    'pip install torch==2.13.0 -e ".[dev]" && python -m pytest': "CI: .ci/run installs and runs exactly this",
    "torchrun --nproc-per-node 2 train_sharded.py --epochs 5 --out runs/tutorial": "test_the_torchrun_tutorial",
    "torchrun --nproc-per-node 2 train_sharded.py --epochs 8 --out runs/tutorial --resume": (
        "test_the_torchrun_tutorial"
    ),
    "python train_lightning.py --epochs 3": "tests/test_tutorials.py::test_the_lightning_tutorial",
    "python train_lightning.py --epochs 5 --resume": "tests/test_tutorials.py::test_the_lightning_tutorial",
    "ddpkit store --port 29510 &": "tests/test_tutorials.py::test_the_fault_tolerant_loop_tutorial",
    "python train_ft.py --rank 0 --world-size 2 &": "tests/test_tutorials.py::test_the_fault_tolerant_loop_tutorial",
    "python train_ft.py --rank 1 --world-size 2 --crash-at 300": (
        "tests/test_tutorials.py::test_the_fault_tolerant_loop_tutorial"
    ),
    "python train_ft.py --rank 1 --world-size 2": "tests/test_tutorials.py::test_the_fault_tolerant_loop_tutorial",
    "torchrun --nproc-per-node 2 train_diloco.py --epochs 20": "tests/test_tutorials.py::test_the_diloco_tutorial",
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 train_diloco.py --procs-per-site 4": (
        "not run: two sites; the same script at one process per site runs in "
        "tests/test_tutorials.py::test_the_diloco_tutorial"
    ),
    "srun ddpkit train --strategy sharded --out runs/slurm": (
        "tests/test_slurm.py::test_two_srun_tasks_train_as_one_job (the variables srun sets, on loopback)"
    ),
    "ddpkit train --strategy ddp|oss|sharded|slowmo --optimizer sgd|adam|adamw --epochs 5 --batch-size 32": (
        "test_train_line"
    ),
    "ddpkit train --strategy ddp --optimizer sgd --adascale --grad-accum 4": "test_train_line",
    "ddpkit train --amp bf16": "test_train_line",
    "ddpkit train --data mnist --data-dir ~/mnist --model cnn": "test_train_line",
    "ddpkit train --data synthetic --synthetic-samples 100000 --synthetic-features 1024": "test_train_line",
    "ddpkit train --config run.toml --lr 0.01": "test_train_line",
    "torchrun --nproc-per-node 4 -m ddpkit train": "test_torchrun_lines",
    "ddpkit train --world-size 2 --rank 0 --host 10.0.0.1": "test_train_line",
    "ddpkit train --world-size 2 --rank 1 --host 10.0.0.1": "test_train_line",
    "ddpkit train --nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr 10.0.0.1": "test_train_line",
    "ddpkit bench --nproc-per-node 2 --json bench.json": "test_bench_compares_every_strategy",
    "ddpkit train --model mypkg.work:model --data mypkg.work:data --max-steps 500": "test_train_line",
    "ddpkit bench --model mypkg.work:model --data mypkg.work:data --link-mbit 1000": "test_bench_line",
    "ddpkit train --model gpt --data text --max-steps 2000": "test_train_line",
    "ddpkit train --model gpt --data text --gpt-layers 2 --gpt-width 64 --gpt-heads 2 --context 64 --lr 3e-3": (
        "test_train_line"
    ),
    "ddpkit bench --model gpt --nproc-per-node 2": "test_bench_line",
    "ddpkit bench --model mypkg.work:model --data mypkg.work:data --link-mbit 1000 --link-latency-ms 0.2": (
        "test_bench_line"
    ),
    "ddpkit bench --hosts 10.0.0.1,10.0.0.2 --node-rank 0 --model gpt": "test_bench_on_two_hosts",
    "ddpkit train --strategy slowmo --model gpt --data text --optimizer adamw --max-steps 2000 "
    "--localsgd-frequency 50 --slowmo-frequency 50 --slowmo-lr 0.7 --slowmo-momentum 0.9 --slowmo-nesterov "
    "--slowmo-compression int4 --slowmo-error-feedback --slowmo-fragments 4 --slowmo-sync-delay 1 "
    "--world-size 2 --rank 0 --host 10.0.0.1": "test_slow_link_training_on_two_machines",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:4 --nproc-per-node 8 --max-restarts 3 "
    "--rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id myjob --local-addr $MY_ADDRESS "
    "-m ddpkit train --strategy sharded --out /shared/run1 --checkpoint-every 50": "test_torchrun_lines",
    "ddpkit train --backend nccl --nproc-per-node 8": "test_gpu_lines",
    **dict.fromkeys(
        _etcd_docs.ONE_MACHINE_ETCD + _etcd_docs.ONE_MACHINE_TRAIN,
        "tests/test_fault_tolerant_etcd.py::test_the_docs_one_machine_etcd_commands_run_as_written",
    ),
    **dict.fromkeys(
        [
            f"etcd --name m{i} --data-dir /var/lib/etcd-ddpkit --listen-client-urls http://10.0.0.{i + 1}:2379 "
            f"--advertise-client-urls http://10.0.0.{i + 1}:2379 --listen-peer-urls http://10.0.0.{i + 1}:2380 "
            f"--initial-advertise-peer-urls http://10.0.0.{i + 1}:2380 --initial-cluster m0=http://10.0.0.1:2380,"
            "m1=http://10.0.0.2:2380,m2=http://10.0.0.3:2380 --initial-cluster-state new --initial-cluster-token "
            "ddpkit-etcd"
            for i in range(3)
        ]
        + [
            "ddpkit train --fault-tolerant --strategy ddp --nnodes 3 --nproc-per-node 1 --node-rank k --store "
            "etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/run-1 --out run-1"
        ],
        "not run: three machines; the same flags on loopback run in "
        "tests/test_fault_tolerant_etcd.py::test_the_docs_one_machine_etcd_commands_run_as_written",
    ),
    "ddpkit train --backend gloo --device cuda --nproc-per-node 2": "test_gpu_lines",
}

SNIPPETS: dict[str, str] = {  # a line of code found in exactly one Python block -> its test
    "sampler.set_epoch(epoch)  # a new shuffle each epoch": "test_the_torchrun_tutorial (as train_sharded.py)",
    "def data():": "test_train_line (written to mypkg/work.py and trained on)",
    'strategy="ddpkit_sharded",  # was "ddp"': "tests/test_tutorials.py::test_the_lightning_tutorial",
    'parser.add_argument("--crash-at"': ("tests/test_tutorials.py::test_the_fault_tolerant_loop_tutorial"),
    "model.perform_slowmo(optimizer)  # a sync every H steps": "tests/test_tutorials.py::test_the_diloco_tutorial",
    "model = DDP(MyModel())": "test_oss_snippet_and_its_checkpoint",
    "model.register_comm_hook(optimizer, reduce_to_owners_hook)": "test_reduce_to_owners_hook_snippet",
    "optimizer.consolidate_state_dict(recipient_rank=0)": "test_oss_snippet_and_its_checkpoint",
    "model = ShardedDataParallel(model, optimizer)": "test_sharded_data_parallel_snippet",
    "sharded = ShardedDataParallel(model, optimizer)": "test_readme_tour_snippet",
    "model, optimizer = prepare_sharded(accelerator, model, optimizer)": (
        "tests/test_accelerate.py::test_the_sharded_recipe_trains_checkpoints_and_resumes_as_accelerates_ddp "
        "(run as written under accelerate launch by tests/accelerate_runs.py)"
    ),
    "scaler = ShardedGradScaler()": "test_sharded_grad_scaler_snippet",
    "optimizer = AdaScale(": "test_adascale_snippet",
    "model.perform_slowmo(optimizer)                      # between nodes": "test_slowmo_snippets",
    'slowmo_compression="int4", slowmo_error_feedback=True,   # 4-bit': "test_slowmo_snippets",
    "slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP": "test_slowmo_snippets",
    "distributed_callbacks(model)": "test_torchbearer_snippet",
    'L.Trainer(strategy="ddpkit_sharded", accelerator="cpu"': (
        "tests/test_lightning.py::test_the_readme_snippet_trains"
    ),
    "counting_allreduce_hook)": "test_comm_stats_snippet",
    "if manager.should_commit():  # False on every member": (
        "tests/test_manager.py::test_the_readme_loop_with_a_failed_round_a_lost_rank_and_a_late_one_equals_the_reference"
    ),
}

OTHER_BLOCKS: dict[tuple[str, str], str] = {  # (language, first line) -> its test
    ("diff", " import torch"): "test_the_fairscale_diff_swaps_imports_for_the_same_names",
    ("mermaid", "%% an OSS step"): "not run: a concept picture (oss.md), drawn by the browser",
    ("mermaid", "%% a fault-tolerant round"): "not run: a concept picture (fault-tolerance.md), drawn by the browser",
    ("mermaid", "flowchart LR"): "not run: a concept picture (sharded.md), drawn by the browser",
    ("mermaid", "%% hierarchical hosts"): "not run: a concept picture (sharded.md), drawn by the browser",
    ("mermaid", "%% SlowMo's timeline"): "not run: a concept picture (slow-links.md), drawn by the browser",
    ("toml", "# run.toml: ddpkit train --config run.toml"): (
        "test_train_line (the --config run.toml line), test_the_toml_example_trains_to_a_useful_accuracy"
    ),
    ("", "ddpkit/distributed/   the only code that issues collectives (tested): env.py (ranks, groups, checks),"): (
        "test_layout_names_files_that_exist"
    ),
    (
        "text",
        "ddpkit: rank 0 saw rank 0: collective #15, shared_memory of 80 B on world, from ShardedDataParallel._reduce "
        "(ddpkit/nn/sharded_ddp.py:331)",
    ): "tests/test_ledger.py::test_a_parameter_frozen_on_one_rank_only_is_named (these lines, from the ledger)",
}

BENCH_COMMANDS: dict[str, str] = {
    "python -m benchmarks": "tests/test_benchmarks.py::test_listing_names_every_benchmark_with_its_question",
    "python -m benchmarks NAME --help": "test_every_benchmark_help",
    "python -m benchmarks NAME": "not run: full size, minutes each (the same code runs at smoke size in all --quick)",
    "python -m benchmarks NAME --plot-only": (
        "tests/test_benchmarks.py::test_every_benchmark_quick_writes_its_result_file (sharding --plot-only --out)"
    ),
    "python -m benchmarks all --quick": (
        "tests/test_benchmarks.py::test_every_benchmark_quick_writes_its_result_file (with --out tmp_path)"
    ),
    "pip install --no-deps fairscale==0.4.13": "not run: an optional download of a peer library",
    "benchmarks/gpu_check.sh OUTDIR": "test_benchmark_commands_parse",
}  # every other command of benchmarks/README.md: a full-size run, parsed by test_benchmark_commands_parse


def test_every_block_is_exercised():
    missing = [c for c in readme_commands() if c not in COMMANDS]
    assert not missing, f"commands of the README or docs without a test (add them to COMMANDS): {missing}"
    gone = [c for c in COMMANDS if c not in readme_commands()]
    assert not gone, f"COMMANDS no longer in the README or docs (edited or removed): {gone}"
    for block in (b for b in doc_blocks() if b.lang == "python"):
        anchors = [a for a in SNIPPETS if a in block.text]
        assert len(anchors) == 1, f"{where(block)}: Python block claimed by {anchors} (want one)"
    for anchor in SNIPPETS:
        snippet(anchor)  # exactly one block holds it
    others = [b for b in doc_blocks() if b.lang not in ("bash", "python")]
    keys = {(b.lang, b.text.splitlines()[0]) for b in others}
    assert keys == set(OTHER_BLOCKS) and len(others) == len(OTHER_BLOCKS), (keys, set(OTHER_BLOCKS))
    bench = readme_commands(BENCH_README)
    assert all(c in bench for c in BENCH_COMMANDS), [c for c in BENCH_COMMANDS if c not in bench]
    claims = [*COMMANDS.values(), *SNIPPETS.values(), *OTHER_BLOCKS.values(), *BENCH_COMMANDS.values()]
    for claim in claims:
        name = claim.split()[0]
        assert name in ("CI:", "not") or name.startswith("tests/") or name in globals(), claim
    benchmark_tests = (ROOT / "tests" / "test_benchmarks.py").read_text()
    for claim in (c for c in BENCH_COMMANDS.values() if c.startswith("tests/test_benchmarks.py")):
        assert f"def {claim.split('::')[1].split()[0]}(" in benchmark_tests, claim
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'python -m pip install -q torch==2.13.0 -e ".[dev]"' in ci and "python -m pytest" in ci


# ---------------------------------------------------------------------------------------------------------------
# Python snippets, on 2 ranks


class MyModel(nn.Module):
    """The reader's model: small, and the same initial weights on every rank (as a seeded script gives)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batches(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches of 8 samples, different on each rank (so averaging them matters)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(count)]


def reader_namespace(rank: int, count: int = 4) -> dict[str, Any]:
    """What a reader's script holds before a snippet: the model class, data, a loss, the last batch."""
    loader = batches(rank, count)
    x, y = loader[-1]
    return {"MyModel": MyModel, "loader": loader, "loss_fn": nn.functional.cross_entropy, "x": x, "y": y}


def on_ranks(fn: Any, *args: Any) -> list[Any]:
    """`fn(rank, world_size, *args)` on the 2 pooled gloo ranks, with room for a loaded machine."""
    return run_distributed(fn, WORLD, *args, timeout=TIMEOUT)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


@contextlib.contextmanager
def group_already_made(calls: list[str]) -> Iterator[None]:
    """`torch.distributed.init_process_group` records its backend and returns: the test's ranks have a group."""
    real = torch.distributed.init_process_group

    def already_made(backend: str | None = None, *args: Any, **kwargs: Any) -> None:
        assert torch.distributed.is_initialized()
        calls.append(str(backend))

    torch.distributed.init_process_group = already_made
    try:
        yield
    finally:
        torch.distributed.init_process_group = real


def execute(code: str, namespace: dict[str, Any], folder: str) -> tuple[list[str], str]:
    """Runs README text in `namespace` (in `folder`); returns the backends passed to init_process_group and what
    the code printed."""
    calls: list[str] = []
    printed = io.StringIO()
    with working_directory(folder), group_already_made(calls), contextlib.redirect_stdout(printed):
        exec(compile(code, str(getattr(code, "path", README)), "exec"), namespace)
    return calls, printed.getvalue()


@contextlib.contextmanager
def slow_save(slow: bool) -> Iterator[None]:
    """`torch.save` that takes a second longer when `slow` (rank 0 writing a large checkpoint)."""
    real = torch.save

    def save(*args: Any, **kwargs: Any) -> None:
        time.sleep(1.0)
        real(*args, **kwargs)

    if slow:
        torch.save = save
    try:
        yield
    finally:
        torch.save = real


def _oss_and_checkpoint(rank: int, world_size: int, oss: str, checkpoint: str, folder: str) -> dict[str, Any]:
    ns = reader_namespace(rank)
    before = flat(MyModel())
    calls, _ = execute(oss, ns, folder)
    after = flat(ns["model"])
    with slow_save(rank == 0):  # a real checkpoint takes a while to write: no rank may read it before
        execute(checkpoint, ns, folder)  # every rank loads what rank 0 saved
    saved = torch.load(os.path.join(folder, "optim.pt"))
    ns["optimizer"].consolidate_state_dict(recipient_rank=0)
    again = ns["optimizer"].state_dict() if rank == 0 else None
    plain = torch.optim.Adam(MyModel().parameters(), lr=1e-3)
    plain.load_state_dict(saved)  # "or into a plain torch optimizer"
    return {"calls": calls, "before": before, "after": after, "saved": saved, "again": again}


def assert_trained_alike(results: list[dict[str, Any]]) -> None:
    """Every rank moved its parameters from the common start and ended with the same ones."""
    assert all(not torch.equal(r["before"], r["after"]) for r in results), "the parameters did not move"
    assert all(torch.equal(results[0]["after"], r["after"]) for r in results), "the replicas differ"


def assert_same_state(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            assert_same_state(u, v)
    else:
        assert a == b


def test_oss_snippet_and_its_checkpoint(tmp_path):
    code = snippet("model = DDP(MyModel())"), snippet("optimizer.consolidate_state_dict(recipient_rank=0)")
    results = on_ranks(_oss_and_checkpoint, *code, str(tmp_path))
    assert [r["calls"] for r in results] == [["gloo"]] * WORLD
    assert_trained_alike(results)
    saved = results[0]["saved"]
    assert len(saved["state"]) == len(list(MyModel().parameters())), "the whole state, every rank's shard"
    assert all(int(s["step"]) == 4 for s in saved["state"].values()), "4 batches, 4 Adam steps"
    assert_same_state(results[0]["again"], saved)  # loading it changed nothing


def _oss_with_hook(rank: int, world_size: int, oss: str, hook: str, folder: str) -> dict[str, Any]:
    lines = oss.splitlines()
    at = next(i for i, line in enumerate(lines) if "optimizer = OSS(" in line) + 1
    hooked = "\n".join([*lines[:at], *hook.splitlines(), *lines[at:]])  # the hook right after the optimizer
    results = {}
    for name, code in (("hooked", hooked), ("plain", oss)):
        ns = reader_namespace(rank)
        execute(code, ns, folder)
        results[name] = flat(ns["model"])
    return {"before": flat(MyModel()), "after": results["hooked"], "plain": results["plain"]}


def test_reduce_to_owners_hook_snippet(tmp_path):
    code = snippet("model = DDP(MyModel())"), snippet("model.register_comm_hook(optimizer, reduce_to_owners_hook)")
    results = on_ranks(_oss_with_hook, *code, str(tmp_path))
    assert_trained_alike(results)
    for r in results:  # the same training as with DDP's all-reduce
        assert torch.allclose(r["after"], r["plain"], atol=1e-6), (r["after"] - r["plain"]).abs().max()


def _sharded_data_parallel(rank: int, world_size: int, code: str, folder: str) -> dict[str, Any]:
    ns = reader_namespace(rank)
    before = flat(MyModel())
    execute(code, ns, folder)
    after = flat(ns["model"])
    grads = [p.grad for p in ns["model"].parameters()]
    return {"before": before, "after": after, "accumulated": sum(g is not None for g in grads)}


def test_sharded_data_parallel_snippet(tmp_path):
    code = snippet("model = ShardedDataParallel(model, optimizer)")
    results = on_ranks(_sharded_data_parallel, code, str(tmp_path))
    assert_trained_alike(results)
    assert all(r["accumulated"] > 0 for r in results), "no_sync() left the local gradients in place"


def test_readme_tour_snippet(tmp_path):
    code = snippet("sharded = ShardedDataParallel(model, optimizer)")
    assert code.path == README
    assert_trained_alike(on_ranks(_sharded_data_parallel, code, str(tmp_path)))


def _sharded_grad_scaler(rank: int, world_size: int, code: str, folder: str) -> dict[str, Any]:
    from ddpkit.nn import ShardedDataParallel
    from ddpkit.optim import OSS

    ns = reader_namespace(rank)
    model = MyModel()
    before = flat(model)
    ns["optimizer"] = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
    ns["model"] = ShardedDataParallel(model, ns["optimizer"])
    execute(code, ns, folder)
    return {"before": before, "after": flat(model), "scale": float(ns["scaler"].get_scale())}


def test_sharded_grad_scaler_snippet(tmp_path):
    results = on_ranks(_sharded_grad_scaler, snippet("scaler = ShardedGradScaler()"), str(tmp_path))
    assert_trained_alike(results)
    assert len({r["scale"] for r in results}) == 1 and results[0]["scale"] > 0


def _adascale(rank: int, world_size: int, code: str, folder: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ns = reader_namespace(rank)
    ns["model"] = DDP(MyModel())
    before = flat(ns["model"])
    execute(code, ns, folder)
    optimizer = ns["optimizer"]
    return {"before": before, "after": flat(ns["model"]), "progress": optimizer.scale_invariant_steps}


def test_adascale_snippet(tmp_path):
    code = substituted(snippet("optimizer = AdaScale("))
    results = on_ranks(_adascale, code, str(tmp_path))
    assert_trained_alike(results)
    assert all(r["progress"] >= 3 for r in results), "the loop ran to its (substituted) scale-invariant budget"


def _slowmo(rank: int, world_size: int, code: str, loop: str, count: int, folder: str) -> dict[str, Any]:
    ns = reader_namespace(rank, count)
    ns["model"] = MyModel()
    before = flat(ns["model"])
    execute(code, ns, folder)
    if loop:  # "the same loop as above; at the end, model.average_parameters() gives every rank one exact model"
        execute(loop + "\nmodel.average_parameters()\n", ns, folder)
    return {"before": before, "after": flat(ns["model"])}


def slowmo_loop() -> str:
    """The loop of the SlowMo snippet ("the same loop as above"): its imports, then its lines from the optimizer's
    on (the lines between are left blank, so line numbers stay the README's)."""
    text = snippet("model.perform_slowmo(optimizer)                      # between nodes")
    start = text.index("optimizer = ")
    head = [line if line.startswith(("import ", "from ")) else "" for line in text[:start].split("\n")]
    return "\n".join(head) + text[start:]


@pytest.mark.parametrize(
    ("anchor", "with_loop", "count"),
    [
        (
            "model.perform_slowmo(optimizer)                      # between nodes",
            False,
            6,
        ),  # 6 steps: averaged at steps 3 and 6
        (
            'slowmo_compression="int4", slowmo_error_feedback=True,   # 4-bit',
            True,
            30,
        ),  # 30 steps: every fragment synced at least once
        ("slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP", True, 6),
    ],
)
def test_slowmo_snippets(tmp_path, anchor, with_loop, count):
    code = substituted(snippet(anchor))
    loop = slowmo_loop() if with_loop else ""
    assert_trained_alike(on_ranks(_slowmo, code, loop, count, str(tmp_path)))


def _torchbearer(rank: int, world_size: int, code: str, folder: str) -> dict[str, Any]:
    ns = reader_namespace(rank)
    model = MyModel()
    before = flat(model)
    torch.manual_seed(rank)  # what rank 0 sends must be what every rank ends from
    model.net[0].weight.data.add_(torch.randn_like(model.net[0].weight))
    ns.update(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=ns["loss_fn"])
    execute(code, ns, folder)
    data = TensorDataset(*(torch.cat(t) for t in zip(*ns["loader"], strict=True)))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ns["trial"].with_generators(train_generator=DataLoader(data, batch_size=8)).run(epochs=1)
    return {"before": before, "after": flat(model)}


def test_torchbearer_snippet(tmp_path):
    pytest.importorskip("torchbearer")
    code = snippet("distributed_callbacks(model)")
    assert_trained_alike(on_ranks(_torchbearer, code, str(tmp_path)))


def _comm_stats(rank: int, world_size: int, code: str, folder: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ns = reader_namespace(rank)
    ns["ddp_model"] = ns["model"] = DDP(MyModel())
    ns["optimizer"] = torch.optim.SGD(ns["model"].parameters(), lr=0.1)
    _, printed = execute(code, ns, folder)
    return {"printed": printed, "sent": ns["sent"].sent_bytes("all_reduce")}


def test_comm_stats_snippet(tmp_path):
    results = on_ranks(_comm_stats, snippet("counting_allreduce_hook)"), str(tmp_path))
    gradient_bytes = 4 * sum(p.numel() for p in MyModel().parameters())
    # one all-reduce of every gradient: a rank sends 2 (N-1)/N of it, at N = 2 all of it once
    assert all(r["sent"] == gradient_bytes for r in results), (results, gradient_bytes)
    assert all("all_reduce" in r["printed"] for r in results), results[0]["printed"]


def test_layout_names_files_that_exist():
    layout = next(b for b in doc_blocks() if b.lang == "")
    folder = None
    named = 0
    for line in layout.text.splitlines():
        if not line.startswith(" "):
            folder = ROOT / line.split()[0]
            assert folder.exists(), f"README layout: {line.split()[0]} does not exist"
            if folder.is_file():
                folder = folder.parent
        for name in re.findall(r"\b[\w]+\.py\b", line):
            if not (folder / name).exists() and not any(folder.glob(f"*/{name}")):  # or in a subpackage
                assert (ROOT / name).exists(), f"README layout names {name} under {folder.relative_to(ROOT)}"
            named += 1
    assert named > 40


# ---------------------------------------------------------------------------------------------------------------
# Shell commands


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(tmp_path: Path) -> dict[str, str]:
    """The environment of a command: ddpkit from this checkout, and tmp_path importable (mypkg)."""
    path = os.pathsep.join(filter(None, [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH")]))
    launched = (*TORCHRUN_VARIABLES, "LOCAL_WORLD_SIZE", "GROUP_RANK")  # a launcher's, never a newcomer's shell's
    return {**{k: v for k, v in os.environ.items() if k not in launched}, "PYTHONPATH": path}


def executable(words: list[str]) -> list[str]:
    """`ddpkit ...` and `torchrun ...` as this interpreter's modules (the venv's scripts need not be on PATH)."""
    modules = {"ddpkit": "ddpkit", "torchrun": "torch.distributed.run"}
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return [sys.executable, "-m", modules[words[0]], *words[1:]] if words[0] in modules else words


def start(words: list[str], tmp_path: Path) -> warm_processes.Command:
    """Starts a command in tmp_path (forked warm where it can be: `warm_processes`), its output and errors in one
    file; leading NAME=value words set its environment, as in a shell."""
    env = environment(tmp_path)
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words[0].split("=", 1)
        env[name], words = value, words[1:]
    log = tmp_path / f"command-{uuid.uuid4().hex[:8]}.log"
    return warm_processes.popen(executable(words), log, log, env, tmp_path)


def finish(procs: list[warm_processes.Command]) -> list[str]:
    """Waits for every process; returns their output, failing with it if one did not exit 0."""
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{out[-4000:]}"
    return outputs


def run_command(words: list[str], tmp_path: Path) -> str:
    return finish([start(words, tmp_path)])[0]


def write_mypkg(tmp_path: Path) -> None:
    """The README's mypkg/work.py, written from its own Python block."""
    (tmp_path / "mypkg").mkdir(exist_ok=True)
    (tmp_path / "mypkg" / "work.py").write_text(snippet("def data():").lstrip("\n"))


def write_idx(path: Path, array: torch.Tensor) -> None:
    """An IDX file of unsigned bytes (magic 0x0000080N, then each dimension as a big-endian uint32)."""
    header = bytes([0, 0, 8, array.dim()]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    raw = header + array.to(torch.uint8).numpy().tobytes()
    if path.suffix == ".gz":
        raw = gzip.compress(raw)
    path.write_bytes(raw)


def write_mnist(folder: Path) -> None:
    """A small MNIST-shaped folder: 64 training and 32 test images of 28x28, two files gzipped, two not."""
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    for prefix, count, suffix in (("train", 64, ".gz"), ("t10k", 32, "")):
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", torch.randint(0, 256, (count, 28, 28), generator=g))
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", torch.randint(0, 10, (count,), generator=g))


def write_run_toml(tmp_path: Path) -> None:
    toml = next(b for b in doc_blocks() if b.lang == "toml")
    (tmp_path / "run.toml").write_text(toml.text)


def expand_alternatives(text: str) -> list[str]:
    """`--strategy ddp|oss --optimizer sgd|adam` -> one command per combination of the alternatives."""
    return [" ".join(words) for words in itertools.product(*(w.split("|") for w in text.split()))]


def train_config(text: str, **values: str) -> Any:
    """The TrainConfig `ddpkit train` makes of a README line (its parser, the TOML file, its checks)."""
    words = argv(text, "train", **values)
    assert words[:2] == ["ddpkit", "train"], words
    return pooled_train.train_config(words[1:])


# Lines of two machines: rank 0's line and rank 1's. The README writes out only rank 1's line of the torchrun-style
# flags: rank 0's is the same with --node-rank 0.
TWO_MACHINES = {
    "ddpkit train --world-size 2 --rank 0 --host 10.0.0.1": "ddpkit train --world-size 2 --rank 1 --host 10.0.0.1",
    "ddpkit train --nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr 10.0.0.1": None,
}


def train_lines() -> list[tuple[str, ...]]:
    """Each README `ddpkit train` line the pooled ranks run, as the line of each rank (one line: both ranks';
    alternatives `a|b` expanded, one line per combination)."""
    lines: list[tuple[str, ...]] = []
    for text, runner in COMMANDS.items():
        if runner != "test_train_line" or text in TWO_MACHINES.values():
            continue
        if text in TWO_MACHINES:  # rank 0's line, then rank 1's
            other = TWO_MACHINES[text] or text.replace("--node-rank 1", "--node-rank 0")
            lines.append((text, other) if "--rank 0" in text else (other, text))
            continue
        lines += [(variant,) * WORLD for variant in expand_alternatives(text)]
    return lines


def toml_settings() -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(next(b for b in doc_blocks() if b.lang == "toml").text)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", train_lines(), ids=lambda ranks: ranks[0])
def test_train_line(tmp_path, monkeypatch, ranks):
    """A flag-level `ddpkit train` line of the README: 2 steps on 2 ranks, the replicas equal at the end."""
    monkeypatch.chdir(tmp_path)  # run.toml and relative --out paths, as in the reader's folder
    monkeypatch.syspath_prepend(str(tmp_path))  # mypkg, for the checks before the start
    write_mypkg(tmp_path)
    write_mnist(tmp_path / "mnist")
    write_run_toml(tmp_path)
    values = {"port": str(free_port()), "mnist": str(tmp_path / "mnist")}
    configs = [train_config(text, **values) for text in ranks]
    results = on_ranks(pooled_train.train_rank, configs, str(tmp_path))
    summary = results[0]["summary"]
    assert summary["replicas_equal"] and summary["steps"] == 2, summary
    assert torch.isfinite(torch.tensor(summary["train_loss"])), summary
    assert "--model gpt" not in ranks[0] or "heldout_bits_per_byte" in summary
    if "--config run.toml" in ranks[0]:  # the file's settings, and the flag's learning rate over the file's
        fields = {f.name for f in dataclasses.fields(configs[0])}
        given = {k.replace("-", "_"): v for k, v in toml_settings().items() if k != "lr"}
        given = {k: v for k, v in given.items() if k in fields}
        assert {k: getattr(configs[0], k) for k in given} == given
        assert configs[0].lr == 0.01 and (tmp_path / configs[0].out / "metrics.json").exists(), results[0]["printed"]


@pytest.mark.slow
def test_quick_start_trains(tmp_path):
    text = command("pip install torch==2.13.0 -e . && ddpkit train --out runs/digits")
    train_part = text.split(" && ")[1]  # (the install without extras: tools/check_wheel.py runs it from the wheel)
    out = run_command(argv(train_part, "train"), tmp_path)
    assert re.search(r"replicas equal\s+yes", out), out
    metrics = json.loads((tmp_path / "runs" / "digits" / "metrics.json").read_text())
    assert metrics["summary"]["steps"] == 2 and metrics["summary"]["world_size"] == 2
    assert (tmp_path / "runs" / "digits" / "metrics.png").exists()


@pytest.mark.slow
def test_the_toml_example_trains_to_a_useful_accuracy(tmp_path):
    """The TOML block as its own first line says to run it, in full (on pooled ranks: the training, not the launch,
    is the point): it reached only 0.71 on digits with lr 0.05, batches of 64 and a slow step every 48 (seeds 0, 1,
    2 now give 0.97, 0.95, 0.97)."""
    write_run_toml(tmp_path)
    with working_directory(str(tmp_path)):  # (--config names a file of the current folder)
        out = pooled_train.train(["--config", "run.toml"], tmp_path).stdout
    summary = json.loads((tmp_path / toml_settings()["out"] / "metrics.json").read_text())["summary"]
    assert summary["test_accuracy"] >= 0.9, out


@pytest.mark.slow
def test_torchrun_lines(tmp_path):
    plain = command("torchrun --nproc-per-node 4 -m ddpkit train")
    out = run_command(argv(plain, "train", port=str(free_port())), tmp_path)
    assert re.search(r"strategy\s+sharded on 2 process", out) and re.search(r"replicas equal\s+yes", out), out
    elastic = next(c for c in COMMANDS if c.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"))
    words = argv(command(elastic), "train", port=str(free_port()), tmp=str(tmp_path))
    out = run_command(words, tmp_path)
    assert re.search(r"replicas equal\s+yes", out) and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in out, out
    assert list((tmp_path / "shared" / "run1" / "checkpoint").glob("step-*/COMMIT.json")), out


def test_the_fairscale_diff_swaps_imports_for_the_same_names():
    """docs/fairscale.md's before/after: each removed fairscale import and its added ddpkit import name the same
    objects (fairscale's paths resolved through `ddpkit.compat.fairscale.installed()`), and nothing else changes."""
    from ddpkit.compat import fairscale

    block = next(b for b in doc_blocks() if b.lang == "diff")
    lines = block.text.splitlines()
    removed = "\n".join(line[1:] for line in lines if line.startswith("-"))
    added = "\n".join(line[1:] for line in lines if line.startswith("+"))
    assert removed.count("fairscale") == removed.count("from ") and "fairscale" not in added
    before: dict = {}
    after: dict = {}
    with fairscale.installed():
        exec(removed, before)
    exec(added, after)
    names = {k for k in before if not k.startswith("__")}
    assert names == {k for k in after if not k.startswith("__")} and len(names) == 5, (names, after.keys())
    for name in names:
        assert before[name] is after[name], name


def test_the_torchrun_tutorial(tmp_path):
    """docs/tutorials/torchrun.md: its script, saved as it says, trains under its torchrun command, checkpoints, and
    the resumed run goes on from the next epoch and ends where an uninterrupted run of as many epochs ends."""
    (tmp_path / "train_sharded.py").write_text(snippet("sampler.set_epoch(epoch)  # a new shuffle each epoch"))
    first = command("torchrun --nproc-per-node 2 train_sharded.py --epochs 5 --out runs/tutorial")
    out = run_command(argv(first, port=str(free_port())), tmp_path)
    assert re.search(r"^epoch 0: loss [\d.]+, held-out accuracy 0\.[5-9]", out, re.M), out
    resumed = command("torchrun --nproc-per-node 2 train_sharded.py --epochs 8 --out runs/tutorial --resume")
    out = run_command(argv(resumed, port=str(free_port())), tmp_path)
    assert "epoch 0:" not in out and re.search(r"^epoch 1: ", out, re.M), out
    whole = argv(first, port=str(free_port()))
    whole[whole.index("--epochs") + 1], whole[whole.index("--out") + 1] = "2", "runs/whole"
    run_command(whole, tmp_path)
    a, b = (torch.load(tmp_path / "runs" / name / "checkpoint.pt") for name in ("tutorial", "whole"))
    assert a["epoch"] == b["epoch"] == 1
    for key in b["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    adam = torch.optim.Adam(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).parameters())
    adam.load_state_dict(a["optimizer"])  # the checkpoint's optimizer state is a plain torch Adam's


@pytest.mark.slow
def test_slow_link_training_on_two_machines(tmp_path):
    text = next(c for c in COMMANDS if COMMANDS[c] == "test_slow_link_training_on_two_machines")
    port = str(free_port())
    ranks = [argv(command(text).replace("--rank 0", f"--rank {r}"), "train", port=port) for r in (0, 1)]
    outputs = finish([start(words, tmp_path) for words in ranks])
    assert re.search(r"replicas equal\s+yes", outputs[0]) and "held-out bits per byte" in outputs[0], outputs[0]


@pytest.mark.slow
def test_bench_compares_every_strategy(tmp_path):
    """The README's `ddpkit bench` line on a small MLP (one hidden layer of 64: its sizes are known here): the
    table of every strategy against DDP, the JSON rows, the recommendation and the plot."""
    text = command("ddpkit bench --nproc-per-node 2 --json bench.json")
    words = [*argv(text, "bench"), "--warmup", "1", "--hidden", "64", "--depth", "1"]
    out = run_command(words, tmp_path)
    strategies = list(BENCH_STRATEGIES)
    assert strategies == ["ddp", "oss", "sharded", "slowmo", "sgp"]
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    assert lines[head].count("x ddp") == 3, out
    table = {line.split()[0]: line.split() for line in lines[head + 1 : head + 1 + len(strategies)]}
    assert list(table) == strategies, out
    assert table["ddp"][2] == table["ddp"][5] == table["ddp"][7] == "1.00"  # ratios of ddp against itself
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [r["strategy"] for r in rows] == strategies, out
    parameters = 1024 * 64 + 64 + 64 * 10 + 10  # the bench MLP: 1,024 inputs, 64 hidden, 10 classes
    keys = {"step_ms", "samples_per_second", "sent_bytes_per_step", "optimizer_state_bytes_per_rank"}
    for r in rows:
        assert keys <= set(r) and r["peak_memory_mb"] > 0 and r["parameters"] == parameters
        assert all(r[k] > 0 for k in keys)
    by = {r["strategy"]: r for r in rows}
    # sharded state is partitioned by whole parameters: here one rank owns the 1024 x 64 weight and the other
    # the rest, so the fullest rank holds a little less than ddp's every-rank copy
    full = by["ddp"]["optimizer_state_bytes_per_rank"]
    assert full == by["slowmo"]["optimizer_state_bytes_per_rank"]
    assert 8 * 1024 * 64 <= by["oss"]["optimizer_state_bytes_per_rank"] < full
    assert 8 * 1024 * 64 <= by["sharded"]["optimizer_state_bytes_per_rank"] < full
    # SGP on 2 one-process nodes: each step pushes the parameters and the push-sum weight to one peer, nothing else
    assert by["sgp"]["sent_bytes_per_step"] == 4 * (parameters + 1)
    ratio = by["oss"]["sent_bytes_per_step"] / by["ddp"]["sent_bytes_per_step"]
    assert table["oss"][5] == f"{ratio:.2f}"
    assert "recommendation" in out and (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG"), out
    assert f"wrote {tmp_path / 'bench.json'}" in out or "wrote bench.json" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("line", [c for c, runner in COMMANDS.items() if runner == "test_bench_line"])
def test_bench_line(tmp_path, line):
    write_mypkg(tmp_path)
    out = run_command(argv(command(line), "bench", "bench-more"), tmp_path)
    assert re.search(r"^slowmo\s", out, re.M) and "recommendation" in out, out
    if "--link-mbit 1000" in line:
        assert re.search(r"predicted for 1,?000 Mbit/s", out), out


@pytest.mark.slow
def test_bench_on_two_hosts(tmp_path):
    text = command("ddpkit bench --hosts 10.0.0.1,10.0.0.2 --node-rank 0 --model gpt")
    port = str(free_port())  # (--node-rank 1 there)
    hosts = [argv(text.replace("--node-rank 0", f"--node-rank {r}"), "bench", "bench-more", port=port) for r in (0, 1)]
    outputs = finish([start(words, tmp_path) for words in hosts])
    assert "recommendation" in outputs[0] and "printed on the machine of rank 0" in outputs[1], outputs


@pytest.mark.parametrize("line", [c for c, runner in COMMANDS.items() if runner == "test_gpu_lines"])
def test_gpu_lines(tmp_path, line):
    """On a machine with the GPUs a line needs it trains; elsewhere it is refused before any process starts, with
    a message naming the flag (not a crash)."""
    words = argv(command(line), "train")
    processes = int(words[words.index("--nproc-per-node") + 1])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= (processes if "nccl" in line else 1):
        assert re.search(r"replicas equal\s+yes", run_command(words, tmp_path))
        return
    proc = start(words, tmp_path)
    out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 1 and "Traceback" not in out, out
    assert re.search(r"ddpkit: error: --(backend nccl|device cuda) needs", out), out


# ---------------------------------------------------------------------------------------------------------------
# benchmarks/README.md


def benchmarks_package() -> Any:
    """The repository's `benchmarks` package (``python -m benchmarks`` runs from the root, which pytest's
    sys.path need not hold)."""
    sys.path.insert(0, str(ROOT))
    try:
        import benchmarks.__main__
        import benchmarks.lib.cli  # imported while the root is on sys.path
    finally:
        sys.path.remove(str(ROOT))
    return benchmarks


def test_every_benchmark_help(capsys):
    package = benchmarks_package()
    command("python -m benchmarks NAME --help", BENCH_README)
    for name in package.__main__.registry():
        with pytest.raises(SystemExit) as done:
            package.__main__.main([name, "--help"])
        assert done.value.code == 0
        assert f"python -m benchmarks {name}" in capsys.readouterr().out


PROFILERS = (
    "benchmarks.profile_sharded",
    "benchmarks.profile_memory",
    "benchmarks.probe_allocator",
)  # developers' tools in benchmarks/


def test_benchmark_commands_parse():
    """Every full-size command of benchmarks/README.md names a benchmark and options its parser accepts."""
    package = benchmarks_package()
    modules = package.__main__.registry()
    parsed = 0
    for text in readme_commands(BENCH_README):
        if text in BENCH_COMMANDS:
            continue
        words = shlex.split(text.removeprefix("sudo "))
        if words[:2] == ["python", "-m"] and words[2] in PROFILERS:  # a profiler: not a registered benchmark
            sys.path.insert(0, str(ROOT))
            try:
                profiler = importlib.import_module(words[2])
            finally:
                sys.path.remove(str(ROOT))
            profiler.build_parser().parse_args(words[3:])
            continue
        if words[:2] == ["python", "tools/chaos.py"]:  # the chaos run: a tool of its own (it needs root)
            sys.path.insert(0, str(ROOT / "tools"))
            try:
                importlib.import_module("chaos").build_parser().parse_args(words[2:])
            finally:
                sys.path.remove(str(ROOT / "tools"))
            continue
        assert words[:3] == ["python", "-m", "benchmarks"] and words[3] in modules, text
        parser = package.lib.cli.build_parser(words[3], modules[words[3]], quick="--quick" in words)
        parser.parse_args(words[4:])
        parsed += 1
    assert parsed >= 10
    script = ROOT / command("benchmarks/gpu_check.sh OUTDIR", BENCH_README).split()[0]
    assert os.access(script, os.X_OK) and subprocess.run(["bash", "-n", str(script)]).returncode == 0
