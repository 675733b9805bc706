"""Prompt keys: a keyed hash (HMAC-SHA256, 64 bits shown) of the prompt with a per-deployment
secret, so that keys from two deployments differ and a known prompt cannot be confirmed by anyone
who only reads the event API. The prompt text is never kept.

The secret is trusted only from a file no other user could have written or read: `prompt-key` in
the state directory (kept there by shadow: the directory checked as `shadow.base.security` says,
the file created 0600, read only when it is this user's with no access for anyone else, never
through a symlink), or a file the operator names (a mounted Secret, a systemd credential: this
user's or root's, writable by no one else). Anything else is refused with one line naming it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shadow.base.security import Untrusted, check_key_file, check_private_dir, private_dir
from shadow.base.statedir import state_dir

SECRET_BYTES = 32
MAX_KEY_FILE = 4096  # bytes read of a key file (a hex secret is 64)


KEY_FILE_NAME = "prompt-key"
FLAGS_HINT = "give --state-dir DIR on a writable volume or --key-file FILE (e.g. a mounted Secret)"


class SecretNotCreated(OSError):
    """The secret file is missing and could not be created (read-only or unwritable location)."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def load_or_create_secret(path: str | Path, *, kept: bool = True) -> bytes:
    """The secret kept in `path` (hex); created atomically with mode 0600 when missing. `kept`:
    shadow keeps it (its directory a state directory); else the operator named it (module
    docstring). Untrusted names a file or directory another user could have changed or read."""
    p = Path(path).expanduser()
    if kept and p.parent.is_dir():
        check_private_dir(p.parent, "state directory", FLAGS_HINT, mount_point=True)
    try:
        text = _read_secret(p, kept=kept)
    except (FileNotFoundError, NotADirectoryError):
        text = _create_secret(p, kept=kept)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{p}: not a hex secret") from None
    if len(secret) < 16:
        raise ValueError(f"{p}: secret shorter than 16 bytes")
    return secret


def _read_secret(p: Path, *, kept: bool) -> str:
    """The text of the key file `p`, once trusted (module docstring)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | (os.O_NOFOLLOW if kept else 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP and kept:
            raise Untrusted(f"key file {p} is a symbolic link: shadow keeps its own key as a file; remove "
                            f"the link, or name the file with --key-file") from None
        raise
    with os.fdopen(fd, "rb") as fh:
        check_key_file(os.fstat(fh.fileno()), p, kept=kept)
        data = fh.read(MAX_KEY_FILE + 1)
    if len(data) > MAX_KEY_FILE:
        raise ValueError(f"{p}: larger than {MAX_KEY_FILE} bytes, not a hex secret")
    return data.decode("ascii", errors="replace").strip()


def _create_secret(p: Path, *, kept: bool) -> str:
    """Write a fresh secret to `p` unless another process got there first; the text kept in `p`."""
    text = secrets.token_hex(SECRET_BYTES)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        if kept:
            private_dir(p.parent, "state directory", FLAGS_HINT, mount_point=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(text + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, p)  # never replaces a secret another process wrote meanwhile
        except FileExistsError:
            return _read_secret(p, kept=kept)
    except Untrusted:
        raise
    except OSError as exc:
        raise SecretNotCreated(exc.errno, f"cannot create {p} ({exc.strerror or exc})") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return text


@dataclass(frozen=True)
class KeyLocation:
    """Where the prompt-key secret lives; `explicit` when the operator named it (flag, env, systemd);
    `kept`: in a state directory (shadow's to keep), not a key file the operator named."""

    path: Path
    explicit: bool
    kept: bool = True


def key_location(key_file: str | None, state: str | None, environ: Mapping[str, str]) -> KeyLocation:
    """--key-file, else $SHADOW_KEY_FILE, else prompt-key in the state directory."""
    named = key_file or environ.get("SHADOW_KEY_FILE")
    if named:
        return KeyLocation(Path(named).expanduser(), True, kept=False)
    directory, explicit = state_dir(state, environ)
    return KeyLocation(directory / KEY_FILE_NAME, explicit)


def open_secret(loc: KeyLocation, warn: Callable[[str], None]) -> bytes:
    """The secret at `loc`; where the default location cannot be created, a fresh in-memory one
    (with a warning: prompt keys then change on restart). A location the operator named must work."""
    try:
        return load_or_create_secret(loc.path, kept=loc.kept)
    except SecretNotCreated as exc:
        if loc.explicit:
            raise SecretNotCreated(exc.errno, f"prompt-key secret: {exc.strerror}; {FLAGS_HINT}") from None
        warn(
            f"prompt-key secret: {exc.strerror}; using a fresh in-memory secret for this run: prompt keys "
            f"will not match those of earlier runs (recordings) or of other processes (--forward); "
            f"{FLAGS_HINT} to keep one"
        )
        return secrets.token_bytes(SECRET_BYTES)


class KeySecret:
    """`prompt_key(request_json)` → 16 hex digits, or None without a prompt; secret None = random."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(SECRET_BYTES)

    def prompt_key(self, req: dict[str, Any]) -> str | None:
        src = req.get("messages", req.get("prompt"))
        if src is None:
            return None
        try:
            canon = json.dumps(src, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError):
            return None
        mac = hmac.new(self._secret, canon.encode("utf-8", "surrogatepass"), hashlib.sha256)
        return mac.hexdigest()[:16]
