"""Start `shadow` sub-commands as real processes and read their JSON ready line."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


def read_ready(proc: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, Any]:
    """The first stdout line of `proc` as JSON (waits for it; fails if the process exits)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line:
                doc: dict[str, Any] = json.loads(line)
                return doc
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"process exited with {proc.returncode} before ready: {err}")
    raise AssertionError("no ready line in time")


@contextmanager
def shadow_process(args: Sequence[str], timeout: float = 60.0) -> Iterator[tuple[subprocess.Popen[str],
                                                                                  dict[str, Any]]]:
    """`python -m shadow ARGS` until the block ends (SIGINT, then kill); yields (proc, ready doc)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "shadow", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield proc, read_ready(proc, timeout)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
