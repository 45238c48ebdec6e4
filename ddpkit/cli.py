"""The `ddpkit` command: `ddpkit train`, `ddpkit bench` and `ddpkit store` (a fault-tolerant job's store)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit.train.settings import config as cfgmod
from ddpkit.train.settings.config import TrainConfig

TRAIN_EXAMPLES = """examples:
  ddpkit train                                         # 2 local processes, digits, OSS + ShardedDataParallel
  ddpkit train --strategy slowmo --nproc-per-node 4 --localsgd-frequency 3
  ddpkit train --strategy slowmo --slowmo-base sgp --graph ring --nproc-per-node 4 --overlap
  ddpkit train --strategy slowmo --localsgd-frequency 8 --slowmo-compression int4 --slowmo-fragments 4 \\
      --slowmo-sync-delay 1 --slowmo-error-feedback   # streaming DiLoCo: over slow links
  ddpkit train --strategy ddp --optimizer sgd --adascale --grad-accum 2
  torchrun --nproc-per-node 2 -m ddpkit train          # under torchrun
  ddpkit train --world-size 2 --rank 0 --host 10.0.0.1   # on machine 0, then --rank 1 on machine 1
  ddpkit train --strategy ddp --fault-tolerant --nnodes 3 --node-rank K --master-addr HOST0   # survives lost machines
  ddpkit train --model gpt --data text --max-steps 200  # a byte-level GPT on the stdlib's source
  ddpkit train --model mypkg.models:build --data mypkg.data:load --loss mse   # your own model and data
  ddpkit train --out run1 --checkpoint-every 100 && ddpkit train --out run1 --resume   # checkpoints, resume
"""

EXAMPLES = (
    TRAIN_EXAMPLES
    + """\
  ddpkit bench --nproc-per-node 2                      # every strategy on one synthetic workload
  ddpkit bench --model gpt --link-mbit 1000            # which strategy for a GPT over a 1 Gbit/s link
  ddpkit store --port 29510   # then on machine k: torchrun --nnodes 1 --max-restarts 3 -m ddpkit train \\
      --fault-tolerant --nnodes 2 --node-rank k --master-addr <store's address> --master-port 29510
"""
)


def _version() -> str:
    """ddpkit's version and the torch it runs on (read from the installed metadata: torch is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from ddpkit import __version__

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"ddpkit {__version__} (torch {torch})"


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to train")
    what.add_argument(
        "--strategy",
        choices=cfgmod.STRATEGY_NAMES,
        help="ddp | oss | sharded | slowmo | sgp (slowmo with --slowmo-base sgp, as bench names it)",
    )
    what.add_argument("--optimizer", choices=cfgmod.OPTIMIZERS, help="sgd | adam | adamw")
    what.add_argument("--lr", type=float, help="learning rate")
    what.add_argument("--momentum", type=float, help="SGD momentum")
    what.add_argument("--weight-decay", type=float, help="decoupled for adamw")
    what.add_argument("--adascale", action="store_true", help="AdaScale on top of SGD")
    what.add_argument(
        "--shared-parameters",
        action="store_true",
        help="oss / sharded on one machine: the parameters a process does not own are the owner's pages (held once)",
    )
    what.add_argument("--amp", choices=cfgmod.AMP_MODES, help="mixed precision (fp16 uses ShardedGradScaler)")
    what.add_argument("--grad-accum", type=int, metavar="K", help="batches per optimizer step")
    what.add_argument("--epochs", type=int)
    what.add_argument("--batch-size", type=int, help="per process")
    what.add_argument("--seed", type=int)
    data_help = "digits (bundled with scikit-learn) | mnist | synthetic | text | PACKAGE.MODULE:FACTORY"
    what.add_argument("--data", type=_name_or_factory(cfgmod.DATASETS), help=data_help)
    what.add_argument("--data-dir", help="folder with the four MNIST IDX files (gzipped or not)")
    what.add_argument("--synthetic-samples", type=int)
    what.add_argument("--synthetic-features", type=int)
    what.add_argument("--synthetic-classes", type=int)
    what.add_argument("--hidden", type=int, help="MLP width")
    what.add_argument("--depth", type=int, help="MLP hidden layers")
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
        metavar="N",
        help="processes per SlowMo node",
    )
    slowmo.add_argument("--slowmo-base", choices=cfgmod.SLOWMO_BASES, help="between slow steps: averaging or gossip")
    slowmo.add_argument("--graph", choices=cfgmod.SGP_GRAPHS, help="sgp: who gossips with whom")
    slowmo.add_argument("--peers-per-itr", type=int, help="sgp: peers each node sends to per step")
    slowmo.add_argument("--no-push-sum", dest="push_sum", action="store_false", help="sgp: PushPull, no weights")
    slowmo.add_argument("--overlap", action="store_true", help="sgp: mix each round while the next steps compute")
    slowmo.add_argument("--synch-freq", type=int, help="sgp --overlap: steps a round may travel (0 and 1: one)")
    slowmo.add_argument(
        "--slowmo-sgp-average-params", action="store_true", help="sgp: exact average every --localsgd-frequency"
    )
    slowmo.add_argument("--slowmo-nesterov", action="store_true", help="the outer step is Nesterov's (DiLoCo)")
    _add_slow_link_flags(p.add_argument_group("SlowMo over slow links (--strategy slowmo: DiLoCo, Streaming DiLoCo)"))


