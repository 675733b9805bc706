"""Optional dependencies: what to install when a feature's extra is missing."""

from __future__ import annotations

import importlib.util


def missing_extra(module: str, extra: str, feature: str) -> str | None:
    """None when `module` can be imported, else a one-line message naming `feature` and the
    `pip install 'shadow[extra]'` that brings it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or sys.modules[module] = None
        found = False
    if found:
        return None
    return f"{feature} needs {module}, which is not installed: pip install 'shadow[{extra}]'"
