"""Lets code written for fairscale import ddpkit's components through fairscale's module paths.

``install()`` registers modules named like fairscale's (``fairscale.optim``, ``fairscale.nn.data_parallel``,
``fairscale.experimental.nn.data_parallel`` ...) in ``sys.modules`` whose attributes are ddpkit's classes, so
``from fairscale.optim import OSS`` gives `ddpkit.optim.OSS` without editing the import. ``uninstall()`` removes
them and puts back whatever was there (the real fairscale, if it was imported). ``installed()`` does both as a
context manager. While installed, the real fairscale is shadowed: its modules are taken out of ``sys.modules``
and a fairscale module ddpkit does not provide (e.g. ``fairscale.nn.FullyShardedDataParallel``'s module) fails to
import with a message naming what is provided. Nothing here runs on ``import ddpkit``; nothing is communicated.

Example::

    import ddpkit.compat.fairscale

    ddpkit.compat.fairscale.install()
    from fairscale.optim import OSS  # ddpkit.optim.OSS
    from fairscale.nn.data_parallel import ShardedDataParallel  # ddpkit.nn.ShardedDataParallel
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

from ddpkit.nn import ShardedDataParallel, SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from ddpkit.optim import OSS, AdaScale, AdaScaleWrapper, ShardedGradScaler

__all__ = ["ALIASES", "INSTEAD", "STUBS", "NotProvided", "install", "installed", "is_installed", "uninstall"]

_SLOWMO = {"SlowMoDistributedDataParallel": SlowMoDistributedDataParallel, "SlowMoBaseAlgorithm": SlowMoBaseAlgorithm}

ALIASES: dict[str, dict[str, Any]] = {
    "fairscale": {},
    "fairscale.optim": {"OSS": OSS, "AdaScale": AdaScale, "AdaScaleWrapper": AdaScaleWrapper},
    "fairscale.optim.oss": {"OSS": OSS},
    "fairscale.optim.adascale": {"AdaScale": AdaScale, "AdaScaleWrapper": AdaScaleWrapper},
    "fairscale.optim.grad_scaler": {"ShardedGradScaler": ShardedGradScaler},
    "fairscale.nn": {"ShardedDataParallel": ShardedDataParallel},
    "fairscale.nn.data_parallel": {"ShardedDataParallel": ShardedDataParallel},
    "fairscale.nn.data_parallel.sharded_ddp": {"ShardedDataParallel": ShardedDataParallel},
    "fairscale.experimental": {},
    "fairscale.experimental.nn": {},
    "fairscale.experimental.nn.data_parallel": dict(_SLOWMO),
    "fairscale.experimental.nn.data_parallel.gossip": dict(_SLOWMO),
    "fairscale.experimental.nn.data_parallel.gossip.distributed": dict(_SLOWMO),
}
"""Every fairscale module path provided, with the names it holds (each one ddpkit's object of that name)."""

_VERSION = "0.4.13"  # the fairscale release whose public API these names follow


INSTEAD: dict[str, str] = {
    "FullyShardedDataParallel": "torch.distributed.fsdp.fully_shard (FSDP2), or ddpkit.nn.ShardedDataParallel",
    "FSDP": "torch.distributed.fsdp.fully_shard (FSDP2), or ddpkit.nn.ShardedDataParallel",
    "Pipe": "torch.distributed.pipelining",
    "checkpoint_wrapper": "torch.utils.checkpoint.checkpoint (or torch's checkpoint_wrapper)",
    "auto_wrap": "torch.distributed.fsdp.fully_shard applied per block",
    "enable_wrap": "torch.distributed.fsdp.fully_shard applied per block",
    "wrap": "torch.distributed.fsdp.fully_shard applied per block",
}
"""fairscale names ddpkit does not provide, with what to use instead (named in the import error)."""


STUBS: dict[str, tuple[str, ...]] = {
    "fairscale.nn": ("FullyShardedDataParallel", "checkpoint_wrapper", "auto_wrap", "enable_wrap", "wrap"),
    "fairscale.nn.data_parallel": ("FullyShardedDataParallel",),
    "fairscale.nn.wrap": ("auto_wrap", "enable_wrap", "wrap", "config_auto_wrap_policy", "default_auto_wrap_policy"),
    "fairscale.nn.checkpoint": ("checkpoint_wrapper",),
}
"""fairscale names that import, so that a client importing them eagerly runs its other paths, and refuse when
used (called or built), naming what to use instead (`INSTEAD`)."""


class NotProvided(ImportError, NotImplementedError):
    """A fairscale name ddpkit does not provide: imported while the aliases are installed, or used (a stub)."""


def _not_provided(module: str, name: str) -> NotProvided:
    instead = f"; use {INSTEAD[name]} instead" if name in INSTEAD else ""
    provided = ", ".join(sorted(ALIASES.get(module, {}))) or "no names of its own"
    everything = "; ".join(f"{m}: {', '.join(sorted(ALIASES[m]))}" for m in sorted(ALIASES) if ALIASES[m])
    return NotProvided(
        f"{module}.{name} is not provided by ddpkit.compat.fairscale{instead}. {module} provides {provided}; "
        f"every alias: {everything}. Call ddpkit.compat.fairscale.uninstall() to use the real fairscale",
        name=module,
    )


def _stub(module: str, name: str) -> type:
    """A stand-in for `name` that imports and raises `NotProvided` when called or built."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _not_provided(module, name)

    return type(name, (), {"__new__": refuse, "__module__": module, "__doc__": f"Not provided: {name} (refuses)."})


def _refuse_unprovided(module: str) -> Any:
    """A module ``__getattr__`` (PEP 562) for names the alias lacks: ``from fairscale.nn import X`` raises
    `NotProvided` with the list above, where Python's own error would say only 'cannot import name'. Private and
    dunder names stay AttributeErrors, so ``hasattr`` probes of tools behave as on any module."""

    def __getattr__(name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise _not_provided(module, name)

    return __getattr__


class _Shadow:
    """What `install` changed: the real modules it took out of ``sys.modules`` and the import guard it added."""

    def __init__(self, saved: dict[str, types.ModuleType], finder: _Unprovided) -> None:
        self.saved = saved
        self.finder = finder


_active: _Shadow | None = None


class _AliasDistribution(importlib.metadata.Distribution):
    """What ``importlib.metadata`` finds for ``fairscale`` while the aliases are installed: its name and the
    version whose API they follow (clients check ``importlib.metadata.version("fairscale")``)."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: fairscale\nVersion: {_VERSION}\nSummary: ddpkit.compat.fairscale\n"
        return None

    def locate_file(self, path: Any) -> Any:
        return __file__


class _Unprovided(importlib.abc.MetaPathFinder):
    """Refuses, with a clear message, any ``fairscale.*`` module ddpkit does not provide while installed, and
    answers ``importlib.metadata`` for ``fairscale``."""

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        return [_AliasDistribution()] if name in (None, "fairscale") else []

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None) -> None:
        if fullname == "fairscale" or fullname.startswith("fairscale."):
            raise ModuleNotFoundError(
                f"{fullname} is not provided by ddpkit.compat.fairscale (installed: fairscale imports resolve to "
                f"ddpkit); provided modules: {', '.join(sorted(ALIASES))}. Call ddpkit.compat.fairscale.uninstall() "
                "to use the real fairscale",
                name=fullname,
            )
        return None


