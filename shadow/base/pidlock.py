"""A lock file held for a process's lifetime, and which process holds it.

`PidLock(path).acquire()` takes an exclusive `flock` on `path` (created 0600, never through a
symlink) and keeps it until the process ends, however it ends (`kill -9` included): a lock left by
a dead process blocks nothing. Only the process that took it holds it (the descriptor is
close-on-exec; a forked child must close `fd`). `holder()` names the holder's pid as the kernel
knows it (/proc/locks), never as a file someone could have written; `held()` tells whether any
process holds it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

LOCKS = Path("/proc/locks")
PROBE_S = 0.5  # how long `acquire` retries a held lock: a probe holds it for microseconds


class LockHeld(OSError):
    """Another process holds the lock (`pid`: its pid when known)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        super().__init__(errno.EEXIST, f"{path} is locked by pid {pid if pid else '?'}")
        self.pid = pid


class PidLock:
    """See module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self, probe_s: float = PROBE_S) -> None:
        """Take the lock (LockHeld when another process holds it for longer than a probe of
        `held()` would, `probe_s`; OSError for the file)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        deadline = time.monotonic() + probe_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    os.close(fd)
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    raise LockHeld(self.path, self.holder()) from None
                time.sleep(0.01)
                continue
            self.fd = fd
            return

    def held(self) -> bool:
        """True while a live process holds the lock (a probe: takes it for an instant when free)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
        return False

    def holder(self) -> int | None:
        """The pid holding the lock per the kernel's lock table; None when none does (or the table
        cannot be read). A probe of `held()` may show as the holder for an instant."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
            table = LOCKS.read_text(encoding="ascii", errors="replace")
        except OSError:
            return None
        where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in table.splitlines():
            # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF" ("1: -> FLOCK ...": a waiter)
            f = line.split()
            if len(f) >= 6 and f[1] == "FLOCK" and f[5] == where and f[4].isdigit():
                return int(f[4])
        return None
