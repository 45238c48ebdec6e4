"""`ddpkit train` and `ddpkit bench` settings checked before any process starts: numbers finite and in range,
TOML values of the right type (never coerced), an --out that can be written, NCCL only with enough GPUs, AdamW's
default weight decay, the model x data combinations, and every default shown by --help. In-process: parsing and
validation only; the runs that must start are in test_train_checks.py."""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train_checks import write_tiny_mnist

import ddpkit
from ddpkit import cli
from ddpkit.nn import SlowMoDistributedDataParallel
from ddpkit.train.loop.strategies import optimizer_arguments
from ddpkit.train.settings import config as cfgmod
from ddpkit.train.settings.config import DATASETS, MODELS, TrainConfig, validate

ROOT = Path(__file__).resolve().parents[1]


def config_from(argv: list[str]) -> TrainConfig:
    return cli.make_config(cli.build_parser().parse_args(["train", *argv]))


def error_of(argv: list[str]) -> str:
    with pytest.raises((ValueError, TypeError, FileNotFoundError)) as info:
        config_from(argv)
    return str(info.value)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--lr", "nan"], "--lr must be a finite number > 0; got nan"),
        (["--lr", "inf"], "--lr must be a finite number > 0; got inf"),
        (["--lr", "0"], "--lr must be a finite number > 0; got 0.0"),
        (["--momentum=-inf"], "--momentum must be a finite number >= 0 and < 1; got -inf"),
        (["--momentum", "1.5"], "--momentum must be a finite number >= 0 and < 1; got 1.5"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0; got nan"),
        (["--weight-decay=-0.1"], "--weight-decay must be a finite number >= 0; got -0.1"),
        (["--timeout", "inf"], "--timeout must be a finite number > 0; got inf"),
        (["--timeout", "0"], "--timeout must be a finite number > 0; got 0.0"),
        (["--slowmo-momentum", "nan"], "--slowmo-momentum must be a finite number >= 0 and < 1; got nan"),
        (["--slowmo-lr", "inf"], "--slowmo-lr must be a finite number > 0; got inf"),
        (["--slowmo-frequency", "0"], "--slowmo-frequency must be an integer >= 1; got 0"),
        (["--localsgd-frequency=-3"], "--localsgd-frequency must be an integer >= 1; got -3"),
        (["--slowmo-nprocs-per-node", "0"], "--slowmo-nprocs-per-node must be an integer >= 1; got 0"),
        (["--epochs", "0"], "--epochs must be an integer >= 1; got 0"),
        (["--batch-size=-1"], "--batch-size must be an integer >= 1; got -1"),
        (["--seed=-1"], "--seed must be an integer >= 0; got -1"),
        (["--model", "cnn", "--data", "synthetic", "--synthetic-features", "10"], "needs a square"),
        (["--backend", "nccl"], "--backend nccl needs CUDA GPUs"),
        (["--slowmo-base", "sgp"], "--slowmo-base sgp needs --strategy slowmo (got sharded)"),
        (["--no-checkpoints", "--checkpoint-every", "5"], "--no-checkpoints cannot be combined with --resume or"),
        (["--strategy", "slowmo", "--slowmo-base", "sgp", "--peers-per-itr", "0"], "--peers-per-itr must be an"),
        (["--strategy", "slowmo", "--slowmo-base", "sgp", "--synch-freq=-1"], "--synch-freq must be an integer >= 0"),
        (
            ["--strategy", "slowmo", "--slowmo-base", "sgp", "--graph", "bipartite-linear", "--nproc-per-node", "3"],
            "--graph bipartite-linear with --peers-per-itr 1 on 3 nodes: DynamicBipartiteLinearGraph: a bipartite",
        ),
        (
            ["--strategy", "slowmo", "--slowmo-base", "sgp", "--graph", "ring", "--peers-per-itr", "2"],
            "--graph ring with --peers-per-itr 2 on 2 nodes: RingGraph: peers_per_itr=2 cannot be served",
        ),
    ],
)
def test_numbers_are_finite_and_in_range(flags, needle, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert needle in error_of(flags)


SLOW = ["--strategy", "slowmo", "--localsgd-frequency", "4", "--slowmo-frequency", "8"]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ([*SLOW, "--slowmo-compression", "fp8"], "invalid choice: 'fp8'"),
        ([*SLOW, "--slowmo-compression-block", "0"], "--slowmo-compression-block must be an integer >= 1; got 0"),
        ([*SLOW, "--slowmo-compression", "int4", "--slowmo-compression-block", "7"], "an even --slowmo-compression-b"),
        ([*SLOW, "--slowmo-fragments", "0"], "--slowmo-fragments must be an integer >= 1; got 0"),
        ([*SLOW, "--slowmo-fragments", "5"], "--slowmo-fragments 5 must be at most --localsgd-frequency 4"),
        ([*SLOW, "--slowmo-sync-delay", "4"], "--slowmo-sync-delay 4 must be smaller than --localsgd-frequency 4"),
        ([*SLOW, "--slowmo-sync-delay=-1"], "--slowmo-sync-delay must be an integer >= 0; got -1"),
        ([*SLOW, "--slowmo-sync-delay", "1", "--slowmo-frequency", "6"], "a multiple of --localsgd-frequency (4)"),
        ([*SLOW, "--slowmo-merge-alpha", "1.5"], "--slowmo-merge-alpha must be a number in [0, 1]; got 1.5"),
        ([*SLOW, "--slowmo-merge-alpha", "nan"], "--slowmo-merge-alpha must be a finite number >= 0; got nan"),
        ([*SLOW, "--slowmo-base", "sgp", "--slowmo-fragments", "2"], "need --slowmo-base localsgd"),
        (["--strategy", "ddp", "--slowmo-compression", "int8"], "--slowmo-compression needs --strategy slowmo"),
        # flags that would be silently ignored
        ([*SLOW, "--slowmo-merge-alpha", "0.3"], "--slowmo-merge-alpha weights a delayed merge: it needs --slowmo-sy"),
        ([*SLOW, "--graph", "ring", "--peers-per-itr", "2"], "--graph, --peers-per-itr only act with --slowmo-base"),
        (["--strategy", "ddp", "--overlap"], "--overlap needs --strategy slowmo"),
        (["--data", "text", "--model", "gpt", "--context", "70000"], "--context 70000 is longer than --data text's"),
    ],
)
def test_slow_link_flags_are_checked(flags, needle, capsys):
    try:
        message = error_of(flags)
    except SystemExit:  # argparse's own refusal (an unknown choice)
        message = capsys.readouterr().err
    assert needle in message


