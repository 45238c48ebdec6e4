"""Everything `ddpkit train` can be told, with defaults, TOML loading and checks that run before any process."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import tempfile
import typing
from dataclasses import dataclass
from typing import Any

from ddpkit.train.workloads import registry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STRATEGIES = ("ddp", "oss", "sharded", "slowmo")
OPTIMIZERS = ("sgd", "adam", "adamw")
AMP_MODES = ("off", "bf16", "fp16")
DATASETS = tuple(registry.DATASETS)  # or PACKAGE.MODULE:FACTORY (ddpkit.train.workloads.factories)
MODELS = tuple(registry.MODELS)  # or PACKAGE.MODULE:FACTORY
LOSSES = registry.LOSSES
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
ALLOCATORS = ("auto", "default", "mapped")  # glibc's handling of large CPU blocks (ddpkit.distributed.allocator)
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}
DEFAULT_WEIGHT_DECAY = {"sgd": 0.0, "adam": 0.0, "adamw": 0.01}  # torch's own defaults for each optimizer
SLOWMO_BASES = ("localsgd", "sgp")
STRATEGY_NAMES = (*STRATEGIES, "sgp")  # what --strategy and bench's --strategies take: sgp is slowmo gossiping
# how pseudo-gradients travel between SlowMo nodes (ddpkit.algorithms.quantize.COMPRESSIONS, without torch here)
SLOWMO_COMPRESSIONS = ("none", "bf16", "int8", "int4")
# the gossip graphs of --slowmo-base sgp (ddpkit.algorithms.gossip_graphs.GRAPHS, without importing torch here)
SGP_GRAPHS = ("npeer-exponential", "exponential", "bipartite-exponential", "linear", "bipartite-linear", "ring")
FLAG_NAMES = {"nprocs_per_node_slowmo": "slowmo-nprocs-per-node"}  # fields whose flag is not the field's name


@dataclass
class TrainConfig:
    """One training run. Field names are the CLI flags with dashes turned into underscores."""

    # what to train
    strategy: str = "sharded"
    optimizer: str = "adam"
    lr: float | None = None  # None: 0.05 for sgd, 1e-3 for adam/adamw
    momentum: float = 0.9  # sgd only
    weight_decay: float | None = None  # None: 0.01 for adamw (torch's default), 0 for sgd and adam
    adascale: bool = False
    shared_parameters: bool = False  # oss / sharded on one machine: parameters held once per machine
    amp: str = "off"
    grad_accum: int = 1
    epochs: int = 5
    batch_size: int = 32
    seed: int = 0
    data: str = "digits"
    data_dir: str | None = None
    synthetic_samples: int = 4096
    synthetic_features: int = 64
    synthetic_classes: int = 10
    model: str = "mlp"
    hidden: int = 256
    depth: int = 2
    loss: str | None = None  # cross_entropy | mse; None: the model factory's loss, else cross_entropy
    max_steps: int | None = None  # stop after this many optimizer steps, whatever --epochs says
    # --model gpt (ddpkit.train.workloads.gpt) and --data text (ddpkit.train.workloads.text)
    gpt_layers: int = 6
    gpt_width: int = 384
    gpt_heads: int = 6
    context: int = 128  # bytes per window of --data text, and the GPT's context
    # SlowMo
    slowmo_momentum: float = 0.5
    slowmo_lr: float = 1.0
    slowmo_frequency: int = 48
    localsgd_frequency: int = 3
    nprocs_per_node_slowmo: int | None = None  # SlowMo's "node" size; None: --nproc-per-node across machines, else 1
    slowmo_base: str = "localsgd"  # between slow steps: localsgd (averaging) or sgp (gossip)
    graph: str = "npeer-exponential"  # sgp only
    peers_per_itr: int = 1  # sgp only
    push_sum: bool = True  # sgp only; False: PushPull
    overlap: bool = False  # sgp only
    synch_freq: int = 0  # sgp with overlap only
    slowmo_sgp_average_params: bool = False  # sgp only
    slowmo_nesterov: bool = False  # the outer step is Nesterov's (DiLoCo)
    # over slow links (localsgd only): pseudo-gradients, quantised, in fragments, overlapped
    slowmo_compression: str = "none"
    slowmo_compression_block: int = 64
    slowmo_error_feedback: bool = False
    slowmo_fragments: int = 1
    slowmo_sync_delay: int = 0
    slowmo_merge_alpha: float = 0.5
    # where it runs
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port on one machine, 29500 across machines
    backend: str = "auto"
    device: str = "auto"  # auto: CUDA with NCCL, else CPU; "cuda" with gloo puts the model on GPUs too
    timeout: float = 60.0
    allocator: str = "auto"  # mapped: blocks of 8 MiB or more mapped alone, in huge pages; auto: so for sharded
    # keeping on through lost ranks (ddpkit.train.loop.fault_tolerant_run)
    fault_tolerant: bool = False
    min_replicas: int = 1
    quorum_timeout: float = 5.0
    store: str | None = None  # etcd://HOST:PORT[,...][/JOB]: the job's coordination in etcd (None: node 0 hosts it)
    job_id: str | None = None  # the job's name in its store: a rank of another job is refused (None: unnamed)
    # outputs
    out: str | None = None
    resume: bool = False
    progress: bool = True
    keep: int = 2  # checkpoints kept (the newest)
    checkpoints: bool = True  # False (--no-checkpoints): --out gets the metrics only
    checkpoint_every: int | None = None  # also checkpoint every N optimizer steps (besides every epoch)
    eval_every: int | None = None  # held-out evaluation every N optimizer steps and at each epoch's end; None:
    # about 15 per run (ddpkit.train.loop.job.default_eval_every); 0: at epoch ends only
    debug: bool = False  # tracebacks and torch's C++ stack traces (as DDPKIT_DEBUG=1)

    @property
    def maps_large_blocks(self) -> bool:
        """Whether the ranks map large blocks alone: --allocator mapped, or auto with --strategy sharded (the
        strategy that frees the gradients it does not own every step; ddpkit.distributed.allocator says why)."""
        return self.allocator == "mapped" or (self.allocator == "auto" and self.strategy == "sharded")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    @property
    def resolved_weight_decay(self) -> float:
        return self.weight_decay if self.weight_decay is not None else DEFAULT_WEIGHT_DECAY[self.optimizer]


def flag(name: str) -> str:
    """The command-line flag of TrainConfig field `name` (``batch_size`` -> ``--batch-size``)."""
    return "--" + FLAG_NAMES.get(name, name.replace("_", "-"))


def field_types() -> dict[str, tuple[tuple[type, ...], bool]]:
    """Per TrainConfig field: the types its value may have and whether it may be None."""
    out = {}
    for name, hint in typing.get_type_hints(TrainConfig).items():
        args = typing.get_args(hint) or (hint,)
        out[name] = (tuple(a for a in args if a is not type(None)), type(None) in args)
    return out


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def checked_type(name: str, value: Any, where: str) -> Any:
    """`value` for field `name` when its type is right (an integer is taken for a float), else a TypeError naming
    `where` (the flag or the TOML key). Nothing else is converted: "0.1" is not a number, 1 is not true."""
    types, optional = field_types()[name]
    if value is None and optional:
        return value
    expected = types[0]
    if expected is float and type(value) is int:
        return float(value)
    if type(value) is expected:
        return value
    kind = _KINDS.get(expected, expected.__name__) + (" (or absent)" if optional else "")
    raise TypeError(f"{where} must be {kind}; got {value!r} ({type(value).__name__})")


def load_toml(path: str) -> dict[str, Any]:
    """Reads a TOML config (flat keys named like the flags, dashes or underscores) into TrainConfig fields."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path!r}: no such file")
    with open(path, "rb") as f:
        try:
            raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    by_flag = {name: name for name in known} | {flag(name)[2:].replace("-", "_"): name for name in known}
    values = {}
    for key, value in raw.items():
        name = by_flag.get(key.replace("-", "_"))
        if name is None:
            raise ValueError(f"--config {path}: unknown setting {key!r}")
        values[name] = checked_type(name, value, f"--config {path}, setting {key!r}: {flag(name)}")
    return values


