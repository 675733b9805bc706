"""Find an executable that ships with a Python package (e.g. `vllm-router` from PyPI).

`find_executable(name)`: the file beside the running interpreter first (a venv's `bin/`, which
is not on PATH when `.venv/bin/python` or `.venv/bin/pytest` is run without activating the
venv), then PATH; None when neither has it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def find_executable(name: str) -> str | None:
    """Path of executable `name`: beside `sys.executable` first, then on PATH; None if absent."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)
