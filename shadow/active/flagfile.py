"""The watched mode flag file: `{mode, policy, canary_fraction, pin}` in YAML or JSON.

    mode: canary            # shadow | canary | active | fallback (required)
    policy: brh             # br0 | brh | jsq-bytes | rr (optional: unchanged)
    canary_fraction: 0.1    # [0, 1] (optional)
    pin: false              # true: automatic fallback and BR-H degrade off (optional)

`FlagFileWatcher.poll()` reads the file (it is small: capped at 64 KiB) and applies it when it was
written since the last read: its bytes, inode, size or modification time changed. With
`PUT /v1/mode` the last writer wins: a PUT holds until the file is written again, and any write of
the file (even of the same bytes: a rename onto it, a touch) applies it again; a poll that finds
the file untouched applies nothing. A missing, unreadable, oversized or invalid file, or one that
is not a regular file (a FIFO, a device: never waited on, it is opened non-blocking), is a flag
error: the controller
goes to `shadow` (counted, reason `flag_error`) until the file is fixed, and so is a mode the
process cannot carry out (no active proxy). Polling, no inotify.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from typing import Any

from shadow.active.modes import ModeController, ModeSetting
from shadow.base.safeyaml import load_yaml

MAX_FLAG_BYTES = 64 << 10
KEYS = ("mode", "policy", "canary_fraction", "pin")


def setting_from(data: Any, where: str) -> ModeSetting:
    """A validated `ModeSetting` from a parsed mapping; ValueError naming `where` otherwise."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a mapping with a 'mode' key")
    unknown = sorted(str(k) for k in data if k not in KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} (known: {', '.join(KEYS)})")
    if "mode" not in data:
        raise ValueError(f"{where}: 'mode' is required")
    mode, policy, frac, pin = (data.get(k) for k in KEYS)
    if not isinstance(mode, str) or (policy is not None and not isinstance(policy, str)):
        raise ValueError(f"{where}: mode and policy must be strings")
    if frac is not None and (isinstance(frac, bool) or not isinstance(frac, int | float)):
        raise ValueError(f"{where}: canary_fraction must be a number in [0, 1], got {frac!r}")
    if pin is not None and not isinstance(pin, bool):
        raise ValueError(f"{where}: pin must be true or false, got {pin!r}")
    try:
        fraction = None if frac is None else float(frac)
    except OverflowError:  # an integer beyond a double (YAML reads any number of digits)
        raise ValueError(f"{where}: canary_fraction must be a number in [0, 1]") from None
    setting = ModeSetting(mode, policy, fraction, pin)
    try:
        setting.validate()
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return setting


def parse_flag(raw: bytes, where: str) -> ModeSetting:
    """Parse flag-file bytes (JSON is YAML; both accepted; no aliases, see `load_yaml`)."""
    if len(raw) > MAX_FLAG_BYTES:
        raise ValueError(f"{where}: larger than {MAX_FLAG_BYTES} bytes")
    return setting_from(load_yaml(raw, where, "the mode file"), where)


class FlagFileWatcher:
    """Polls `path` and applies its setting to `controller` on every change (see module docstring)."""

    def __init__(self, path: str, controller: ModeController, interval_s: float = 0.5) -> None:
        self.path = path
        self.controller = controller
        self.interval_s = interval_s
        self.last: bytes | None = None
        self.last_stat: tuple[int, int, int, int] | None = None  # inode, size, mtime, ctime (ns)
        self.missing_reported = False
        self.reads = 0

    def poll(self) -> None:
        """Read once; apply when the content changed since the last read. Never raises."""
        self.reads += 1
        try:
            raw, written = self._read()
        except OSError as exc:
            if not self.missing_reported:
                self.missing_reported = True
                self.last = self.last_stat = None
                self.controller.flag_error(f"flag file {self.path}: {exc.strerror or exc}")
            return
        self.missing_reported = False
        if raw == self.last and written == self.last_stat:
            return
        self.last, self.last_stat = raw, written
        try:
            setting = parse_flag(raw, f"flag file {self.path}")
        except ValueError as exc:
            self.controller.flag_error(str(exc))
            return
        try:
            self.controller.apply(setting, "flag_file")
        except ValueError as exc:  # a mode this process cannot carry out
            self.controller.flag_error(f"flag file {self.path}: {exc}")

    def _read(self) -> tuple[bytes, tuple[int, int, int, int]]:
        """At most MAX_FLAG_BYTES + 1 bytes of the file and when it was written (inode, size,
        mtime, ctime); OSError when it cannot be read or is not a regular file (opening never
        blocks: a FIFO without a writer would)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"not a regular file ({_kind(st.st_mode)})")
            written = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            parts: list[bytes] = []
            left = MAX_FLAG_BYTES + 1
            while left > 0:
                chunk = os.read(fd, left)
                if not chunk:
                    break
                parts.append(chunk)
                left -= len(chunk)
            return b"".join(parts), written
        finally:
            os.close(fd)

    async def run(self) -> None:
        """Poll forever (cancel to stop)."""
        while True:
            with contextlib.suppress(Exception):
                self.poll()
            await asyncio.sleep(self.interval_s)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a file"
