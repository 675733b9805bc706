"""The code base passes ruff and mypy (strict on every package, as pyproject sets it), as CI requires."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shadow.base.tools import find_executable

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_check_passes() -> None:
    ruff = find_executable("ruff") or "ruff"
    proc = run(ruff, "check", "shadow", "tests", "bench")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_on_the_whole_package() -> None:
    proc = run(sys.executable, "-m", "mypy", "--strict", "shadow")
    assert proc.returncode == 0, proc.stdout + proc.stderr
