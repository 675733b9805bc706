"""Where shadow keeps its state (the prompt key, the tap groups' run directories): one rule for every
process, the data plane's and the analysis's."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def state_dir(flag: str | None, environ: Mapping[str, str]) -> tuple[Path, bool]:
    """--state-dir, else $SHADOW_STATE_DIR, else systemd's $STATE_DIRECTORY (first entry), else
    $XDG_STATE_HOME/shadow, else ~/.local/state/shadow; with whether the operator chose it."""
    for value in (flag, environ.get("SHADOW_STATE_DIR"), environ.get("STATE_DIRECTORY", "").split(":")[0]):
        if value:
            return Path(value).expanduser(), True
    xdg = environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path(environ.get("HOME") or os.path.expanduser("~")) / ".local" / "state"
    return base / "shadow", False
