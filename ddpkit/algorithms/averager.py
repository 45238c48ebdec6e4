"""How the nodes of a SlowMo job average: one small protocol, its implementations registered by name.

SlowMoDistributedDataParallel is node-level DDP (gradients averaged inside each node every backward) plus one
`NodeAverager` (how nodes agree between their local steps) plus the slow-momentum rule. The averager decides
when it has work (`due`), does it on the flat fp32 parameters after the base optimizer's step (`step`), averages
exactly on demand (`average_now`), and keeps its own state for checkpoints (`state`, `load`). Built in:

- ``"exact"`` (`ddpkit.algorithms.exact`): local SGD, an exact all-reduce of the parameters every
  `localsgd_frequency` steps (the paper's SlowMo);
- ``"gossip"`` (`ddpkit.algorithms.gossip`): SGP, push-sum gossip among node masters every step;
- ``"pseudo_gradient"`` (`ddpkit.algorithms.pseudo_gradient`): DiLoCo's and Streaming DiLoCo's compressed,
  fragmented, delayed syncs of pseudo-gradients.

A new mode is one new module that defines a class of this protocol and decorates it with `register_averager`;
``SlowMoDistributedDataParallel(..., averager="its name")`` then uses it, with no edit of the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from ddpkit.algorithms.pseudo_gradient_settings import OuterSyncSettings
from ddpkit.algorithms.slow_momentum import SlowBuffers, SlowMoRule
from ddpkit.distributed.env import ProcessGroup
from ddpkit.distributed.groups import NodeGroups


@dataclass(frozen=True)
class AveragingOptions:
    """What SlowMoDistributedDataParallel's arguments say about averaging between nodes, checked by the chosen
    averager's `prepare` before any collective.

    Attributes:
        rank: this process's rank.
        world_size: the number of ranks.
        nprocs_per_node: processes per node.
        localsgd_frequency: steps between exact averages.
        slowmo_frequency: steps between slow steps (None: slow momentum off).
        numel: the parameters' element count.
        sgp: whether the SGP base algorithm was asked for.
        sgp_args: SGP's graph, mixing, push_sum, overlap and synch_freq as given.
        sgp_flags: SGP's switches by name (use_streams, slowmo_sgp_average_params).
        outer: the pseudo-gradient sync's settings (compression, fragments, delay).
    """

    rank: int
    world_size: int
    nprocs_per_node: int
    localsgd_frequency: int
    slowmo_frequency: int | None
    numel: int
    sgp: bool  # the SGP base algorithm was asked for
    sgp_args: dict[str, Any] = field(default_factory=dict)  # graph, mixing, push_sum, overlap, synch_freq
    sgp_flags: dict[str, Any] = field(default_factory=dict)  # use_streams, slowmo_sgp_average_params
    outer: OuterSyncSettings = field(default_factory=OuterSyncSettings)

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """(this rank's node, the number of nodes, nprocs_per_node, its rank inside the node)."""
        node, local_rank = divmod(self.rank, self.nprocs_per_node)
        return node, self.world_size // self.nprocs_per_node, self.nprocs_per_node, local_rank


@dataclass
class SlowPhase:
    """Slow momentum as an averager applies it.

    Attributes:
        rule: the slow step (`SlowMoRule`).
        buffers: x0 and u (None: slow momentum off).
        frequency: steps between slow steps (None: off).
    """

    rule: SlowMoRule
    buffers: SlowBuffers | None
    frequency: int | None

    def due(self, step: int) -> bool:
        """Whether step `step` is a slow step."""
        return self.buffers is not None and self.frequency is not None and step % self.frequency == 0


@dataclass
class AveragingContext:
    """What an averager is built from.

    Attributes:
        flat: the flat fp32 parameters at the start.
        sizes: the element counts of the tensors they hold, in order.
        groups: the node groups (`NodeGroups`).
        slow: the slow phase.
        options: the averaging options.
        plan: what the averager's `prepare` returned.
    """

    flat: torch.Tensor
    sizes: list[int]
    groups: NodeGroups
    slow: SlowPhase
    options: AveragingOptions
    plan: Any = None

    @property
    def world(self) -> ProcessGroup:
        return self.groups.world


class NodeAverager(Protocol):
    """How nodes average between local steps (module doc). Every method but `state`/`load` may be a collective
    and is called on every rank alike."""

    name: ClassVar[str]
    shards_slow_buffers: ClassVar[bool]  # whether slowmo_memory_efficient may split x0, u over ranks

    @classmethod
    def prepare(cls, options: AveragingOptions) -> tuple[dict[str, Any], Any]:
        """Checks the options (before any collective); returns the settings every rank must share and a plan."""
        ...

    def due(self, step: int) -> bool:
        """Whether `step` (1-based count of optimizer steps) has work; otherwise `step` is not called."""
        ...

    def step(self, flat: torch.Tensor, step: int, lr: float) -> None:
        """After the base optimizer's step `step`: updates the flat parameters `flat` in place."""
        ...

    def average_now(self, flat: torch.Tensor) -> None:
        """Makes `flat` the exact average over nodes now (work in flight merged first)."""
        ...

    def state(self) -> dict[str, Any]:
        """This rank's state for a checkpoint (flat keys, prefixed by the mode); not a collective."""
        ...

    def load(self, state: dict[str, Any]) -> None:
        """Restores `state()`'s output, saved by the same rank of a job of the same shape and settings."""
        ...


AveragerType = type[NodeAverager]
_REGISTRY: dict[str, AveragerType] = {}
T = TypeVar("T")


def register_averager(name: str) -> Callable[[T], T]:
    """Class decorator: makes the averager available to SlowMo as ``averager=name``.

    Args:
        name: the name `averager=` takes.
    """

    def add(cls: T) -> T:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"register_averager: the name {name!r} is taken by {_REGISTRY[name].__qualname__}")
        cls.name = name  # type: ignore[attr-defined]
        _REGISTRY[name] = cls  # type: ignore[assignment]
        return cls

    return add


