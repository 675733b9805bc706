"""Child processes that announce readiness with one JSON line on stdout (`shadow fleet`, `serve`,
`router`), started in their own process group so that a terminal's Ctrl-C reaches only the
parent, which then stops them in order."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any


def read_json_line(proc: subprocess.Popen[str], what: str, timeout_s: float) -> dict[str, Any]:
    """The first stdout line of `proc` as a JSON object; RuntimeError if it exits or is too slow."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line:
                doc = json.loads(line)
                if not isinstance(doc, dict):
                    raise RuntimeError(f"{what}: unexpected ready line {line.strip()!r}")
                return doc
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
    raise RuntimeError(f"{what} was not ready within {timeout_s:.0f} s")


class Child:
    """One child process; `stop()` sends SIGTERM, then SIGKILL after `grace_s`. `env`: variables
    added to this process's environment for it (secrets go there, not on its command line, which
    any local user can read)."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, *, json_ready: bool = True,
                 timeout_s: float = 60.0, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log
        self._log: IO[bytes] = log.open("wb")
        environ = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE if json_ready else self._log, stderr=self._log,
            stdin=subprocess.DEVNULL, text=True, env=environ, process_group=0,
        )
        self.ready: dict[str, Any] = {}
        self._signalled = False
        if json_ready:
            try:
                self.ready = read_json_line(self.proc, name, timeout_s)
            except BaseException:
                self.stop()
                raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM) without waiting for it; `stop()` then waits."""
        if self.proc.poll() is None and not self._signalled:
            self.proc.send_signal(signal.SIGTERM)
            self._signalled = True

    def stop(self, grace_s: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode

    def tail(self, lines: int = 5) -> str:
        """The last lines of the child's log (for error messages)."""
        last = log_tail(self.log_path, lines)
        return "" if last is None else "\n".join(last)


def log_tail(path: Path, lines: int) -> list[str] | None:
    """The last `lines` lines of the log at `path`, None when it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    return text.strip().splitlines()[-lines:]


def shadow_argv(*args: str) -> list[str]:
    """argv to run a `shadow` sub-command with the running interpreter."""
    return [sys.executable, "-m", "shadow", *args]
