"""Every argument of the public API is described where the reference shows it: each name the API
reference lists (`::: ddpkit...` in docs/api/) documents every argument of its constructor (a class) or of itself (a
function) in a Google-style ``Args:`` section of its docstring.
A dataclass may describe its fields in an ``Attributes:`` section; a constructor inherited unchanged is described
where it is defined.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def public_names() -> list[str]:
    """The dotted names the API reference renders, in its pages' order."""
    names = []
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        names += re.findall(r"^::: (ddpkit[\w.]+)", page.read_text(), re.M)
    return names


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:  # (a module itself: ::: ddpkit.x.module)
        return importlib.import_module(dotted)


def _arguments(obj: object) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj  # type: ignore[misc]
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_ONLY)
    return [p.name for p in parameters if p.kind in plain and p.name not in ("self", "cls")]


def described(docstring: str) -> set[str]:
    """The argument names an ``Args:`` section of `docstring` describes (``name:`` or ``name (type):`` lines); a
    dataclass's fields may be described in an ``Attributes:`` section instead."""
    text = inspect.cleandoc(docstring or "")
    names: set[str] = set()
    for match in re.finditer(r"^(?:Args|Attributes):\n((?:[ \t]+.*\n?|\n)*)", text, re.M):
        names |= set(re.findall(r"^ {4}\**(\w+)(?: \([^)]*\))?:", match.group(1), re.M))
    return names


def undescribed() -> list[str]:
    missing = []
    for dotted in public_names():
        obj = _resolve(dotted)
        if inspect.ismodule(obj) or not callable(obj):
            continue
        have = described(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):  # a constructor inherited unchanged is described where it is defined
            owner = next(c for c in obj.__mro__ if "__init__" in vars(c))
            have |= described(inspect.getdoc(owner) or "")
        missing += [f"{dotted}: {name}" for name in _arguments(obj) if name not in have]
    return sorted(set(missing))


def test_the_args_sections_parse():
    doc = """What it is.

    Args:
        store: a client.
        rank (int): this rank,
            on two lines.
        *args: passed on.

    Returns:
        nothing.
    """
    assert described(doc) == {"store", "rank", "args"}
    assert described("No arguments described.") == set()


def test_every_public_argument_is_described():
    names = public_names()
    assert len(names) > 40 and "ddpkit.optim.OSS" in names
    missing = undescribed()
    assert not missing, "describe these arguments in an Args: section of the docstring:\n" + "\n".join(missing)


def test_the_main_classes_docstrings_are_at_the_size_users_read():
    """What it is, the algorithm in a few sentences, what it sends and holds, Args, Raises, an Example: the rest
    lives on the concept pages."""
    from ddpkit.fault_tolerance import Manager
    from ddpkit.nn import ShardedDataParallel
    from ddpkit.optim import OSS, AdaScale, ShardedGradScaler

    main = (OSS, ShardedDataParallel, AdaScale, ShardedGradScaler, Manager)
    lengths = {cls.__name__: len(inspect.getdoc(cls).splitlines()) for cls in main}
    assert all(n <= 40 for n in lengths.values()), lengths