def test_slow_link_flags_reach_slowmo_and_the_metrics():
    from ddpkit.train.loop.strategies import slow_link_arguments

    flags = [*SLOW, "--slowmo-compression", "int4", "--slowmo-compression-block", "32", "--slowmo-fragments", "4"]
    flags += [
        "--slowmo-sync-delay",
        "1",
        "--slowmo-merge-alpha",
        "0.25",
        "--slowmo-error-feedback",
        "--slowmo-nesterov",
    ]
    cfg = config_from(flags)
    assert slow_link_arguments(cfg) == {
        "slowmo_compression": "int4",
        "slowmo_compression_block": 32,
        "slowmo_error_feedback": True,
        "slowmo_fragments": 4,
        "slowmo_sync_delay": 1,
        "slowmo_merge_alpha": 0.25,
    }
    assert cfg.slowmo_nesterov
    defaults = slow_link_arguments(config_from(SLOW))
    assert defaults == {
        k: v.default for k, v in inspect.signature(SlowMoDistributedDataParallel).parameters.items() if k in defaults
    }


def test_bench_passes_the_slow_link_flags_to_its_slowmo_run():
    from ddpkit.train.loop import bench

    args = cli.build_parser().parse_args(["bench", "--slowmo-compression", "int4", "--slowmo-fragments", "3"])
    cfg = bench.bench_config(vars(args))
    assert (cfg.slowmo_compression, cfg.slowmo_fragments, cfg.localsgd_frequency) == ("int4", 3, 3)
    assert bench.strategy_config(cfg, "slowmo").slowmo_compression == "int4"
    sgp = bench.strategy_config(cfg, "sgp")  # gossip: no slow-link settings
    assert (sgp.slowmo_base, sgp.slowmo_compression, sgp.slowmo_fragments) == ("sgp", "none", 1)
    with pytest.raises(ValueError, match="--slowmo-fragments 4 must be at most --localsgd-frequency 3"):
        bench.bench_config({"slowmo_fragments": 4})


