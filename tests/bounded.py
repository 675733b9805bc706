"""Run a command to its end under a memory ceiling and a deadline, for regression tests of inputs
that once cost gigabytes or hours: such a test fails with a MemoryError (or a kill) or at the
deadline instead of taking the machine with it. The deadline is a hang detector, generous enough
for a loaded machine, not a timing assertion."""

from __future__ import annotations

import resource
import subprocess
from collections.abc import Sequence

import pytest

MEMORY_BYTES = 1 << 30  # address space: `shadow replay` of a small trace needs under half of it
DEADLINE_S = 120.0


def run_bounded(
    argv: Sequence[str], memory_bytes: int = MEMORY_BYTES, deadline_s: float = DEADLINE_S
) -> subprocess.CompletedProcess[str]:
    """`argv` run to its end with RLIMIT_AS = `memory_bytes`; fails the test when it is still running
    after `deadline_s` (it is killed)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    try:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=deadline_s, preexec_fn=limit
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(argv)[:200]} still running after {deadline_s:g} s")


def one_line_error(proc: subprocess.CompletedProcess[str], fragment: str, code: int = 2) -> str:
    """The process's one-line error, asserting its exit code, that it is one line (no traceback)
    and that it holds `fragment`."""
    err = proc.stderr.strip()
    assert proc.returncode == code, (proc.returncode, err[-2000:])
    assert len(err.splitlines()) == 1, err[-2000:]
    assert fragment in err, err
    return err