def _build_modules() -> dict[str, types.ModuleType]:
    modules: dict[str, types.ModuleType] = {}
    names = {*ALIASES, *STUBS}
    packages = {name.rsplit(".", 1)[0] for name in names if "." in name}
    for name in sorted(names, key=lambda n: n.count(".")):  # parents first
        module = types.ModuleType(name, f"ddpkit.compat.fairscale alias of fairscale's {name}")
        module.__dict__.update(ALIASES.get(name, {}))
        module.__dict__.update({stub: _stub(name, stub) for stub in STUBS.get(name, ())})
        module.__all__ = sorted(ALIASES.get(name, {}))  # type: ignore[attr-defined]
        module.__ddpkit_alias__ = True  # type: ignore[attr-defined]
        module.__getattr__ = _refuse_unprovided(name)  # type: ignore[method-assign]
        package = name in packages or name == "fairscale"
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=__file__, is_package=package)
        module.__file__ = __file__  # (clients that read it find ddpkit's compat module)
        if package:
            module.__path__ = []  # a package: submodules are looked up in sys.modules only
            module.__spec__.submodule_search_locations = []
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(modules[parent], child, module)
        modules[name] = module
    modules["fairscale"].__version__ = _VERSION  # type: ignore[attr-defined]
    return modules


def install() -> None:
    """Makes ``fairscale`` and the module paths in `ALIASES` resolve to ddpkit (no-op when already installed)."""
    global _active
    if _active is not None:
        return
    saved = {n: m for n, m in sys.modules.items() if n == "fairscale" or n.startswith("fairscale.")}
    for name in saved:
        del sys.modules[name]
    finder = _Unprovided()
    sys.meta_path.insert(0, finder)
    sys.modules.update(_build_modules())
    _active = _Shadow(saved, finder)


def uninstall() -> None:
    """Removes the aliases and restores the modules `install` took out of ``sys.modules`` (no-op when not
    installed)."""
    global _active
    if _active is None:
        return
    for name in [n for n in sys.modules if n == "fairscale" or n.startswith("fairscale.")]:
        del sys.modules[name]
    sys.modules.update(_active.saved)
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_active.finder)
    _active = None


def is_installed() -> bool:
    return _active is not None


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """`install` for the duration of the block; afterwards the previous state (installed or not) is restored."""
    was_installed = is_installed()
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()
