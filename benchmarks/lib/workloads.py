"""The workloads the benchmarks train: a model, each rank's batches and the loss, built the same on every rank.

A workload is plain data (picklable), so a benchmark can hand it to spawned ranks, and is built again inside each
rank from its fields. Add one by writing a class with ``describe``, ``model``, ``batches`` and ``loss`` and
registering a factory in `WORKLOADS`; ``"gpt"`` is ddpkit's byte-level GPT on the standard library's source.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


class Workload(Protocol):
    name: str

    def describe(self) -> str: ...

    def model(self, seed: int) -> nn.Module: ...

    def batches(self, seed: int, rank: int, count: int, batch: int) -> list[Batch]: ...

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...


def mlp(dims: tuple[int, ...], seed: int) -> nn.Module:
    """Linear layers of widths `dims` with ReLU between, initialised from `seed` (the same on every rank)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def parameter_count(dims: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in itertools.pairwise(dims))


@dataclass(frozen=True)
class Regression:
    """An MLP fitted to Gaussian targets by mean squared error: pure compute and traffic, nothing to learn."""

    dims: tuple[int, ...] = (1024, 2048, 2048, 1024)
    name: str = "mlp"

    def describe(self) -> str:
        widths = "->".join(map(str, self.dims))
        return f"MLP {widths} ({parameter_count(self.dims):,} parameters), MSE on Gaussian data"

    def model(self, seed: int) -> nn.Module:
        return mlp(self.dims, seed)

    def batches(self, seed: int, rank: int, count: int, batch: int) -> list[Batch]:
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        return [
            (torch.randn(batch, self.dims[0], generator=g), torch.randn(batch, self.dims[-1], generator=g))
            for _ in range(count)
        ]

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)


@dataclass(frozen=True)
class Teacher:
    """An MLP classifier of Gaussian inputs labelled by a fixed random tanh network (10 classes): learnable, and
    every batch is fresh, so nothing can be memorised. ``held_out`` draws from a separate stream."""

    dims: tuple[int, ...] = (256, 1024, 1024, 1024, 10)
    teacher_width: int = 128
    name: str = "teacher"

    def describe(self) -> str:
        widths = "->".join(map(str, self.dims))
        return f"MLP {widths} ({parameter_count(self.dims):,} parameters), random-teacher classes"

    def model(self, seed: int) -> nn.Module:
        return mlp(self.dims, seed)

    def _teacher(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10_000 + seed)
        w1 = torch.randn(self.dims[0], self.teacher_width, generator=g) / self.dims[0] ** 0.5
        w2 = torch.randn(self.teacher_width, self.dims[-1], generator=g) / self.teacher_width**0.5
        return w1, w2

    def sample(self, seed: int, n: int, g: torch.Generator) -> Batch:
        w1, w2 = self._teacher(seed)
        x = torch.randn(n, self.dims[0], generator=g)
        return x, (torch.tanh(x @ w1) @ w2).argmax(dim=1)

    def batches(self, seed: int, rank: int, count: int, batch: int) -> list[Batch]:
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        return [self.sample(seed, batch, g) for _ in range(count)]

    def held_out(self, seed: int, n: int) -> Batch:
        return self.sample(seed, n, torch.Generator().manual_seed(999))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)


@lru_cache(maxsize=1)
def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y) of scikit-learn's bundled digits, pixels in [0, 1], split 80/20
    (stratified, fixed): nothing is downloaded."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, stratify=y, random_state=0)

    def as_x(a: object) -> torch.Tensor:
        return torch.tensor(a, dtype=torch.float32)

    def as_y(a: object) -> torch.Tensor:
        return torch.tensor(a, dtype=torch.long)

    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


HELD_OUT_WINDOWS = 128


@lru_cache(maxsize=2)
def _stdlib_text(context: int) -> tuple[Any, Any]:
    from ddpkit.train.workloads.text import text

    return text(context)


@dataclass(frozen=True)
class GPTText:
    """ddpkit's byte-level GPT (`ddpkit.train.workloads.gpt`) on windows of the standard library's source
    (`ddpkit.train.workloads.text`): each rank draws its windows at random from the training files with its own seed;
    ``held_out`` is the first `n` windows of the held-out set (spread evenly over the held-out files)."""

    layers: int = 6
    width: int = 384
    heads: int = 6
    context: int = 128
    name: str = "gpt"

    def _config(self) -> Any:
        from ddpkit.train.workloads.gpt import GPTConfig

        return GPTConfig(self.layers, self.width, self.heads, self.context)

    def describe(self) -> str:
        from ddpkit.train.workloads.gpt import parameter_count

        shape = f"{self.layers} layers x {self.width}, {self.heads} heads, context {self.context}"
        return f"byte GPT ({shape}; {parameter_count(self._config()):,} parameters) on stdlib source"

    def model(self, seed: int) -> nn.Module:
        from ddpkit.train.workloads.gpt import gpt

        torch.manual_seed(seed)
        return gpt(self._config())

    def batches(self, seed: int, rank: int, count: int, batch: int) -> list[Batch]:
        train, _ = _stdlib_text(self.context)
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        picks = torch.randint(0, len(train), (count, batch), generator=g)
        return [_stack([train[int(i)] for i in row]) for row in picks]

    def held_out(self, seed: int, n: int) -> Batch:
        """At most `HELD_OUT_WINDOWS` windows (16 KB at context 128): a GPT's forward pass is costly on a CPU."""
        _, held = _stdlib_text(self.context)
        return _stack([held[i] for i in range(min(n, len(held), HELD_OUT_WINDOWS))])

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, -2), target.flatten())


def _stack(items: list[Batch]) -> Batch:
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


WORKLOADS: dict[str, Callable[[bool], Workload]] = {
    "mlp": lambda quick: Regression((64, 128, 128, 64)) if quick else Regression(),
    "teacher": lambda quick: Teacher((32, 64, 64, 10), teacher_width=16) if quick else Teacher(),
    "gpt": lambda quick: GPTText(1, 32, 2, 32) if quick else GPTText(),
}


def workload(name: str, quick: bool = False) -> Workload:
    """The workload called `name`, at smoke size when `quick`."""
    if name not in WORKLOADS:
        raise ValueError(f"workload: unknown {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](quick)
