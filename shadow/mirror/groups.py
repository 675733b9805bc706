"""Tap groups an analysis starts for itself (`shadow serve --upstream ...`) or adopts after its own
restart: a `shadow tap` process in a session of its own, found through the state directory.

`ManagedGroup(state_dir, name, argv, digest).ensure()` adopts the group running under that name
with the same configuration digest, else starts `argv` detached (stdin closed, output to
`STATE_DIR/taps/NAME/tap.log`, never through a symlink) and waits until its relay accepts;
`stop()` drains and ends it (a pid read from the record is signalled only once verified as the
group's supervisor). The group outlives the process that started it, unless `bound`: then its
stdin is a pipe this process holds, and the group stops when this process ends, however it ends
(for a group in a temporary state directory, which nothing else could find and adopt). A group
stopped cleanly leaves no directory behind; one that was lost (its supervisor killed) leaves its
record, and `lost()` says so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from shadow.base.procs import log_tail
from shadow.dataplane.rundir import RunDir
from shadow.dataplane.supervisor import control

LOG = "tap.log"
BOUND_FLAG = "--bound"  # `shadow tap`'s (hidden) flag: stop when stdin ends


class ManagedGroup:
    """See module docstring."""

    def __init__(
        self, state_dir: Path, name: str, argv: list[str], digest: str, *, bound: bool = False
    ) -> None:
        self.run_dir = RunDir(state_dir, name)
        self.argv = [*argv, BOUND_FLAG] if bound else argv
        self.digest = digest
        self.bound = bound
        self.proc: subprocess.Popen[bytes] | None = None
        self.adopted = False
        self.recovered = 0  # times it was started again after it was lost (`lost`)

    @property
    def log_path(self) -> Path:
        return self.run_dir.path / LOG

    def running(self) -> dict[str, Any] | None:
        """The running group's record (with a relay that accepts), or None."""
        rec = self.run_dir.live_record()
        if rec is None or not rec.get("relay_id"):
            return None
        return rec

    def ensure(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Adopt the running group or start it; its record. OSError with the log's tail on failure
        (or naming a directory not to be trusted)."""
        self.run_dir.create()
        rec = self.run_dir.live_record()
        if rec is not None:
            if rec.get("digest") != self.digest:
                raise OSError(
                    f"tap group {self.run_dir.name!r} runs with another configuration (pid "
                    f"{rec.get('pid')}); stop it first: shadow tap --stop --name {self.run_dir.name}"
                )
            self.adopted = True
            return self._wait(timeout_s)
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open {self.log_path}: {exc.strerror or exc}") from None
        log = os.fdopen(fd, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE if self.bound else subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            log.close()
        try:
            return self._wait(timeout_s)
        except OSError:
            self._abandon()
            raise

    def lost(self) -> bool:
        """The group's supervisor ended without a clean stop (its record is left behind; its
        relays ended with it): `ensure` starts it again, on the ports it had."""
        return self.run_dir.read() is not None and not self.run_dir.locked_by_someone()

    def _abandon(self) -> None:
        """End a group this process started that did not come up (its whole process group: the
        supervisor and any relay), so that a failed start leaves nothing running; its log stays."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            # still not reaped (a process in uninterruptible disk I/O dies when that ends): the
            # caller's error says why the start failed, not this wait
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)

    def _wait(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            rec = self.running()
            if rec is not None:
                return rec
            if self.proc is not None and self.proc.poll() is not None:
                raise OSError(
                    f"the tap group {self.run_dir.name!r} exited (code {self.proc.returncode}) "
                    f"before serving: {self.tail()}"
                )
            if time.monotonic() > deadline:
                raise OSError(
                    f"the tap group {self.run_dir.name!r} did not start serving within "
                    f"{timeout_s:.0f} s: {self.tail()}"
                )
            time.sleep(0.02)

    def _supervisor(self) -> int | None:
        """The group's supervisor pid: our child while it runs, else the lock's verified holder."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc.pid
        return self.run_dir.supervisor()

    def tail(self, lines: int = 3) -> str:
        last = log_tail(self.log_path, lines)
        return "(no log)" if last is None else " | ".join(last) or "(empty log)"

    def poll(self) -> None:
        """Reap the group's process if it was ours and has exited (no zombie left behind)."""
        if self.proc is not None:
            self.proc.poll()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Drain and end the group (the supervisor's `stop`, else SIGTERM to its verified pid)."""
        try:
            control(self.run_dir, "stop", timeout_s=5.0)
        except OSError:
            pid = self._supervisor()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None:
                if self.proc.poll() is not None:
                    break
            elif not self.run_dir.locked_by_someone():
                break
            time.sleep(0.02)
        else:
            if self.proc is not None and self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            return
        if self.proc is None or self.proc.returncode == 0:
            self.run_dir.remove()  # stopped cleanly: nothing left to find (a failure keeps its log)