def _add_slow_link_flags(links: argparse._ArgumentGroup) -> None:
    """How SlowMo's nodes exchange pseudo-gradients (shared by `train` and `bench`)."""
    links.add_argument(
        "--slowmo-compression",
        choices=cfgmod.SLOWMO_COMPRESSIONS,
        help="nodes send pseudo-gradients as none (fp32) | bf16 | int8 | int4",
    )
    links.add_argument("--slowmo-compression-block", type=int, help="values per fp32 scale (int8, int4)")
    links.add_argument(
        "--slowmo-error-feedback", action="store_true", help="what quantisation dropped joins the next sync"
    )
    links.add_argument("--slowmo-fragments", type=int, help="parameter fragments synced at staggered steps")
    links.add_argument("--slowmo-sync-delay", type=int, help="steps a fragment's sync travels before it is merged")
    links.add_argument("--slowmo-merge-alpha", type=float, help="weight of the local parameters in a delayed merge")


def _name_or_factory(names: tuple[str, ...]) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value in names or ":" in value:
            return value
        raise argparse.ArgumentTypeError(f"invalid choice {value!r} (choose {', '.join(names)} or PKG.MODULE:FACTORY)")

    return check


def _add_workload_flags(group: argparse._ArgumentGroup) -> None:
    """--model, --loss, --max-steps and the GPT's shape (shared by `train` and `bench`)."""
    model_help = "mlp | cnn | gpt | PACKAGE.MODULE:FACTORY (returns a module)"
    group.add_argument("--model", type=_name_or_factory(cfgmod.MODELS), help=model_help)
    group.add_argument("--loss", choices=cfgmod.LOSSES, help="cross_entropy | mse")
    group.add_argument("--max-steps", type=int, metavar="N", help="stop after N optimizer steps")
    group.add_argument("--gpt-layers", type=int, help="transformer blocks of --model gpt")
    group.add_argument("--gpt-width", type=int, help="embedding width of --model gpt")
    group.add_argument("--gpt-heads", type=int, help="attention heads of --model gpt")
    group.add_argument("--context", type=int, help="bytes per window of --data text and the GPT's context")


def _add_placement_flags(p: argparse.ArgumentParser) -> None:
    where = p.add_argument_group("where it runs (torchrun-style flags, or the plain --world-size/--rank/--host)")
    where.add_argument("--nproc-per-node", type=int, help="local processes")
    where.add_argument("--nnodes", type=int)
    where.add_argument("--node-rank", type=int)
    where.add_argument("--master-addr")
    where.add_argument("--master-port", type=int)
    where.add_argument("--world-size", type=int, help="machines, one process each (with --rank and --host)")
    where.add_argument("--rank", type=int, help="this machine's rank (with --world-size and --host)")
    where.add_argument("--host", help="address of rank 0's machine (with --world-size and --rank)")
    where.add_argument("--backend", choices=cfgmod.BACKENDS, help="auto: nccl with a GPU per local process, else gloo")
    where.add_argument("--device", choices=cfgmod.DEVICES, help="auto: cuda with nccl, else cpu; cuda with gloo too")
    where.add_argument("--timeout", type=float, help="seconds before a stuck rendezvous/collective fails")
    where.add_argument(
        "--allocator",
        choices=cfgmod.ALLOCATORS,
        help="mapped: CPU blocks of 8 MiB or more get mappings of their own, in huge pages, and are returned when "
        "freed (less memory for ZeRO-2); default: glibc as it comes; auto (default): mapped for --strategy sharded",
    )


