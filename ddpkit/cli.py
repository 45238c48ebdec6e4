"""The `ddpkit` command: `ddpkit train` and `ddpkit bench`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit.train import config as cfgmod
from ddpkit.train.config import TrainConfig

EXAMPLES = """examples:
  ddpkit train                                         # 2 local processes, digits, OSS + ShardedDataParallel
  ddpkit train --strategy slowmo --nproc-per-node 4 --localsgd-frequency 3
  ddpkit train --strategy ddp --optimizer sgd --adascale --grad-accum 2
  torchrun --nproc-per-node 2 -m ddpkit train          # under torchrun
  ddpkit train --world-size 2 --rank 0 --host 10.0.0.1   # on machine 0, then --rank 1 on machine 1
  ddpkit train --model gpt --data text --max-steps 200  # a byte-level GPT on the stdlib's source
  ddpkit train --model mypkg.models:build --data mypkg.data:load --loss mse   # your own model and data
  ddpkit bench --nproc-per-node 2                      # every strategy on one synthetic workload
  ddpkit bench --model gpt --link-mbit 1000            # which strategy for a GPT over a 1 Gbit/s link
"""


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to train")
    what.add_argument("--strategy", choices=cfgmod.STRATEGIES, help="ddp | oss | sharded (default) | slowmo")
    what.add_argument("--optimizer", choices=cfgmod.OPTIMIZERS, help="default adam")
    what.add_argument("--lr", type=float, help="default 0.05 for sgd, 1e-3 for adam/adamw")
    what.add_argument("--momentum", type=float, help="SGD momentum (default 0.9)")
    what.add_argument("--weight-decay", type=float)
    what.add_argument("--adascale", action="store_true", help="AdaScale on top of SGD")
    what.add_argument("--amp", choices=cfgmod.AMP_MODES, help="mixed precision (fp16 uses ShardedGradScaler)")
    what.add_argument("--grad-accum", type=int, metavar="K", help="batches per optimizer step (default 1)")
    what.add_argument("--epochs", type=int)
    what.add_argument("--batch-size", type=int, help="per process (default 32)")
    what.add_argument("--seed", type=int)
    data_help = "digits (default) | mnist | synthetic | text | PACKAGE.MODULE:FACTORY"
    what.add_argument("--data", type=_name_or_factory(cfgmod.DATASETS), help=data_help)
    what.add_argument("--data-dir", help="folder with the four MNIST IDX files (gzipped or not)")
    what.add_argument("--synthetic-samples", type=int)
    what.add_argument("--synthetic-features", type=int)
    what.add_argument("--synthetic-classes", type=int)
    what.add_argument("--hidden", type=int, help="MLP width (default 256)")
    what.add_argument("--depth", type=int, help="MLP hidden layers (default 2)")
    _add_workload_flags(what)
    slowmo = p.add_argument_group("SlowMo (--strategy slowmo)")
    slowmo.add_argument("--slowmo-momentum", type=float)
    slowmo.add_argument("--slowmo-lr", type=float)
    slowmo.add_argument("--slowmo-frequency", type=int)
    slowmo.add_argument("--localsgd-frequency", type=int)
    slowmo.add_argument(
        "--slowmo-nprocs-per-node",
        dest="nprocs_per_node_slowmo",
        type=int,
        help="processes per SlowMo node (default: --nproc-per-node across machines, 1 on one machine)",
    )


def _name_or_factory(names: tuple[str, ...]) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value in names or ":" in value:
            return value
        raise argparse.ArgumentTypeError(f"invalid choice {value!r} (choose {', '.join(names)} or PKG.MODULE:FACTORY)")

    return check


def _add_workload_flags(group: argparse._ArgumentGroup) -> None:
    """--model, --loss, --max-steps and the GPT's shape (shared by `train` and `bench`)."""
    model_help = "mlp (default) | cnn | gpt | PACKAGE.MODULE:FACTORY (returns a module)"
    group.add_argument("--model", type=_name_or_factory(cfgmod.MODELS), help=model_help)
    group.add_argument("--loss", choices=cfgmod.LOSSES, help="default: the model factory's loss, else cross_entropy")
    group.add_argument("--max-steps", type=int, metavar="N", help="stop after N optimizer steps")
    group.add_argument("--gpt-layers", type=int, help="transformer blocks of --model gpt (default 6)")
    group.add_argument("--gpt-width", type=int, help="embedding width of --model gpt (default 384)")
    group.add_argument("--gpt-heads", type=int, help="attention heads of --model gpt (default 6)")
    group.add_argument("--context", type=int, help="bytes per window of --data text and the GPT's context (128)")


