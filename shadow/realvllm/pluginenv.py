"""What shadow's vLLM plugins share: their setting, read from the server's environment, and a
patch of vLLM or a library it loads, made once per process."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any


def micros_from_env(name: str, minimum: int, environ: dict[str, str] | os._Environ[str] = os.environ
                    ) -> int | None:
    """`name`'s value in whole µs, None when unset or blank; ValueError for a value that is not an
    int, or is below `minimum` (naming the variable)."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    value = int(raw)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} µs, got {value}")
    return value


def setting_or_warn(read: Callable[[], int | None], log: logging.Logger, plugin: str, untouched: str
                    ) -> int | None:
    """`read()`'s setting; a bad one is logged as a warning ("`plugin`: why; `untouched`"), None."""
    try:
        return read()
    except ValueError as exc:
        log.warning("%s: %s; %s", plugin, exc, untouched)
        return None


def patch_once(owner: Any, name: str, wrap: Callable[[Any], Any]) -> bool:
    """Replace `owner.name` by `wrap(owner.name)`; False, changing nothing, if a patch made it already
    (vLLM loads general plugins once per process, maybe more)."""
    original = getattr(owner, name)
    if getattr(original, "_shadow_patched", False):
        return False
    patched = wrap(original)
    patched._shadow_patched = True
    setattr(owner, name, patched)
    return True