def test_slowmo_compression_names_are_the_library_ones():
    from ddpkit.algorithms.quantize import COMPRESSIONS

    assert cfgmod.SLOWMO_COMPRESSIONS == COMPRESSIONS


def test_sgp_graph_names_are_the_library_graphs():
    from ddpkit.algorithms.gossip_graphs import GRAPHS

    assert sorted(cfgmod.SGP_GRAPHS) == sorted(GRAPHS)
    flags = ["--strategy", "slowmo", "--slowmo-base", "sgp", "--graph", "linear", "--overlap", "--no-push-sum"]
    cfg = config_from(flags)
    assert (cfg.slowmo_base, cfg.graph, cfg.overlap, cfg.push_sum, cfg.synch_freq) == ("sgp", "linear", True, False, 0)


def test_toml_values_of_the_wrong_type_name_the_key(tmp_path):
    path = tmp_path / "run.toml"
    for text, needle in [
        ('lr = "0.01"', "setting 'lr': --lr must be a number (or absent); got '0.01' (str)"),
        ("epochs = 2.0", "setting 'epochs': --epochs must be an integer; got 2.0 (float)"),
        ("epochs = true", "setting 'epochs': --epochs must be an integer; got True (bool)"),
        ('adascale = "yes"', "setting 'adascale': --adascale must be true or false; got 'yes' (str)"),
        ("progress = 0", "setting 'progress': --progress must be true or false; got 0 (int)"),
        ("batch-size = [32]", "setting 'batch-size': --batch-size must be an integer; got [32] (list)"),
        ("strategy = 1", "setting 'strategy': --strategy must be a string; got 1 (int)"),
        ("lr = nan", "--lr must be a finite number > 0; got nan"),
        ("timeout = inf", "--timeout must be a finite number > 0; got inf"),
        ("world-size = 2", "unknown setting 'world-size'"),
        ("lr = 0.1 0.2", "run.toml: not valid TOML: "),  # a syntax error names the file
    ]:
        path.write_text(text + "\n")
        assert needle in error_of(["--config", str(path)]), text
    path.write_text('slowmo-nprocs-per-node = 2\nlr = 1\nweight_decay = 0\nstrategy = "slowmo"\nnproc-per-node = 4\n')
    cfg = config_from(["--config", str(path)])
    assert (cfg.nprocs_per_node_slowmo, cfg.lr, cfg.weight_decay, cfg.nproc_per_node) == (2, 1.0, 0.0, 4)
    assert type(cfg.lr) is float  # an integer is taken where a number is expected, and stored as one