def _add_placement_flags(p: argparse.ArgumentParser) -> None:
    where = p.add_argument_group("where it runs (torchrun-style flags, or the plain --world-size/--rank/--host)")
    where.add_argument("--nproc-per-node", type=int, help="local processes (default 2)")
    where.add_argument("--nnodes", type=int)
    where.add_argument("--node-rank", type=int)
    where.add_argument("--master-addr")
    where.add_argument("--master-port", type=int)
    where.add_argument("--world-size", type=int, help="machines, one process each (with --rank and --host)")
    where.add_argument("--rank", type=int, help="this machine's rank (with --world-size and --host)")
    where.add_argument("--host", help="address of rank 0's machine (with --world-size and --rank)")
    where.add_argument("--backend", choices=cfgmod.BACKENDS, help="auto: nccl with a GPU per local process, else gloo")
    where.add_argument("--device", choices=cfgmod.DEVICES, help="auto: cuda with nccl, else cpu; cuda with gloo too")
    where.add_argument("--timeout", type=float, help="seconds before a stuck rendezvous/collective fails (60)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpkit", description="Data-parallel training that costs less memory and network than DDP.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model data-parallel", argument_default=argparse.SUPPRESS)
    _add_training_flags(train)
    _add_placement_flags(train)
    out = train.add_argument_group("outputs")
    out.add_argument("--config", help="TOML file of settings (flags override it)")
    out.add_argument("--out", help="folder for checkpoints, metrics.json, steps.csv and metrics.png")
    out.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    bench = sub.add_parser("bench", help="compare every strategy on one workload", argument_default=argparse.SUPPRESS)
    _add_placement_flags(bench)
    bench.add_argument("--steps", type=int, help="timed steps per strategy (default 20)")
    bench.add_argument("--warmup", type=int, help="untimed steps first (default 3)")
    bench.add_argument("--batch-size", type=int, help="per process (default 32)")
    bench.add_argument("--hidden", type=int, help="MLP width (default 1024)")
    bench.add_argument("--depth", type=int, help="MLP hidden layers (default 4)")
    bench.add_argument("--optimizer", choices=cfgmod.OPTIMIZERS, help="default adam")
    bench.add_argument("--strategies", help="comma-separated subset (default: all)")
    advice = bench.add_argument_group("your workload and your network (the advisor)")
    _add_workload_flags(advice)
    advice.add_argument("--data", type=_name_or_factory(cfgmod.DATASETS), help="default synthetic; text with gpt")
    advice.add_argument("--link-mbit", type=float, metavar="N", help="predict every strategy on an N Mbit/s link")
    advice.add_argument("--link-latency-ms", type=float, help="latency per collective of that link (default 0.5)")
    advice.add_argument("--hosts", help="ADDR0,ADDR1,...: one bench process per host (with --node-rank on each)")
    bench.add_argument("--json", dest="json_path", help="write the results as JSON here")
    bench.add_argument("--plot", help="bar chart PNG path (default bench.png)")
    return parser


def _placement(values: dict[str, Any]) -> dict[str, Any]:
    """Turns --world-size/--rank/--host (one process per machine) into the torchrun-style fields."""
    plain = {k: values.pop(k) for k in ("world_size", "rank", "host") if k in values}
    if not plain:
        return values
    if len(plain) != 3:
        raise ValueError("--world-size, --rank and --host go together (one process per machine)")
    clash = [k for k in ("nnodes", "node_rank", "master_addr", "nproc_per_node") if k in values]
    if clash:
        raise ValueError(f"--world-size/--rank/--host cannot be combined with --{clash[0].replace('_', '-')}")
    if not 0 <= plain["rank"] < plain["world_size"]:
        raise ValueError(f"--rank must be in [0, --world-size={plain['world_size']}); got {plain['rank']}")
    values.update(nnodes=plain["world_size"], node_rank=plain["rank"], master_addr=plain["host"], nproc_per_node=1)
    return values


def make_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the TOML file, then the flags given on the command line."""
    given = dict(vars(args))
    given.pop("command", None)
    values = cfgmod.load_toml(given.pop("config")) if "config" in given else {}
    values.update(_placement(given))
    values.setdefault("nproc_per_node", 2)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in values.items() if k in names})
    cfgmod.validate(cfg)
    return cfg


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from ddpkit.distributed.launch import report_and_exit

    try:
        if args.command == "train":
            from ddpkit.train.launcher import launch_training

            launch_training(make_config(args))
        else:
            from ddpkit.train.bench import run_bench

            run_bench(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        report_and_exit(exc)
    except KeyboardInterrupt:
        print("ddpkit: interrupted; stopped every local process", file=sys.stderr)
        sys.exit(130)
