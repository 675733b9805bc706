"""Small shared security rules: what counts as loopback, bearer-token checks, and which
directories and key files shadow trusts (its own, that no other user can change)."""

from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import stat
from pathlib import Path


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_ok(authorization: str | None, token: str) -> bool:
    """Constant-time check of an `Authorization: Bearer <token>` header value (the scheme is
    case-insensitive, RFC 9110 §11.1)."""
    scheme, _, cred = (authorization or "").strip().partition(" ")
    ok_scheme = scheme.lower() == "bearer"
    return hmac.compare_digest(cred.strip().encode(), token.encode()) and ok_scheme


def admin_denied(
    host: str, token: str | None, authorization: str | None, what: str
) -> tuple[int, str] | None:
    """None when allowed; else (HTTP status, one-line reason).

    With a token, the request must carry it. Without one, the action is allowed only on a
    loopback listener (secure by default: nothing reachable from the network is unauthenticated).
    """
    if token is None:
        if is_loopback(host):
            return None
        return 403, f"{what} over the network needs a token"
    if not bearer_ok(authorization, token):
        return 401, f"{what} needs 'Authorization: Bearer <token>'"
    return None


class Untrusted(PermissionError):
    """A directory or key file another user could change (or read): refused, never worked around
    (no fallback elsewhere: the operator must know)."""


def private_dir(path: Path, what: str, fix: str, *, mount_point: bool = False) -> None:
    """Make `path` (mode 0700, its missing parents with the umask's) or check the one there
    (`check_private_dir`). OSError with one line naming it when it cannot be made or fails."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create the {what} {path}: {exc.strerror or exc}; {fix}") from None
    check_private_dir(path, what, fix, mount_point=mount_point)


def check_private_dir(path: Path, what: str, fix: str, *, mount_point: bool = False) -> None:
    """OSError (one line naming `path`, why and `fix`) unless `path` is a directory (a symlink is
    followed) owned by this process's user and not writable by its group or others: whoever can
    write into it can swap the files and sockets shadow keeps there. `mount_point`: a directory
    root provides to a user that is not root (a Kubernetes emptyDir: root's, mode 0777) is
    accepted as it is, the caller then checking every entry it keeps there the same way."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise OSError(exc.errno, f"{what} {path}: {exc.strerror or exc}; {fix}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{what} {path} is not a directory; {fix}")
    if mount_point and st.st_uid == 0 != os.geteuid():
        return
    _check_owner(st, path, what, fix, allow_root=False)
    if st.st_mode & 0o022:
        raise Untrusted(
            f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): they could "
            f"swap what shadow keeps there; `chmod go-w {path}`, or {fix}"
        )


def check_key_file(st: os.stat_result, path: Path, *, kept: bool) -> None:
    """OSError (one line naming the file) unless a secret read from `path` (its `fstat`) can be
    trusted: a file shadow keeps itself (`kept`: in its state directory) must be this user's with
    no access for group or others (0600); a file the operator named (a mounted Secret, a systemd
    credential: read, never written) this user's or root's, writable by no one else."""
    fix = f"`chmod 600 {path}`" if kept else f"`chmod go-w {path}`"
    _check_owner(st, path, "key file", "use a file of your own", allow_root=not kept)
    mask = 0o077 if kept else 0o022
    if st.st_mode & mask:
        access = "readable or writable" if kept else "writable"
        raise Untrusted(
            f"key file {path} is {access} by other users (mode {stat.S_IMODE(st.st_mode):04o}): {fix}"
        )


def _check_owner(st: os.stat_result, path: Path, what: str, fix: str, *, allow_root: bool) -> None:
    me = os.geteuid()
    if st.st_uid != me and not (allow_root and st.st_uid == 0):
        raise Untrusted(
            f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {me}): that user could "
            f"swap or read it; {fix}, or `chown {me} {path}`"
        )
