"""Which process a pid names, and tying a child's life to its parent's.

A pid read from a file may have been recycled (the process it named ended, another got its
number): `identity(pid)` is (owner uid, start time in clock ticks since boot), which a recycled
pid does not share, so a process is known by the pair (pid, start) and `same(pid, start)` tells
whether that process still runs and is this user's. `die_with_parent(sig, parent)`: the kernel
sends `sig` to this process when its parent ends (Linux PR_SET_PDEATHSIG), `kill -9` included.
"""

from __future__ import annotations

import ctypes
import os

PR_SET_PDEATHSIG = 1


def identity(pid: int) -> tuple[int, int] | None:
    """(uid, start ticks) of the live process `pid`, or None (gone, a zombie, unreadable)."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X") or not fields[19].isdigit():
        return None
    return uid, int(fields[19])  # field 22 of stat(5): starttime (fields[0] is field 3)


def start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of the live process `pid`, or None."""
    got = identity(pid)
    return got[1] if got is not None else None


def same(pid: int, start: int) -> bool:
    """True when `pid` still names the process that started at `start` and it is this user's."""
    got = identity(pid)
    return got is not None and got == (os.geteuid(), start)


def die_with_parent(sig: int, parent: int) -> bool:
    """Have the kernel send `sig` to this process when its parent ends; False when the parent
    (pid `parent`) is already gone, or the kernel cannot do it (then the caller must not serve:
    nothing would end it). Async-signal-safe enough for a forked child of a one-thread parent."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) != 0:
        return False
    return os.getppid() == parent  # it may have ended before the request: then no signal comes
