"""Where a running tap group can be found: `STATE_DIR/taps/NAME/` holds its record (`tap.json`:
pid, tap URLs, attach and admin addresses, the configuration digest), its attach and control unix
sockets and a lock held for the group's lifetime. Directories are 0700, sockets 0600: an attach
stream carries request bodies, so only the owner may connect.

Unix socket paths are limited to ~107 bytes; longer ones are reached through `/proc/self/fd/N/`
of an open directory (Linux), so any state directory works.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GROUPS = "taps"
RECORD = "tap.json"
ATTACH = "attach.sock"
CONTROL = "ctl.sock"
LOCK = "lock"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SUN_PATH_MAX = 100


def check_name(name: str) -> str:
    """A group name usable as a directory name (ValueError otherwise)."""
    if not _NAME.match(name):
        raise ValueError(f"tap group name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return name


def digest(doc: Any) -> str:
    """A short stable hash of a JSON-able configuration."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _short(path: Path) -> Iterator[str]:
    """A path to `path` short enough for a unix socket address."""
    s = str(path)
    if len(s.encode()) <= _SUN_PATH_MAX:
        yield s
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def unix_listen(path: Path, backlog: int = 16) -> socket.socket:
    """A listening unix socket at `path` (mode 0600; a stale socket file there is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        with _short(path) as where:
            sock.bind(where)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old)
    sock.listen(backlog)
    return sock


def unix_connect(path: Path, timeout_s: float = 5.0) -> socket.socket:
    """A connected unix socket (OSError when nothing listens there)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        with _short(path) as where:
            sock.connect(where)
    except OSError:
        sock.close()
        raise
    return sock


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDir:
    """One tap group's directory (see module docstring)."""

    def __init__(self, state_dir: Path, name: str) -> None:
        self.name = check_name(name)
        self.path = Path(state_dir) / GROUPS / name
        self._lock_fd: int | None = None

    @property
    def attach(self) -> Path:
        return self.path / ATTACH

    @property
    def control(self) -> Path:
        return self.path / CONTROL

    @property
    def record(self) -> Path:
        return self.path / RECORD

    def create(self) -> None:
        """Make the directory (0700) with its parents; OSError names it when that fails."""
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path, 0o700)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot create the tap group directory {self.path}: {exc.strerror or exc}"
            ) from None

    def lock(self) -> None:
        """Hold the group's lock for this process's lifetime (inherited by its relays);
        OSError naming the running group when another process holds it."""
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        for _ in range(50):  # a probe (`locked_by_someone`) holds it for microseconds
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                time.sleep(0.01)
                continue
            os.set_inheritable(fd, True)
            self._lock_fd = fd
            return
        os.close(fd)
        rec = self.read() or {}
        raise OSError(
            errno.EEXIST,
            f"tap group {self.name!r} in {self.path.parent.parent} is already "
            f"running (pid {rec.get('pid', '?')}); stop it with "
            f"`shadow tap --stop --name {self.name}` or give another --name",
        )

    @property
    def lock_fd(self) -> int | None:
        return self._lock_fd

    def locked_by_someone(self) -> bool:
        """True while a live process holds the group's lock."""
        try:
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
        return False

    def write(self, doc: dict[str, Any]) -> None:
        """Replace the record atomically."""
        tmp = self.path / f".{RECORD}.{os.getpid()}.{secrets.token_hex(3)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
            fh.write("\n")
        os.replace(tmp, self.record)

    def read(self) -> dict[str, Any] | None:
        try:
            doc = json.loads(self.record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def live_record(self) -> dict[str, Any] | None:
        """The record, when the group that wrote it still runs."""
        rec = self.read()
        if rec is None or not self.locked_by_someone():
            return None
        return rec

    def clean(self) -> None:
        """Remove the record and sockets (on a clean stop)."""
        for p in (self.record, self.attach, self.control):
            with contextlib.suppress(OSError):
                p.unlink()

    def remove(self) -> None:
        """Remove the directory of a group that no longer runs (its log and lock too)."""
        if self.locked_by_someone():
            return
        self.clean()
        for p in (self.path / LOCK, self.path / "tap.log"):
            with contextlib.suppress(OSError):
                p.unlink()
        with contextlib.suppress(OSError):
            self.path.rmdir()


def groups(state_dir: Path) -> list[RunDir]:
    """Every tap group directory under the state directory."""
    root = Path(state_dir) / GROUPS
    try:
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))
    except OSError:
        return []
    return [RunDir(state_dir, n) for n in names]
