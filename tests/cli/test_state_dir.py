"""Where the prompt-key secret lives (--key-file, --state-dir, SHADOW_STATE_DIR, systemd's
STATE_DIRECTORY, the XDG default), and `shadow serve` / `shadow tap` starting with a read-only $HOME:
as root a chmod stops no write, so $HOME is made read-only by a private mount namespace with a
read-only bind mount (`unshare --mount`); as another user a chmod 0555 does it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.base.procs import read_json_line, shadow_argv
from shadow.mirror.keys import (
    KEY_FILE_NAME,
    KeyLocation,
    SecretNotCreated,
    key_location,
    load_or_create_secret,
    open_secret,
    state_dir,
)
from tests.active.procs import shadow_process
from tests.live.stack import wait


def test_the_state_directory_in_order_of_precedence(tmp_path: Path) -> None:
    home = {"HOME": str(tmp_path / "home")}
    assert state_dir(None, home) == (tmp_path / "home" / ".local" / "state" / "shadow", False)
    xdg = {**home, "XDG_STATE_HOME": str(tmp_path / "xdg")}
    assert state_dir(None, xdg) == (tmp_path / "xdg" / "shadow", False)  # a session default, not a choice
    systemd = {**xdg, "STATE_DIRECTORY": f"{tmp_path}/sd:{tmp_path}/other"}
    assert state_dir(None, systemd) == (tmp_path / "sd", True)  # StateDirectory=: its first entry
    env = {**systemd, "SHADOW_STATE_DIR": str(tmp_path / "env")}
    assert state_dir(None, env) == (tmp_path / "env", True)
    assert state_dir(str(tmp_path / "flag"), env) == (tmp_path / "flag", True)


def test_the_key_file_is_named_or_in_the_state_directory(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "SHADOW_STATE_DIR": str(tmp_path / "state")}
    assert key_location(None, None, env) == KeyLocation(tmp_path / "state" / KEY_FILE_NAME, True)
    assert key_location(None, None, {"HOME": str(tmp_path)}) == KeyLocation(
        tmp_path / ".local" / "state" / "shadow" / KEY_FILE_NAME, False)
    named = {**env, "SHADOW_KEY_FILE": str(tmp_path / "secret" / "k")}
    assert key_location(None, None, named) == KeyLocation(tmp_path / "secret" / "k", True, kept=False)
    assert key_location(str(tmp_path / "f"), str(tmp_path / "s"), named) == KeyLocation(
        tmp_path / "f", True, kept=False)
    assert key_location(None, str(tmp_path / "s"), {}) == KeyLocation(tmp_path / "s" / KEY_FILE_NAME, True)


def test_a_created_secret_is_private_kept_and_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / KEY_FILE_NAME
    first = load_or_create_secret(path)
    assert len(first) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_secret(path) == first
    assert [p.name for p in path.parent.iterdir()] == [KEY_FILE_NAME]  # no temporary file left behind
    path.write_text("00" * 16 + "\n")
    assert load_or_create_secret(path) == bytes(16)  # an operator's secret is read, not rewritten


def _unwritable(tmp_path: Path) -> Path:
    """A path whose parent cannot be created: under a regular file (fails for root too)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    return blocker / "shadow" / KEY_FILE_NAME


def test_a_named_location_that_cannot_be_created_is_an_error_naming_the_flags(tmp_path: Path) -> None:
    warnings: list[str] = []
    with pytest.raises(SecretNotCreated) as err:
        open_secret(KeyLocation(_unwritable(tmp_path), True), warnings.append)
    text = str(err.value)
    assert "--state-dir" in text and "--key-file" in text and str(tmp_path / "file") in text
    assert "\n" not in text and warnings == []


def test_the_default_location_unwritable_gives_a_fresh_secret_and_one_warning(tmp_path: Path) -> None:
    warnings: list[str] = []
    loc = KeyLocation(_unwritable(tmp_path), False)
    a, b = open_secret(loc, warnings.append), open_secret(loc, warnings.append)
    assert len(a) == 32 and a != b  # in memory, fresh each time: nothing was kept
    assert len(warnings) == 2 and "in-memory" in warnings[0] and "--state-dir" in warnings[0]


# --- the real processes with a read-only $HOME -----------------------------------------------------


def _readonly(path: Path, argv: Sequence[str]) -> list[str]:
    """`argv` run with `path` read-only to it."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return list(argv)
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("unshare (util-linux) is missing: it makes $HOME read-only for root")
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return [unshare, "--mount", "--propagation", "private", "sh", "-c", script, str(path), *argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _started(
    argv: Sequence[str], env: dict[str, str]
) -> Iterator[tuple[dict[str, Any], list[str], subprocess.Popen[str]]]:
    """Run `argv` until its ready line; yields (ready line, [stderr once stopped], the process)."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=env)
    stderr: list[str] = []
    try:
        try:
            ready = read_json_line(proc, argv[0], 90)
        except RuntimeError as exc:
            proc.kill()
            raise AssertionError(f"{exc}: {proc.communicate()[1][-2000:]}") from None
        yield ready, stderr, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        stderr.append(err)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_STATE_HOME", "STATE_DIRECTORY", "SHADOW_STATE_DIR", "SHADOW_KEY_FILE")}
    return {**env, "HOME": str(home), "PYTHONUNBUFFERED": "1", "OTEL_SDK_DISABLED": "true", **extra}


