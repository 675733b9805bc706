"""A tap group whose supervisor is lost (`kill -9`, here in the middle of a reload) takes its relays
with it: they drain (a stream in flight completes) and end, never two generations serving with
no one to end one of them; `--status` says the supervisor is gone; the next `shadow tap` of the
name is not refused and takes the ports the group had, so the router needs no change (`shadow
serve` does that itself for the group it runs, and attaches to it again). A pid read from the
record is signalled only once verified: a recycled one is left alone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.base.pids import start_time
from shadow.base.procs import shadow_argv
from shadow.dataplane.rundir import RunDir, groups
from shadow.mirror.groups import ManagedGroup
from tests.active.procs import shadow_process
from tests.active.raw_upstream import Held, RawUpstream
from tests.live.stack import wait
from tests.mirror.helpers import http_post
from tests.mirror.stub_worker import ThreadServer, create_stub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]



BLOCKS_SIGTERM = ("import signal, time; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); "
                  "print('ready', flush=True); time.sleep(600)")


def _sigterm_pending(pid: int) -> bool:
    """A SIGTERM was sent to `pid` (which blocks it): pending in its /proc status."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        (mask,) = [ln.split()[1] for ln in fh if ln.startswith("ShdPnd:")]
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    return start_time(pid) is not None


def _port(ready: dict[str, Any]) -> int:
    return int(ready["taps"]["d0"].rsplit(":", 1)[1])


def _cmd(what: str, state: Path) -> list[str]:
    return shadow_argv("tap", what, "--name", "g", "--state-dir", str(state))


def _tap(up: str, state: Path, *extra: str) -> list[str]:
    return ["tap", "--upstream", f"d0={up}", "--name", "g", "--state-dir", str(state), *extra]


def test_a_supervisor_killed_in_a_reload_takes_its_relays_along_and_the_group_comes_back(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    held = Held()
    with RawUpstream(held.script) as up:
        try:
            with shadow_process(_tap(up.url, state, "--drain-timeout", "120")) as (sup, ready), \
                    socket.create_connection(("127.0.0.1", _port(ready)), timeout=120) as s:
                s.sendall(http_post("/v1/completions", json.dumps({"stream": True}).encode()))
                got = b""
                while b" t0" not in got:  # a stream in flight, held
                    got += s.recv(65536)
                reload = subprocess.Popen(_cmd("--reload", state), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
                relays = wait(lambda: len(k := _children(sup.pid)) == 2 and k, "the reload's new relay", 60)
                sup.kill()  # in the middle of the reload
                sup.wait(30)
                reload.wait(60)
                # the state directory says what happened
                status = subprocess.run(_cmd("--status", state), capture_output=True, text=True, timeout=60)
                assert status.returncode == 1, status.stderr
                doc = json.loads(status.stdout)
                assert doc["running"] is False and doc["pid"] == sup.pid and "is gone" in doc["error"], doc
                assert doc["relays"] and set(doc["relays"]) <= set(relays), (doc, relays)  # draining
                # a group of the name is not refused while they drain, and serves on the port it had
                with shadow_process(_tap(up.url, state)) as (_, again):
                    assert again["taps"] == ready["taps"] and RunDir(state, "g").supervisor() == again["pid"]
                    with socket.create_connection(("127.0.0.1", _port(ready)), timeout=30) as s2:
                        s2.sendall(http_post("/v1/completions", b"{}"))
                        assert s2.recv(64).startswith(b"HTTP/1.1 200")
                    # the lost group's stream completes; its relays (both generations) end
                    held.release.set()
                    while chunk := s.recv(65536):
                        got += chunk
                    assert b" t1" in got and b"data: [DONE]" in got and got.endswith(b"0\r\n\r\n"), got[-300:]
                    wait(lambda: not any(_running(p) for p in relays), "both lost relays ended", 120)
        finally:
            held.release.set()


def test_a_recycled_pid_in_the_record_is_neither_a_running_group_nor_signalled(tmp_path: Path) -> None:
    state = tmp_path / "state"
    rd = RunDir(state, "g")
    # another process, SIGTERM blocked so that a signal sent to it stays pending, to be seen
    other = subprocess.Popen([sys.executable, "-c", BLOCKS_SIGTERM], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "ready\n"
        start = start_time(other.pid)
        assert start is not None
        # a record left by a group that was lost long ago, whose pids now name another process
        record = {"pid": other.pid, "relay_pid": other.pid, "relays": [[other.pid, start - 1]],
                  "taps": {"d0": "http://127.0.0.1:1"}}
        rd.create()  # (a stop removes the directory of a group that no longer runs)
        rd.write(record)
        ManagedGroup(state, "g", [sys.executable, "-c", "pass"], "d").stop(timeout_s=5)  # serve --stop-taps
        assert not _sigterm_pending(other.pid)
        rd.create()  # (a stop removes the directory of a group that no longer runs)
        rd.write(record)
        stop = subprocess.run(_cmd("--stop", state), capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0 and json.loads(stop.stdout)["relays"] == [], stop.stderr
        assert not _sigterm_pending(other.pid)
        rd.create()  # (a stop removes the directory of a group that no longer runs)
        rd.write(record)
        assert rd.live_record() is None and rd.supervisor() is None and rd.relays() == []
    finally:
        other.kill()
        other.wait()


def test_serve_starts_its_lost_group_again_on_its_ports_and_attaches_to_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with ThreadServer(create_stub("d0")) as up:
        argv = ["serve", "--upstream", f"d0={up.url}", "--slots", "4", "--scrape-interval", "0",
                "--state-dir", str(state), "--stop-taps"]
        with shadow_process(argv) as (_, ready):
            (rd,) = groups(state)
            lost = rd.supervisor()
            assert lost is not None
            os.kill(lost, signal.SIGKILL)
            again = wait(lambda: (r := rd.live_record()) and r.get("relay_id") and r["pid"] != lost
                         and r["pid"], "the group serving again", 120)
            body = json.dumps({"model": "m", "prompt": "p"}).encode()
            port = int(ready["taps"]["d0"].rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # the same port
                s.sendall(http_post("/v1/completions", body))
                assert s.recv(64).startswith(b"HTTP/1.1 200")
            wait(lambda: _state(ready["api"])["tap_group"]["recovered"] == 1, "serve's recovery done", 60)
            assert rd.supervisor() == again
            wait(lambda: _state(ready["api"])["workers"]["d0"]["finished"] == 1, "the request mirrored", 60)


def _state(api: str) -> dict[str, Any]:
    return httpx.get(api + "/v1/state", timeout=30).json()  # type: ignore[no-any-return]
