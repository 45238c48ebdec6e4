"""Peer libraries a benchmark compares against where they are installed (never a dependency of ddpkit)."""

from __future__ import annotations

import importlib


def unavailable(module: str, install: str) -> str | None:
    """Why `module` cannot be compared against here (with how to install it), or None when it imports."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken install
        return f"`import {module}` failed ({type(exc).__name__}: {exc}); to compare: {install}"
    return None