def expand_strategy(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (settings by field name) with ``strategy="sgp"``, the name `ddpkit bench` gives it, spelled out as
    ``strategy="slowmo", slowmo_base="sgp"``; a ValueError if another `slowmo_base` was asked for with it."""
    if values.get("strategy") != "sgp":
        return values
    if values.get("slowmo_base", "sgp") != "sgp":
        raise ValueError(f"--strategy sgp is slowmo with --slowmo-base sgp; got --slowmo-base {values['slowmo_base']}")
    return {**values, "strategy": "slowmo", "slowmo_base": "sgp"}


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{flag(name)} must be one of {', '.join(allowed)}; got {value!r}")


def check_int(name: str, value: Any, low: int) -> None:
    if type(value) is not int or value < low:
        raise ValueError(f"{flag(name)} must be an integer >= {low}; got {value!r}")


def check_number(name: str, value: float, low: float, high: float = math.inf, *, open_low: bool = False) -> None:
    """A finite number in [low, high) (or (low, high) with `open_low`); NaN and infinities are errors."""
    if not math.isfinite(value) or value < low or (open_low and value == low) or value >= high:
        bounds = f"{'>' if open_low else '>='} {low:g}" + (f" and < {high:g}" if math.isfinite(high) else "")
        raise ValueError(f"{flag(name)} must be a finite number {bounds}; got {value!r}")


INT_MINIMA = {"grad_accum": 1, "epochs": 1, "batch_size": 1, "nproc_per_node": 1, "nnodes": 1, "hidden": 1}
INT_MINIMA |= {"depth": 1, "slowmo_frequency": 1, "localsgd_frequency": 1, "synthetic_samples": 1}
INT_MINIMA |= {"synthetic_features": 1, "synthetic_classes": 2, "node_rank": 0, "seed": 0}
INT_MINIMA |= {"gpt_layers": 1, "gpt_width": 1, "gpt_heads": 1, "context": 1, "keep": 1}
INT_MINIMA |= {"peers_per_itr": 1, "synch_freq": 0}
INT_MINIMA |= {"slowmo_compression_block": 1, "slowmo_fragments": 1, "slowmo_sync_delay": 0, "min_replicas": 1}
# (low, high, open_low): every float setting, checked finite
FLOAT_RANGES = {"lr": (0.0, math.inf, True), "momentum": (0.0, 1.0, False), "weight_decay": (0.0, math.inf, False)}
FLOAT_RANGES |= {"timeout": (0.0, math.inf, True), "slowmo_momentum": (0.0, 1.0, False)}
FLOAT_RANGES |= {"quorum_timeout": (0.0, math.inf, True)}
FLOAT_RANGES |= {"slowmo_lr": (0.0, math.inf, True), "slowmo_merge_alpha": (0.0, math.inf, False)}  # and <= 1


def _check_types(cfg: TrainConfig) -> None:
    for field in dataclasses.fields(cfg):
        setattr(cfg, field.name, checked_type(field.name, getattr(cfg, field.name), flag(field.name)))


def validate(cfg: TrainConfig) -> None:
    """Raises a ValueError, TypeError or FileNotFoundError that names the flag, before any process starts."""
    _check_types(cfg)
    for name, allowed in (
        ("strategy", STRATEGIES),
        ("optimizer", OPTIMIZERS),
        ("amp", AMP_MODES),
        ("backend", BACKENDS),
        ("device", DEVICES),
        ("allocator", ALLOCATORS),
        ("slowmo_base", SLOWMO_BASES),
        ("graph", SGP_GRAPHS),
        ("slowmo_compression", SLOWMO_COMPRESSIONS),
    ):
        _choice(name, getattr(cfg, name), allowed)
    for name, low in INT_MINIMA.items():
        check_int(name, getattr(cfg, name), low)
    if cfg.seed >= 2**63:
        raise ValueError(f"--seed must be below 2**63; got {cfg.seed}")
    for name, (low, high, open_low) in FLOAT_RANGES.items():
        if getattr(cfg, name) is not None:
            check_number(name, getattr(cfg, name), low, high, open_low=open_low)
    for name in ("max_steps", "checkpoint_every", "nprocs_per_node_slowmo"):  # optional integers
        if getattr(cfg, name) is not None:
            check_int(name, getattr(cfg, name), 1)
    if cfg.eval_every is not None:
        check_int("eval_every", cfg.eval_every, 0)
    registry.check_workload_flags(cfg)
    # factories are called (torch imported) only once the flags are sound
    if registry.is_spec(cfg.model) or registry.is_spec(cfg.data):
        from ddpkit.train.workloads.workload import check_factories

        check_factories(cfg)
    if cfg.node_rank >= cfg.nnodes:
        raise ValueError(f"--node-rank {cfg.node_rank} must be smaller than --nnodes {cfg.nnodes}")
    if cfg.master_port is not None and not 0 < cfg.master_port < 65536:
        raise ValueError(f"--master-port must be in 1..65535; got {cfg.master_port}")
    _validate_combinations(cfg)
    _validate_device(cfg)
    _check_backend(cfg)
    if cfg.out:
        check_writable_folder(cfg.out)


def _check_backend(cfg: TrainConfig) -> None:
    """--backend nccl needs one visible GPU per local process (auto picks gloo where there are fewer)."""
    if cfg.backend != "nccl":
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "--backend nccl needs CUDA GPUs, and torch sees none on this machine (torch.cuda.is_available() "
            "is False); use --backend gloo or auto"
        )
    gpus = torch.cuda.device_count()
    if gpus < cfg.nproc_per_node:
        raise ValueError(
            f"--backend nccl gives each local process a GPU of its own: {cfg.nproc_per_node} local processes need "
            f"{cfg.nproc_per_node} GPUs and {gpus} are visible; use --nproc-per-node {gpus} or --backend gloo"
        )


def check_writable_folder(path: str) -> None:
    """Raises a ValueError naming `path` (--out) unless it is a folder this process can create files in, or can
    be created: a file of the same name, or a read-only or missing-permission ancestor, fail before training."""
    existing = os.path.abspath(path)
    while not os.path.isdir(existing):
        if os.path.exists(existing) or os.path.islink(existing):
            what = "is a file" if existing == os.path.abspath(path) else f"is inside {existing!r}, a file"
            raise ValueError(f"--out {path!r} {what}, not a folder")
        existing = os.path.dirname(existing)
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".ddpkit-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = "" if existing == os.path.abspath(path) else f" (its folder {existing!r} exists)"
        raise ValueError(f"--out {path!r} cannot be written{where}: {exc.strerror or exc}") from None


def _validate_device(cfg: TrainConfig) -> None:
    if cfg.backend == "nccl" and cfg.device == "cpu":
        raise ValueError("--device cpu needs --backend gloo (NCCL communicates CUDA tensors only)")
    if cfg.device == "cuda":  # (--backend nccl without CUDA is refused by _check_backend)
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda needs CUDA, which this machine's PyTorch does not see; use --device cpu")


def _validate_combinations(cfg: TrainConfig) -> None:
    if cfg.shared_parameters and cfg.strategy not in ("oss", "sharded"):
        raise ValueError(f"--shared-parameters is an option of OSS: use --strategy oss or sharded (got {cfg.strategy})")
    if cfg.shared_parameters and (cfg.device == "cuda" or cfg.backend == "nccl"):
        raise ValueError(
            "--shared-parameters shares the parameters' CPU pages: it cannot act on GPUs (--device cuda "
            "or --backend nccl)"
        )
    if cfg.shared_parameters and os.environ.get("DDPKIT_SHARED_MEMORY", "1").strip() == "0":
        raise ValueError("--shared-parameters needs shared memory, which DDPKIT_SHARED_MEMORY=0 turns off")
    if cfg.shared_parameters and cfg.nnodes > 1 and not cfg.fault_tolerant:
        raise ValueError(
            "--shared-parameters shares memory between the processes of one machine: it needs --nnodes 1 (or "
            "--fault-tolerant, where each machine shards alone)"
        )
    if cfg.adascale and cfg.optimizer != "sgd":
        raise ValueError(f"--adascale scales SGD's learning rate: use --optimizer sgd (got {cfg.optimizer})")
    if cfg.adascale and cfg.strategy == "slowmo":
        raise ValueError("--adascale needs gradients averaged every step; it does not combine with --strategy slowmo")
    if cfg.adascale and cfg.amp == "fp16":
        raise ValueError("--adascale measures unscaled gradients: it does not combine with --amp fp16 (use bf16)")
    if cfg.adascale and cfg.world_size * cfg.grad_accum < 2:
        raise ValueError("--adascale needs at least two gradients per step: use 2+ processes or --grad-accum >= 2")
    if cfg.data == "mnist":
        if not cfg.data_dir:
            raise ValueError("--data mnist needs --data-dir PATH holding the four MNIST IDX files")
        from ddpkit.train.workloads.data import mnist_paths

        mnist_paths(cfg.data_dir)
    elif cfg.data_dir:
        raise ValueError(f"--data-dir is only read with --data mnist (got --data {cfg.data})")
    if cfg.data == "text" and cfg.context > HELDOUT_TEXT_BYTES:
        raise ValueError(
            f"--context {cfg.context} is longer than --data text's held-out text ({HELDOUT_TEXT_BYTES} bytes, at least "
            "one window is needed): use a --context of at most that"
        )
    if (
        cfg.model == "cnn"
        and cfg.data == "synthetic"
        and round(cfg.synthetic_features**0.5) ** 2 != cfg.synthetic_features
    ):
        raise ValueError("--model cnn on synthetic data needs a square --synthetic-features (e.g. 64 for 8x8)")
    if cfg.strategy == "slowmo":
        node = cfg.nprocs_per_node_slowmo or 1
        if cfg.world_size % node:
            raise ValueError(f"--slowmo-nprocs-per-node {node} must divide the world size {cfg.world_size}")
        _check_sgp(cfg, cfg.world_size // node)
        _check_slow_links(cfg)
    elif cfg.slowmo_base != "localsgd":
        raise ValueError(f"--slowmo-base {cfg.slowmo_base} needs --strategy slowmo (got {cfg.strategy})")
    else:
        changed = [flag(n) for n in (*SLOW_LINK_FLAGS, *SGP_FLAGS) if getattr(cfg, n) != getattr(TrainConfig, n)]
        if changed:
            verb = "needs" if len(changed) == 1 else "need"
            raise ValueError(f"{', '.join(changed)} {verb} --strategy slowmo (got {cfg.strategy})")
    if cfg.fault_tolerant:
        _check_fault_tolerant(cfg)
    elif (cfg.min_replicas, cfg.quorum_timeout) != (TrainConfig.min_replicas, TrainConfig.quorum_timeout):
        raise ValueError("--min-replicas and --quorum-timeout need --fault-tolerant")
    elif cfg.store is not None:
        raise ValueError("--store keeps a fault-tolerant job's coordination in etcd: it needs --fault-tolerant")
    elif cfg.job_id is not None:
        raise ValueError("--job-id names a fault-tolerant job in its store: it needs --fault-tolerant")
    if cfg.resume and not cfg.out:
        raise ValueError("--resume needs --out DIR (where the checkpoint was written)")
    if not cfg.checkpoints and (cfg.resume or cfg.checkpoint_every is not None):
        raise ValueError("--no-checkpoints cannot be combined with --resume or --checkpoint-every")
    if cfg.resume:
        _check_resumable(cfg)


def sharded_replicas(cfg: TrainConfig) -> bool:
    """Whether a fault-tolerant job's replicas are machines whose processes shard the optimizer state (--strategy
    oss / sharded: `ddpkit.fault_tolerance.replica_membership`) rather than single processes."""
    return cfg.fault_tolerant and cfg.strategy in ("oss", "sharded")


JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_job_id(job_id: object) -> None:
    """--job-id: 1-64 letters, digits, dots, dashes and underscores, starting with a letter or digit."""
    if not isinstance(job_id, str) or JOB_ID.fullmatch(job_id) is None:
        raise ValueError(
            f"--job-id must be 1-64 letters, digits, '.', '-' or '_', starting with a letter or digit; got {job_id!r}"
        )


def _check_fault_tolerant(cfg: TrainConfig) -> None:
    """What --fault-tolerant supports today (ddpkit.train.loop.fault_tolerant_sync), refused by flag otherwise."""
    sharded = sharded_replicas(cfg)
    if cfg.job_id is not None:
        check_job_id(cfg.job_id)
    if cfg.store is not None:
        from ddpkit.fault_tolerance.etcd_store import parse_url  # (torch only when asked for)

        parse_url(cfg.store)  # a ValueError naming what is wrong, before any process starts
    replicas = cfg.nnodes if sharded else cfg.world_size
    if not 1 <= cfg.min_replicas <= replicas:
        what = (
            f"the machines (--nnodes {cfg.nnodes}): with --strategy {cfg.strategy} a machine is a replica"
            if sharded
            else f"the world size {cfg.world_size}"
        )
        raise ValueError(f"--min-replicas must be in [1, {replicas}] ({what}); got {cfg.min_replicas}")
    unsupported = {  # flag -> (given, why it is refused under --fault-tolerant)
        "--no-push-sum": (not cfg.push_sum, "PushPull keeps every weight at one, which a change of members breaks"),
        "--overlap": (cfg.overlap, "an overlapped gossip round runs beside the next step, whose members may differ"),
        "--slowmo-sync-delay": (
            cfg.slowmo_sync_delay > 0,
            "a delayed sync travels over the next steps, across the next rounds, whose members may differ: a rank "
            "lost or joined meanwhile would leave a mean over members that no longer hold the same state "
            "(--slowmo-compression and --slowmo-fragments work)",
        ),
        "--slowmo-nprocs-per-node > 1": (
            (cfg.nprocs_per_node_slowmo or 1) > 1,
            "a node group of several processes is one group for the job, which a lost process breaks (not yet)",
        ),
        "--checkpoint-every / --resume with --strategy oss or sharded": (
            sharded and (cfg.checkpoint_every is not None or cfg.resume),
            "each process of a replica holds its own shard of the optimizer state; checkpoints of a sharded "
            "fault-tolerant job are not written yet",
        ),
        "--amp fp16 with --strategy oss or sharded": (
            sharded and cfg.amp == "fp16",
            "the loss scaler of a sharded replica is not built under --fault-tolerant yet (bf16 works)",
        ),
        "--adascale": (cfg.adascale, "its gain is measured over a fixed set of ranks; a round's members change"),
        "--device cuda / --backend nccl": (
            cfg.device == "cuda" or cfg.backend == "nccl",
            "each round's group is a gloo group made for its members; NCCL groups per round are not built yet",
        ),
    }
    given = [f"{name} ({why})" for name, (on, why) in unsupported.items() if on]
    if given:
        raise ValueError(f"--fault-tolerant does not combine with {'; '.join(given)}")


HELDOUT_TEXT_BYTES = (
    65536  # ddpkit.train.workloads.text.DEFAULT_HELDOUT_BYTES (not imported: that module imports torch)
)

SGP_FLAGS = ("graph", "peers_per_itr", "push_sum", "overlap", "synch_freq", "slowmo_sgp_average_params")


def _check_sgp(cfg: TrainConfig, nodes: int) -> None:
    """SGP's own flags need SGP (they would be silently ignored); the gossip graph must serve this many nodes with
    --peers-per-itr (bipartite graphs need an even count)."""
    if cfg.slowmo_base != "sgp":
        changed = [flag(n) for n in SGP_FLAGS if getattr(cfg, n) != getattr(TrainConfig, n)]
        if changed:
            raise ValueError(f"{', '.join(changed)} only act with --slowmo-base sgp (got {cfg.slowmo_base})")
    if cfg.slowmo_base != "sgp" or nodes < 2:
        return
    from ddpkit.algorithms.gossip_graphs import GRAPHS

    try:
        GRAPHS[cfg.graph](0, nodes, peers_per_itr=cfg.peers_per_itr)
    except ValueError as exc:
        raise ValueError(
            f"--graph {cfg.graph} with --peers-per-itr {cfg.peers_per_itr} on {nodes} nodes: {exc}"
        ) from None


SLOW_LINK_FLAGS = ("slowmo_compression", "slowmo_compression_block", "slowmo_error_feedback", "slowmo_fragments")
SLOW_LINK_FLAGS += ("slowmo_sync_delay", "slowmo_merge_alpha")


def _check_slow_links(cfg: TrainConfig) -> None:
    """What SlowMoDistributedDataParallel would refuse of the slow-link flags, named by flag."""
    active = cfg.slowmo_compression != "none" or cfg.slowmo_fragments > 1 or cfg.slowmo_sync_delay > 0
    if active and cfg.slowmo_base != "localsgd":
        raise ValueError("--slowmo-compression, --slowmo-fragments and --slowmo-sync-delay need --slowmo-base localsgd")
    if cfg.slowmo_compression == "int4" and cfg.slowmo_compression_block % 2:
        raise ValueError(
            f"--slowmo-compression int4 needs an even --slowmo-compression-block; got {cfg.slowmo_compression_block}"
        )
    if cfg.slowmo_fragments > cfg.localsgd_frequency:
        raise ValueError(
            f"--slowmo-fragments {cfg.slowmo_fragments} must be at most --localsgd-frequency {cfg.localsgd_frequency} "
            "(one fragment per step of a period)"
        )
    if cfg.slowmo_sync_delay >= cfg.localsgd_frequency:
        raise ValueError(
            f"--slowmo-sync-delay {cfg.slowmo_sync_delay} must be smaller than --localsgd-frequency "
            f"{cfg.localsgd_frequency} (a fragment's sync is merged before its next one starts)"
        )
    if cfg.slowmo_merge_alpha > 1.0:
        raise ValueError(f"--slowmo-merge-alpha must be a number in [0, 1]; got {cfg.slowmo_merge_alpha!r}")
    if cfg.slowmo_merge_alpha != TrainConfig.slowmo_merge_alpha and not cfg.slowmo_sync_delay:
        raise ValueError("--slowmo-merge-alpha weights a delayed merge: it needs --slowmo-sync-delay > 0")
    slowmo_on = cfg.slowmo_momentum != 0 or cfg.slowmo_lr != 1
    if cfg.slowmo_sync_delay and slowmo_on and cfg.slowmo_frequency % cfg.localsgd_frequency:
        raise ValueError(
            f"--slowmo-sync-delay needs --slowmo-frequency ({cfg.slowmo_frequency}) to be a multiple of "
            f"--localsgd-frequency ({cfg.localsgd_frequency})"
        )


def _check_resumable(cfg: TrainConfig) -> None:
    if cfg.node_rank != 0:
        return  # only rank 0's machine holds the shared part of the checkpoint
    from ddpkit.train.checkpoints import checkpoint_files

    if not checkpoint_files.committed(cfg.out or ""):
        raise FileNotFoundError(
            f"--resume: no complete checkpoint in {checkpoint_files.checkpoint_root(cfg.out or '')}"
        )
    _, manifest, _, _ = checkpoint_files.newest_intact(cfg.out or "")  # markers only: files are checked at load
    checkpoint_files.resume_notes(manifest, checkpoint_files.resume_settings(cfg))  # raises if it cannot continue