def _add_fault_tolerance_flags(p: argparse.ArgumentParser) -> None:
    ft = p.add_argument_group(
        "keeping on through lost machines (every strategy; with oss and sharded a machine's processes are one replica)"
    )
    ft.add_argument("--fault-tolerant", action="store_true", help="survivors train on; a rank started again rejoins")
    ft.add_argument("--min-replicas", type=int, metavar="N", help="fewest live ranks to go on with")
    ft.add_argument("--quorum-timeout", type=float, metavar="S", help="seconds a round waits for a missing rank")
    ft.add_argument(
        "--store",
        metavar="etcd://HOST:PORT[,HOST:PORT...][/JOB]",
        help="keep the job's coordination in an etcd cluster, so that any one machine may be lost (machine 0 too)",
    )
    ft.add_argument(
        "--job-id", metavar="NAME", help="the job's name in its store: a rank of another job that reaches it is refused"
    )


# defaults that are not a TrainConfig field's value (computed, or set by the command line)
TRAIN_DEFAULTS = {
    "lr": "0.05 for sgd, 0.001 for adam and adamw",
    "weight_decay": "0.01 for adamw (torch's default), 0 for sgd and adam",
    "nprocs_per_node_slowmo": "--nproc-per-node across machines, 1 on one machine",
    "nproc_per_node": 2,
    "master_port": "a free port on one machine, 29500 across machines",
    "data_dir": "none",
    "out": "none: nothing is written",
    "progress": "the bar is shown on rank 0",
    "config": "none",
    "world_size": "none",
    "rank": "none",
    "host": "none",
}
BENCH_DEFAULTS = {"nproc_per_node": 2, "steps": 20, "warmup": 3, "batch_size": 32, "hidden": 1024, "depth": 4}
BENCH_DEFAULTS |= {"optimizer": "adam", "strategies": "all", "json_path": "OUT/bench.json with --out, else none"}
BENCH_DEFAULTS |= {"plot": "OUT/bench.png, else bench.png in the current folder", "out": "none"}
BENCH_DEFAULTS |= {k: TRAIN_DEFAULTS[k] for k in ("master_port", "world_size", "rank", "host")}
BENCH_DEFAULTS |= {"data": "synthetic (text with --model gpt)", "link_latency_ms": 0.5, "hosts": "none"}
BENCH_DEFAULTS |= {"loss": "the model factory's loss, else cross_entropy"}
BENCH_DEFAULTS |= {"link_mbit": "none: measured between --hosts, else between the local processes"}
TRAIN_DEFAULTS |= {"loss": "the model factory's loss, else cross_entropy", "max_steps": "none: every epoch"}
TRAIN_DEFAULTS |= {"eval_every": "about 15 evaluations per run: the run's steps / 15"}


def _default_text(value: Any, action: argparse.Action) -> str:
    if isinstance(value, bool):
        if isinstance(action, argparse._StoreFalseAction):  # --no-X: the flag is off when X is on by default
            value = not value
        return "on" if value else "off"
    return "none" if value is None else str(value)


