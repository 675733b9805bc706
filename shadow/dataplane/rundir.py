"""Where a running tap group can be found: `STATE_DIR/taps/NAME/` holds its record (`tap.json`:
pid, tap URLs, attach and admin addresses, the configuration digest, its relays), its attach and
control unix sockets and a lock its supervisor holds for its lifetime (`shadow.base.pidlock`).

Trust: the state directory, `taps/` and every group directory must be this user's and writable by
no one else (shadow creates them 0700, and refuses, naming the path and the fix, any it did not
make that fails this: another user could swap the sockets, the record or the log), except a state
directory root provides to a user that is not root (an emptyDir volume: root's, 0777), whose
entries are checked instead; sockets are 0600 (an attach stream carries request bodies: only the
owner may connect). A pid read from a
record is signalled only once verified: the supervisor's as the holder of the group's lock (per
the kernel), a relay's by its start time (`shadow.base.pids`); a recycled pid is neither.

Unix socket paths are limited to ~107 bytes; longer ones are reached through `/proc/self/fd/N/`
of an open directory (Linux), so any state directory works.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shadow.base.pidlock import LockHeld, PidLock
from shadow.base.pids import identity, same
from shadow.base.security import check_private_dir, private_dir

GROUPS = "taps"
ANALYSES = "analyses"  # STATE_DIR/analyses/: the locks of the analyses attached from here
RECORD = "tap.json"
ATTACH = "attach.sock"
CONTROL = "ctl.sock"
LOCK = "lock"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SUN_PATH_MAX = 100
STATE_FIX = "give --state-dir DIR (a writable directory of your own)"


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


def prepare_state_dir(state_dir: Path) -> None:
    """Make the state directory and its `taps/` (0700), or check the ones there (module
    docstring); OSError with one line naming the path and the fix."""
    private_dir(Path(state_dir), "state directory", STATE_FIX, mount_point=True)
    private_dir(Path(state_dir) / GROUPS, "tap groups directory", STATE_FIX)


class RunDir:
    """One tap group's directory (see module docstring)."""

    def __init__(self, state_dir: Path, name: str) -> None:
        self.name = check_name(name)
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / GROUPS / name
        self._lock = PidLock(self.path / LOCK)

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
        """Make the directory (0700) with its parents, or check the ones there (module docstring);
        OSError with one line naming the path when that fails."""
        prepare_state_dir(self.state_dir)
        try:
            self.path.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot create the tap group directory {self.path}: {exc.strerror or exc}"
            ) from None
        check_private_dir(self.path, "tap group directory", STATE_FIX)
        os.chmod(self.path, 0o700)

    def check(self) -> None:
        """Check the directories of this group that exist (as `create` would); OSError naming one
        that fails."""
        for p, what in (
            (self.state_dir, "state directory"),
            (self.state_dir / GROUPS, "tap groups directory"),
            (self.path, "tap group directory"),
        ):
            if p.exists():
                check_private_dir(p, what, STATE_FIX, mount_point=p == self.state_dir)

    def lock(self) -> None:
        """Hold the group's lock for this process's lifetime (not its relays': they end with it);
        OSError naming the running group when another process holds it."""
        try:
            self._lock.acquire()
        except LockHeld as held:
            raise OSError(
                errno.EEXIST,
                f"tap group {self.name!r} in {self.state_dir} is already running (pid "
                f"{held.pid or '?'}); stop it with `shadow tap --stop --name {self.name}` or give "
                f"another --name",
            ) from None

    @property
    def lock_fd(self) -> int | None:
        return self._lock.fd

    def locked_by_someone(self) -> bool:
        """True while the group's supervisor runs (a live process holds the group's lock)."""
        return self._lock.held()

    def supervisor(self) -> int | None:
        """The pid of the group's running supervisor, verified (module docstring), or None."""
        pid = self._lock.holder()
        if pid is None or pid == os.getpid():
            return None
        got = identity(pid)
        return pid if got is not None and got[0] == os.geteuid() else None

    def relays(self, rec: dict[str, Any] | None = None) -> list[int]:
        """The relays a record names that still run, verified by their start time."""
        rec = self.read() if rec is None else rec
        items = (rec or {}).get("relays", [])
        return [
            item[0]
            for item in items if isinstance(items, list)
            and isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item)
            and same(item[0], item[1])
        ]

    def write(self, doc: dict[str, Any]) -> None:
        """Replace the record atomically."""
        tmp = self.path / f".{RECORD}.{os.getpid()}.{secrets.token_hex(3)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
            fh.write("\n")
        os.replace(tmp, self.record)

    def read(self) -> dict[str, Any] | None:
        try:
            fd = os.open(self.record, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, encoding="utf-8") as fh:
                doc = json.loads(fh.read(1 << 20))
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


def hold_analysis_lock(state_dir: Path, targets: list[str], name: str) -> PidLock:
    """Hold, for this process's lifetime, the lock of the analysis `name` attached to `targets`
    (what it attaches to, as said to an operator) from this state directory: a second analysis of
    that name would replace this one at the relays (this one then serving an empty report), so it
    is refused, naming this one's pid. A lock left by a dead process blocks nothing. OSError."""
    base = Path(state_dir)
    private_dir(base / ANALYSES, "analyses directory", STATE_FIX)
    lock = PidLock(base / ANALYSES / f"{digest([sorted(targets), name])}.lock")
    try:
        lock.acquire()
    except LockHeld as held:
        raise OSError(
            errno.EEXIST,
            f"another shadow serve (pid {held.pid or '?'}) already analyses {', '.join(targets)}"
            f"{f' as {name!r}' if name else ''} from {base}: a second one would replace it there; "
            f"stop it first, or give this one another --replica-id",
        ) from None
    return lock


def groups(state_dir: Path) -> list[RunDir]:
    """Every tap group directory under the state directory."""
    root = Path(state_dir) / GROUPS
    try:
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))
    except OSError:
        return []
    return [RunDir(state_dir, n) for n in names]
