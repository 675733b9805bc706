"""Shadow trusts only a state directory and key files no other user could have changed: one another
user owns, or can write into, is refused with one line naming it and the fix (no fallback
elsewhere), the prompt-key secret it keeps must be 0600 and this user's, the tap log is never
opened through a symlink. The hostile user is `nobody` (65534): the tests that chown need root,
as the CI runs them, and say so otherwise."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shadow.base.procs import shadow_argv
from shadow.base.security import Untrusted
from shadow.dataplane.rundir import RunDir
from shadow.mirror.groups import ManagedGroup
from shadow.mirror.keys import KEY_FILE_NAME, key_location, load_or_create_secret, open_secret

NOBODY = 65534


def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: another user's (nobody's) files are made with chown (the CI runs as root)")


def _tap(state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = shadow_argv("tap", "--upstream", "d0=http://127.0.0.1:9", "--name", "g", "--state-dir", str(state),
                       *extra)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def _last_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 1 and res.stdout == "", (res.returncode, res.stdout, res.stderr)
    return res.stderr.strip().splitlines()[-1]


def _hostile_state(root: Path) -> Path:
    """What another user prepared where root was told to keep its state: their directory, their
    world-readable secret, their tap group directory with a control socket they listen on."""
    state = root / "state"
    group = state / "taps" / "g"
    group.mkdir(parents=True)
    (state / KEY_FILE_NAME).write_text("ab" * 32 + "\n")
    for p in (state, state / "taps", group, state / KEY_FILE_NAME):
        os.chown(p, NOBODY, NOBODY)
    return state


def test_a_state_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    _as_root()
    state = _hostile_state(tmp_path)
    with socket.socket(socket.AF_UNIX) as theirs:
        theirs.bind(str(state / "taps" / "g" / "ctl.sock"))
        theirs.listen()
        theirs.setblocking(False)
        with pytest.raises(Untrusted, match=re.escape(f"state directory {state} belongs to uid {NOBODY}")):
            open_secret(key_location(None, str(state), {}), print)
        line = _last_line(_tap(state))
        assert f"{state} belongs to uid {NOBODY}" in line and "--state-dir" in line, line
        line = _last_line(subprocess.run(
            shadow_argv("tap", "--status", "--name", "g", "--state-dir", str(state)),
            capture_output=True, text=True, timeout=60))
        assert f"{state} belongs to uid {NOBODY}" in line, line
        with pytest.raises(BlockingIOError):
            theirs.accept()  # their socket was never connected to
    assert os.stat(state / "taps" / "g").st_uid == NOBODY  # and nothing of theirs was touched


def test_a_group_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    _as_root()
    state = tmp_path / "state"
    group = state / "taps" / "g"
    group.mkdir(parents=True, mode=0o700)
    os.chown(group, NOBODY, NOBODY)
    line = _last_line(_tap(state))
    assert f"tap group directory {group} belongs to uid {NOBODY}" in line, line
    assert os.stat(group).st_mode & 0o777 == 0o700 and not any(group.iterdir())


def test_a_state_directory_others_can_write_into_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)  # (this user's: only a root-owned mount point is taken as it is, by others)
    line = _last_line(_tap(state))
    assert f"state directory {state} is writable by other users (mode 0777)" in line, line
    assert f"chmod go-w {state}" in line and not (state / "taps").exists()


def test_a_kept_secret_must_be_private_and_this_users(tmp_path: Path) -> None:
    key = tmp_path / "state" / KEY_FILE_NAME
    load_or_create_secret(key)
    assert key.stat().st_mode & 0o777 == 0o600 and (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    key.chmod(0o644)
    private = re.escape(f"key file {key} is readable or writable by other users") + ".*chmod 600"
    with pytest.raises(Untrusted, match=private):
        load_or_create_secret(key)
    key.chmod(0o600)
    link = tmp_path / "state" / "link"
    link.symlink_to(key)
    with pytest.raises(Untrusted, match="symbolic link"):
        load_or_create_secret(link)
    if os.geteuid() == 0:
        os.chown(key, NOBODY, NOBODY)
        with pytest.raises(Untrusted, match=re.escape(f"key file {key} belongs to uid {NOBODY}")):
            load_or_create_secret(key)


def test_a_named_key_file_may_be_roots_and_read_only_but_not_writable_by_others(tmp_path: Path) -> None:
    key = tmp_path / "secret" / KEY_FILE_NAME
    key.parent.mkdir()
    key.write_text("cd" * 32 + "\n")
    key.chmod(0o444)  # a Kubernetes Secret mounted with defaultMode 0444 (root's, as here under root)
    assert load_or_create_secret(key, kept=False) == bytes.fromhex("cd" * 32)
    key.chmod(0o666)
    with pytest.raises(Untrusted, match=re.escape(f"key file {key} is writable by other users")):
        load_or_create_secret(key, kept=False)
    if os.geteuid() == 0:
        key.chmod(0o444)
        os.chown(key, NOBODY, NOBODY)
        with pytest.raises(Untrusted, match=f"belongs to uid {NOBODY}"):
            load_or_create_secret(key, kept=False)


def test_the_tap_log_is_never_opened_through_a_symlink(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.write_text("kept\n")
    rd = RunDir(tmp_path / "state", "g")
    rd.create()
    (rd.path / "tap.log").symlink_to(precious)
    group = ManagedGroup(tmp_path / "state", "g", [sys.executable, "-c", "print('written')"], "d")
    with pytest.raises(OSError, match=re.escape(str(rd.path / "tap.log"))):
        group.ensure(timeout_s=30)
    assert group.proc is None and precious.read_text() == "kept\n"