def registered_averagers() -> list[str]:
    """The names `averager=` accepts."""
    return sorted(_REGISTRY)


def default_averager(options: AveragingOptions) -> str:
    """The mode SlowMo's fairscale arguments ask for: gossip with SGP, pseudo-gradients with compression,
    fragments or a delay, else the exact average."""
    if options.sgp:
        return "gossip"
    return "pseudo_gradient" if options.outer.active else "exact"


def averager_class(choice: str | AveragerType | None, options: AveragingOptions) -> AveragerType:
    """The averager class for SlowMo's `averager` argument (None: `default_averager`). A named mode that the
    other arguments contradict (SGP, or compression for another mode than the one they select) is refused.

    Args:
        choice: a registered name, a registered class, or None.
        options: what SlowMo's other arguments say (`AveragingOptions`).
    """
    implied = default_averager(options)
    if choice is None:
        choice = implied
    if isinstance(choice, str):
        if choice not in _REGISTRY:
            raise ValueError(
                f"SlowMoDistributedDataParallel: averager must be one of {', '.join(registered_averagers())} or a "
                f"class registered with ddpkit.algorithms.register_averager, got {choice!r}"
            )
        return _check_implied(_REGISTRY[choice], implied)
    if isinstance(choice, type) and getattr(choice, "name", None) in _REGISTRY:
        return _check_implied(choice, implied)
    raise TypeError(
        f"SlowMoDistributedDataParallel: averager must be a registered name or class, got {choice!r}; decorate the "
        "class with ddpkit.algorithms.register_averager"
    )


def _check_implied(kind: AveragerType, implied: str) -> AveragerType:
    if implied != "exact" and kind.name != implied:
        raise ValueError(
            f"SlowMoDistributedDataParallel: averager={kind.name!r} contradicts the other arguments, which select "
            f"{implied!r} (the SGP base algorithm, or slowmo_compression, slowmo_fragments or slowmo_sync_delay); "
            "drop one of them"
        )
    return kind