def _show_defaults(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """Appends "(default: X)" to every option's help: `defaults`, else TrainConfig's value for the option."""
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for action in parser._actions:
        if action.dest == "help" or not action.option_strings:
            continue
        value = defaults[action.dest] if action.dest in defaults else fields[action.dest]
        action.help = f"{action.help or ''} (default: {_default_text(value, action)})".lstrip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpkit",
        description="Data-parallel training that costs less memory and network than DDP.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    # allow_abbrev=False everywhere: `--nproc 4` must not silently become --nproc-per-node 4
    train = sub.add_parser(
        "train",
        help="train a model data-parallel",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
        epilog=TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_training_flags(train)
    _add_placement_flags(train)
    _add_fault_tolerance_flags(train)
    out = train.add_argument_group("outputs")
    out.add_argument("--config", help="TOML file of settings (flags override it)")
    out.add_argument(
        "--out",
        help="folder on this machine for metrics.json, steps.csv, metrics.png and checkpoints (rank 0 writes them; "
        "with slowmo each rank also its replica); give it on every machine or none (paths may differ)",
    )
    out.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    out.add_argument("--keep", type=int, metavar="K", help="checkpoints kept, the newest")
    out.add_argument("--checkpoint-every", type=int, metavar="N", help="also checkpoint every N steps")
    out.add_argument(
        "--no-checkpoints", dest="checkpoints", action="store_false", help="--out gets the metrics, no checkpoint"
    )
    out.add_argument(
        "--eval-every",
        type=int,
        metavar="N",
        help="held-out evaluation every N optimizer steps, besides each epoch's end (0: epoch ends only), for "
        "metrics.png's held-out curve and metrics.json's heldout series",
    )
    out.add_argument("--debug", action="store_true", help="tracebacks and torch's C++ stack traces on failure")
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    _show_defaults(train, TRAIN_DEFAULTS)
    bench = sub.add_parser(
        "bench", help="compare every strategy on one workload", argument_default=argparse.SUPPRESS, allow_abbrev=False
    )
    _add_placement_flags(bench)
    bench.add_argument("--steps", type=int, help="timed steps per strategy")
    bench.add_argument("--warmup", type=int, help="untimed steps first")
    bench.add_argument("--batch-size", type=int, help="per process")
    bench.add_argument("--hidden", type=int, help="MLP width")
    bench.add_argument("--depth", type=int, help="MLP hidden layers")
    bench.add_argument("--optimizer", choices=cfgmod.OPTIMIZERS, help="sgd | adam | adamw")
    bench.add_argument("--strategies", help="comma-separated subset of ddp,oss,sharded,slowmo,sgp")
    _add_slow_link_flags(bench.add_argument_group("the slowmo run over slow links"))
    advice = bench.add_argument_group("your workload and your network (the advisor)")
    _add_workload_flags(advice)
    data_help = "synthetic | text | PACKAGE.MODULE:FACTORY"
    advice.add_argument("--data", type=_name_or_factory(cfgmod.DATASETS), help=data_help)
    advice.add_argument("--link-mbit", type=float, metavar="N", help="predict every strategy on an N Mbit/s link")
    advice.add_argument("--link-latency-ms", type=float, help="latency per collective of that link")
    advice.add_argument("--hosts", help="ADDR0,ADDR1,...: one bench process per host (with --node-rank on each)")
    bench.add_argument("--out", help="folder for bench.png and bench.json (made if needed)")
    bench.add_argument("--json", dest="json_path", help="write the results as JSON here (instead of OUT/bench.json)")
    bench.add_argument("--plot", help="bar chart PNG path (instead of OUT/bench.png)")
    _show_defaults(bench, BENCH_DEFAULTS)
    store = sub.add_parser(
        "store",
        help="host the store of a fault-tolerant job whose machines each run torchrun (see docs/fault-tolerance.md)",
        description="Hosts the store where the replicas of a fault-tolerant job meet: ranks started by torchrun with "
        "--fault-tolerant, or loops of your own holding a ddpkit.fault_tolerance.Manager on a TCPStore client of it. "
        "It listens on every address of this machine and ends by itself once the job's ranks have finished (ddpkit "
        "train) or every rank's heartbeat is silent, or after --timeout seconds without a round.",
        epilog="example: ddpkit store --port 29510   (then, on every machine: torchrun ... -m ddpkit train "
        "--fault-tolerant --master-addr <this machine> --master-port 29510 ...)",
        allow_abbrev=False,
    )
    store.add_argument("--port", type=int, required=True, help="TCP port, given to every machine as --master-port")
    store.add_argument("--job-id", metavar="NAME", help="the job's name: ranks of another --job-id are refused")
    store.add_argument(
        "--timeout", type=float, default=600.0, help="give up after this many seconds without a round (default: 600)"
    )
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
    values = cfgmod.expand_strategy(values)
    cfg = TrainConfig(**{k: v for k, v in values.items() if k in names})
    cfgmod.validate(cfg)
    return cfg


def check_bench(given: dict[str, Any]) -> None:
    """`ddpkit bench`'s numbers, checked before any process starts (argparse has checked their types)."""
    minima = {"steps": 1, "warmup": 0, "batch_size": 1, "hidden": 1, "depth": 1, "nproc_per_node": 1, "nnodes": 1}
    for name, low in minima.items():
        if name in given:
            cfgmod.check_int(name, given[name], low)
    if "timeout" in given:
        cfgmod.check_number("timeout", given["timeout"], 0.0, open_low=True)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, parsed; an unknown flag is reported with the usage of the command it was given to
    (``ddpkit train --nproc 4`` shows `train`'s usage, not the top level's)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    from ddpkit.distributed.launch import report_and_exit

    try:
        if args.command == "train":
            from ddpkit.train.loop.launcher import launch_training

            launch_training(make_config(args))
        elif args.command == "store":
            from ddpkit.train.loop.launcher import host_job_store

            if not 1 <= args.port <= 65535:
                raise ValueError(f"--port must be in 1..65535; got {args.port}")
            cfgmod.check_number("timeout", args.timeout, 0.0, open_low=True)
            if args.job_id is not None:
                cfgmod.check_job_id(args.job_id)
            host_job_store(args.port, args.timeout, args.job_id)
        else:
            from ddpkit.train.loop.bench import run_bench

            check_bench(vars(args))
            run_bench(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        report_and_exit(exc)
    except KeyboardInterrupt:
        print("ddpkit: interrupted; stopped every local process", file=sys.stderr)
        sys.exit(130)
