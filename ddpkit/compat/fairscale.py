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
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

from ddpkit.nn import ShardedDataParallel, SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from ddpkit.optim import OSS, AdaScale, AdaScaleWrapper, ShardedGradScaler

__all__ = ["ALIASES", "install", "installed", "is_installed", "uninstall"]

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

_PACKAGES = {name.rsplit(".", 1)[0] for name in ALIASES if "." in name}
_VERSION = "0.4.13"  # the fairscale release whose public API these names follow


class _Shadow:
    """What `install` changed: the real modules it took out of ``sys.modules`` and the import guard it added."""

    def __init__(self, saved: dict[str, types.ModuleType], finder: _Unprovided) -> None:
        self.saved = saved
        self.finder = finder


_active: _Shadow | None = None


class _Unprovided(importlib.abc.MetaPathFinder):
    """Refuses, with a clear message, any ``fairscale.*`` module ddpkit does not provide while installed."""

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
    for name in sorted(ALIASES, key=lambda n: n.count(".")):  # parents first
        module = types.ModuleType(name, f"ddpkit.compat.fairscale alias of fairscale's {name}")
        module.__dict__.update(ALIASES[name])
        module.__all__ = sorted(ALIASES[name])  # type: ignore[attr-defined]
        module.__ddpkit_alias__ = True  # type: ignore[attr-defined]
        if name in _PACKAGES or name == "fairscale":
            module.__path__ = []  # a package: submodules are looked up in sys.modules only
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
