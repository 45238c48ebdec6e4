"""The documentation site's pages: the API reference names every public name, the troubleshooting page quotes
messages ddpkit still prints, and every page is in the site's navigation.

(The pages' code blocks run in tests/test_readme.py; CI builds the site with ``mkdocs build --strict``, which fails
on a broken link or anchor and on an API entry it cannot resolve.)
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import ddpkit

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OPTIONAL = ("lightning", "accelerate", "torchbearer")  # integrations whose library may be missing


def _documented() -> dict[str, str]:
    """Every ``::: path`` entry of the API reference: the name it documents -> its path."""
    entries = {}
    for page in (DOCS / "api").glob("*.md"):
        for path in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M):
            entries[path.rsplit(".", 1)[1]] = path
    return entries


def _public_names() -> dict[str, set[str]]:
    """The public surface -> its names: the ``__all__`` of every package (``ddpkit.optim``, ...; a module's own
    ``__all__`` lists what its package re-exports) and of the integration and compatibility modules, which users
    import by their module path."""
    found = {}
    for info in pkgutil.walk_packages(ddpkit.__path__, "ddpkit."):
        if not (info.ispkg or info.name.startswith(("ddpkit.integrations.", "ddpkit.compat."))):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            if any(name in info.name for name in OPTIONAL):
                continue
            raise
        if hasattr(module, "__all__"):
            found[info.name] = set(module.__all__)
    return found


def test_every_public_name_is_in_the_api_reference_and_resolves():
    documented = _documented()
    public = _public_names()
    assert "ddpkit.optim" in public and "ddpkit.nn" in public  # (the walk found the packages)
    missing = sorted(f"{module}.{name}" for module, names in public.items() for name in names if name not in documented)
    assert not missing, f"public names without an entry in docs/api/: {missing}"
    for path in documented.values():  # each entry names the object users import
        module_path, attribute = path.rsplit(".", 1)
        if any(part in module_path for part in OPTIONAL):
            pytest.importorskip(module_path)
        assert getattr(importlib.import_module(module_path), attribute) is not None, path


def test_troubleshooting_quotes_messages_ddpkit_prints():
    source = "\n".join(p.read_text() for p in (ROOT / "ddpkit").rglob("*.py"))
    quoted = re.findall(r"^### `(.+)`$", (DOCS / "troubleshooting.md").read_text(), re.M)
    assert len(quoted) >= 15
    gone = [text for text in quoted if text not in source]
    assert not gone, f"troubleshooting.md quotes messages that are no longer in ddpkit: {gone}"


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert [p for p in pages if p not in nav] == []
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300  # the README is the entry page, not the manual