def _serve(*extra: str) -> list[str]:
    """serve with one tap, stopping its tap group when it exits (these tests run without the
    suite's own state directory, where leftover groups would be stopped after the test)."""
    return shadow_argv("serve", "--slots", "4", "--host", "127.0.0.1", "--port", "0", "--stop-taps",
                       "--scrape-interval", "0", "--upstream", f"d0=http://127.0.0.1:{_free_port()}", *extra)


@pytest.mark.integration
def test_serve_starts_with_a_read_only_home_and_a_fresh_key(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    with _started(_readonly(home, _serve()), _env(home)) as (ready, stderr, _):
        r = httpx.get(ready["api"] + "/v1/report", timeout=30)
        assert r.status_code == 200 and "lanes" in r.json()
        assert httpx.get(ready["api"] + "/metrics", timeout=30).status_code == 200
    (err,) = stderr
    assert "Read-only file system" in err or "Permission denied" in err, err
    assert "in-memory secret" in err and "--state-dir" in err and "--key-file" in err, err
    assert list(home.iterdir()) == []


@pytest.mark.integration
def test_serve_keeps_its_key_in_the_state_directory_across_restarts(tmp_path: Path) -> None:
    """The systemd shape: StateDirectory= sets STATE_DIRECTORY, $HOME is read-only (ProtectHome)."""
    home, state = tmp_path / "home", tmp_path / "state"
    home.mkdir()
    env = _env(home, STATE_DIRECTORY=str(state))
    texts = []
    for _ in range(2):
        with _started(_readonly(home, _serve()), env) as (ready, stderr, _):
            assert httpx.get(ready["api"] + "/v1/report", timeout=30).status_code == 200
        assert "in-memory" not in stderr[0], stderr[0]
        key = state / KEY_FILE_NAME
        assert key.stat().st_mode & 0o777 == 0o600
        texts.append(key.read_text())
    assert texts[0] == texts[1] and len(bytes.fromhex(texts[0].strip())) == 32


@pytest.mark.integration
def test_serve_reads_a_mounted_secret_in_a_read_only_directory(tmp_path: Path) -> None:
    """The Kubernetes Secret shape: --key-file names a file in a read-only directory (the tap
    group, with no state directory to write, lives in a temporary one, and says so)."""
    home, secret_dir = tmp_path / "home", tmp_path / "secret"
    home.mkdir()
    secret_dir.mkdir()
    key = secret_dir / KEY_FILE_NAME
    key.write_text("ab" * 32 + "\n")
    with _started(_readonly(home, _serve("--key-file", str(key))), _env(home)) as (ready, stderr, _):
        assert httpx.get(ready["api"] + "/v1/state", timeout=30).status_code == 200
    assert "in-memory" not in stderr[0] and key.read_text() == "ab" * 32 + "\n"
    assert "a restart of this process will not find the running tap group" in stderr[0], stderr[0]
    assert list(home.iterdir()) == []


@pytest.mark.integration
def test_a_named_state_directory_that_is_read_only_exits_1_with_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    argv = _readonly(home, _serve("--state-dir", str(home / "state")))
    res = subprocess.run(argv, capture_output=True, text=True, env=_env(home), timeout=120)
    assert res.returncode == 1 and res.stdout == "", res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("shadow serve: prompt-key secret: cannot create") and "--state-dir" in line


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.integration
@pytest.mark.parametrize("end", [signal.SIGTERM, signal.SIGKILL])
def test_a_group_in_a_temporary_state_directory_ends_with_its_serve(tmp_path: Path, end: int) -> None:
    """Nothing could adopt it after a restart: left serving, every restart would add a data plane."""
    home = tmp_path / "home"
    home.mkdir()
    argv = [a for a in _serve() if a != "--stop-taps"]  # the default: a group outlives its serve
    with _started(_readonly(home, argv), _env(home)) as (ready, stderr, serve):
        tap = ready["taps"]["d0"]
        assert not _refused(tap)
        serve.send_signal(end)
        serve.wait(60)
    wait(lambda: _refused(tap), "the tap group gone with its serve", 90)
    assert "stops when this process exits" in stderr[0], stderr[0]


@pytest.mark.integration
def test_a_second_serve_on_one_state_directory_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    """It would replace the first at the relays, which would then serve an empty report."""
    argv = [*_serve("--state-dir", str(tmp_path / "state"))[3:]]  # (`serve ...`, for shadow_process)
    with shadow_process(argv) as (first, ready):
        second = subprocess.run(shadow_argv(*argv), capture_output=True, text=True, timeout=120,
                                stdin=subprocess.DEVNULL)
        assert second.returncode == 1 and second.stdout == "", second.stderr
        line = second.stderr.strip().splitlines()[-1]
        assert f"another shadow serve (pid {first.pid}) already analyses tap group" in line, line
        assert "--replica-id" in line
        assert httpx.get(ready["api"] + "/v1/state", timeout=30).json()["attached"][0]["attached"]
        first.kill()  # its lock goes with it, however it ends
        first.wait(30)
        with shadow_process(argv) as (_, again):
            assert again["taps"] == ready["taps"]  # the group adopted