def test_the_python_api_is_checked_alike():
    with pytest.raises(TypeError, match="--epochs must be an integer; got '3'"):
        validate(TrainConfig(epochs="3"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="--progress must be true or false; got 1"):
        validate(TrainConfig(progress=1))  # type: ignore[arg-type]


def test_out_that_cannot_be_written_fails_before_start(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert f"--out {str(a_file)!r} is a file, not a folder" in error_of(["--out", str(a_file)])
    inside = a_file / "sub"
    assert f"--out {str(inside)!r} is inside {str(a_file)!r}, a file" in error_of(["--out", str(inside)])
    assert "--out '/proc/1/ddpkit-out' cannot be written (its folder '/proc/1' exists)" in error_of(
        ["--out", "/proc/1/ddpkit-out"]
    )
    if os.geteuid() != 0:  # root writes into read-only folders
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert "cannot be written" in error_of(["--out", str(locked / "run")])
    fresh = tmp_path / "new" / "deeper"
    assert config_from(["--out", str(fresh)]).out == str(fresh)
    assert not (tmp_path / "new").exists()  # checked, not created
    assert os.listdir(tmp_path) == ["a-file"] + (["locked"] if os.geteuid() != 0 else [])


def test_nccl_needs_one_gpu_per_local_process(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    text = error_of(["--backend", "nccl", "--nproc-per-node", "2"])
    assert "--backend nccl gives each local process a GPU of its own: 2 local processes need 2 GPUs and 1 are" in text
    assert "use --nproc-per-node 1 or --backend gloo" in text
    assert config_from(["--nproc-per-node", "4"]).backend == "auto"  # auto: gloo unless every process has a GPU
    assert config_from(["--backend", "nccl", "--nproc-per-node", "1"]).backend == "nccl"
    assert config_from(["--backend", "gloo", "--nproc-per-node", "4"]).backend == "gloo"


def test_adamw_uses_torchs_default_weight_decay():
    torch_default = inspect.signature(torch.optim.AdamW).parameters["weight_decay"].default
    assert torch_default == 0.01
    assert optimizer_arguments(config_from(["--optimizer", "adamw"])) == {"lr": 1e-3, "weight_decay": torch_default}
    assert optimizer_arguments(config_from(["--optimizer", "adam"])) == {"lr": 1e-3, "weight_decay": 0.0}
    given = config_from(["--optimizer", "adamw", "--weight-decay", "0"])
    assert optimizer_arguments(given)["weight_decay"] == 0.0
    sgd = optimizer_arguments(config_from(["--optimizer", "sgd"]))
    assert sgd == {"lr": 0.05, "weight_decay": 0.0, "momentum": 0.9}


# every model x data pair: True when it trains (test_train_checks.py runs each), else the start of the reason it
# is refused before any process starts
MATRIX: dict[tuple[str, str], bool | str] = {
    ("gpt", "text"): True,
    ("gpt", "digits"): "--model gpt reads byte sequences",
    ("gpt", "mnist"): "--model gpt reads byte sequences",
    ("gpt", "synthetic"): "--model gpt reads byte sequences",
    ("mlp", "text"): "--model mlp classifies",
    ("cnn", "text"): "--model cnn classifies",
    ("mlp", "digits"): True,
    ("mlp", "mnist"): True,
    ("mlp", "synthetic"): True,
    ("cnn", "digits"): True,
    ("cnn", "mnist"): True,
    ("cnn", "synthetic"): True,  # a square number of features (64 by default) is announced and shaped as 1x8x8
}


def matrix_flags(model: str, data: str, mnist_dir: Path) -> list[str]:
    return ["--model", model, "--data", data] + (["--data-dir", str(mnist_dir)] if data == "mnist" else [])


def test_every_model_and_data_pair_is_accepted_or_refused_up_front(tmp_path):
    assert set(MATRIX) == {(m, d) for m in MODELS for d in DATASETS}, "classify every new model x data pair"
    write_tiny_mnist(tmp_path / "mnist")
    for (model, data), outcome in MATRIX.items():
        flags = matrix_flags(model, data, tmp_path / "mnist")
        if outcome is True:
            assert (config_from(flags).model, config_from(flags).data) == (model, data)
        else:
            assert str(outcome) in error_of(flags)
    # synthetic features that do not make a square image are refused for the CNN, not for the MLP
    refused = ["--model", "cnn", "--data", "synthetic", "--synthetic-features", "48"]
    assert "--model cnn on synthetic data needs a square --synthetic-features" in error_of(refused)
    assert config_from(["--data", "synthetic", "--synthetic-features", "48"]).synthetic_features == 48


def _help_entries(text: str) -> dict[str, str]:
    """{option: its help text} from argparse's --help output."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  -"):
            current = stripped.split()[0].rstrip(",")
            entries[current] = stripped
        elif current and line.startswith("      "):
            entries[current] += " " + stripped
        else:
            current = None
    return entries


def test_help_shows_every_default():
    result = subprocess.run(
        [sys.executable, "-m", "ddpkit", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"},
    )
    assert result.returncode == 0, result.stderr
    entries = _help_entries(result.stdout)
    options = {
        o
        for a in cli.build_parser()._subparsers._group_actions[0].choices["train"]._actions  # type: ignore[union-attr]
        for o in a.option_strings[:1]
        if o != "-h"
    }
    assert options <= set(entries) and len(options) > 35
    for option in options:
        assert "(default: " in entries[option], entries[option]
    fields = {f"--{name.replace('_', '-')}": value for name, value in vars(TrainConfig()).items()}
    for option in ("--strategy", "--optimizer", "--epochs", "--batch-size", "--hidden", "--slowmo-frequency"):
        assert f"(default: {fields[option]})" in entries[option], entries[option]
    assert "(default: 60.0)" in entries["--timeout"] and "(default: 2)" in entries["--nproc-per-node"]
    assert "0.01 for adamw" in entries["--weight-decay"] and "0.05 for sgd" in entries["--lr"]
    # a --no-X switch is off unless given (X on by default), as "--resume" is off
    for switch in ("--no-checkpoints", "--no-push-sum", "--resume"):
        assert entries[switch].endswith("(default: off)"), entries[switch]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--nproc", "4"], "unrecognized arguments: --nproc 4"),  # never taken for --nproc-per-node
        (["train", "--strat", "oss"], "unrecognized arguments: --strat oss"),
        (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["bench", "--step", "3"], "unrecognized arguments: --step 3"),
    ],
)
def test_no_abbreviations_and_unknown_flags_show_the_commands_usage(argv, needle, capsys):
    with pytest.raises(SystemExit):
        cli.parse(argv)
    err = capsys.readouterr().err
    assert needle in err and err.startswith(f"usage: ddpkit {argv[0]} "), err


def test_bench_numbers_are_checked_before_start(capsys):
    for flags, needle in [
        (["--steps", "0"], "--steps must be an integer >= 1; got 0"),
        (["--warmup=-1"], "--warmup must be an integer >= 0; got -1"),
        (["--timeout", "nan"], "--timeout must be a finite number > 0; got nan"),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1; got 0"),
    ]:
        with pytest.raises(SystemExit) as info:
            cli.main(["bench", *flags])
        assert info.value.code == 1
        assert needle in capsys.readouterr().err


def test_numeric_ranges_cover_every_float_setting():
    floats = {n for n, (types, _) in cfgmod.field_types().items() if types == (float,)}
    assert floats == set(cfgmod.FLOAT_RANGES)
    ints = {n for n, (types, optional) in cfgmod.field_types().items() if types == (int,) and not optional}
    assert ints == set(cfgmod.INT_MINIMA)
    assert math.isinf(cfgmod.FLOAT_RANGES["lr"][1])


def test_the_readme_toml_example_is_valid(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "getting-started.md").read_text()  # the TOML example of `ddpkit train`
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "run.toml").write_text(example)
    monkeypatch.chdir(tmp_path)
    cfg = config_from(["--config", "run.toml", "--epochs", "2"])
    assert (cfg.strategy, cfg.optimizer, cfg.lr, cfg.batch_size, cfg.localsgd_frequency) == (
        "slowmo",
        "sgd",
        0.1,
        32,
        4,
    )
    assert cfg.epochs == 2 and cfg.progress is False and cfg.model == "cnn"


def test_the_held_out_text_size_is_the_text_modules():
    from ddpkit.train.settings.config import HELDOUT_TEXT_BYTES
    from ddpkit.train.workloads.text import DEFAULT_HELDOUT_BYTES

    assert HELDOUT_TEXT_BYTES == DEFAULT_HELDOUT_BYTES


def test_version_names_ddpkit_and_torch(capsys):
    with pytest.raises(SystemExit) as info:
        cli.parse(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ddpkit {ddpkit.__version__} (torch {torch.__version__})"


def test_every_example_in_train_help_is_a_valid_command():
    """`ddpkit train --help` ends with examples; each `ddpkit train` line of them parses and passes the checks a
    run makes before it starts (mypkg's factories aside: they are the reader's own)."""
    lines = [line.split("#")[0] for line in cli.TRAIN_EXAMPLES.replace("\\\n", " ").splitlines()]
    commands = [part.split() for line in lines for part in line.split("&&") if "ddpkit train" in part]
    assert len(commands) >= 10
    for words in commands:
        flags = [
            w.replace("HOST0", "10.0.0.1").replace("K", "0") if w in ("HOST0", "K") else w
            for w in words[words.index("train") + 1 :]
        ]
        if "mypkg.models:build" in flags:
            continue
        if "--resume" in flags:  # (the line after a run that wrote the checkpoint)
            assert "--resume: no complete checkpoint in run1" in error_of(flags)
            continue
        config_from(flags)


def test_sgp_is_one_name_in_train_and_bench():
    """`ddpkit bench --strategies ...,sgp` names SGP as a strategy; `ddpkit train --strategy sgp` takes the same name
    (slowmo gossiping), and refuses it with another --slowmo-base."""
    cfg = config_from(["--strategy", "sgp", "--graph", "ring"])
    assert (cfg.strategy, cfg.slowmo_base, cfg.graph) == ("slowmo", "sgp", "ring")
    refused = error_of(["--strategy", "sgp", "--slowmo-base", "localsgd"])
    assert "--strategy sgp is slowmo with --slowmo-base sgp" in refused
    from ddpkit.train.loop.bench import BENCH_STRATEGIES

    assert set(BENCH_STRATEGIES) == set(cfgmod.STRATEGY_NAMES)
