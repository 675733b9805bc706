"""The setting of one of shadow's vLLM plugins, read from the server's environment."""

from __future__ import annotations

import os


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
