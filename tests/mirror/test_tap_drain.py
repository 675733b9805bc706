"""Graceful drain of `shadow tap` (a real process): SIGTERM during 100 in-flight streams lets all
100 finish with their full token counts, then the process exits 0; a second signal exits at once;
a new connection during the drain is refused at once."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.active.raw_upstream import Held, RawUpstream
from tests.live.stack import wait
from tests.mirror.helpers import http_post
from tests.mirror.stub_worker import ThreadServer, create_stub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOKENS = 60
STEP_S = 0.02
_TOK = re.compile(rb'"text":" t\d+"')


def _start_tap(url: str, tmp: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shadow",
            "tap",
            "--upstream",
            f"d0={url}",
            "--drain-timeout",
            "60",
            "--state-dir",
            str(tmp / "state"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    return p, json.loads(p.stdout.readline())


async def _streams(port: int, n: int, on_all_started: asyncio.Event) -> list[bytes]:
    started = 0
    body = json.dumps({"model": "m", "prompt": "p", "stream": True, "stub": {"tokens": TOKENS}}).encode()

    async def one(i: int) -> bytes:
        nonlocal started
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: drain-%d\r\nContent-Length: %d\r\n\r\n%s" % (i, len(body), body)
        )
        first = await asyncio.wait_for(r.readuntil(b'"text":" t0"'), 30)
        started += 1
        if started == n:
            on_all_started.set()
        rest = await asyncio.wait_for(r.read(-1), 60)  # the tap closes after the response (draining)
        w.close()
        return first + rest

    return await asyncio.gather(*(one(i) for i in range(n)))


def test_sigterm_lets_100_in_flight_streams_finish_with_every_token(tmp_path: Path) -> None:
    with ThreadServer(create_stub("d0", step_s=STEP_S)) as up:
        p, ready = _start_tap(up.url, tmp_path)
        port = int(ready["taps"]["d0"].rsplit(":", 1)[1])
        try:

            async def go() -> list[bytes]:
                all_started = asyncio.Event()
                task = asyncio.create_task(_streams(port, 100, all_started))
                await asyncio.wait_for(all_started.wait(), 60)
                p.send_signal(signal.SIGTERM)  # every stream is mid-flight now
                return await task

            outs = asyncio.run(go())
            rc = p.wait(60)
        finally:
            if p.poll() is None:
                p.kill()
        assert rc == 0, p.stderr.read() if p.stderr else ""
    for out in outs:
        assert len(_TOK.findall(out)) == TOKENS, out[-300:]
        assert out.rstrip(b"\r\n").endswith(b"0") and b"data: [DONE]" in out
    # after the drain the listener is gone: new connections are refused
    with pytest.raises(OSError):
        asyncio.run(asyncio.open_connection("127.0.0.1", port))


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    with ThreadServer(create_stub("d0", step_s=0.5)) as up:
        p, ready = _start_tap(up.url, tmp_path)
        port = int(ready["taps"]["d0"].rsplit(":", 1)[1])
        try:

            async def go() -> int:
                all_started = asyncio.Event()
                task = asyncio.create_task(_streams(port, 1, all_started))
                await asyncio.wait_for(all_started.wait(), 30)
                p.send_signal(signal.SIGTERM)  # draining: the 60-token stream would take 30 s
                await asyncio.sleep(0)
                p.send_signal(signal.SIGINT)
                rc = await asyncio.to_thread(p.wait, 20)
                task.cancel()
                return rc

            rc = asyncio.run(go())
        finally:
            if p.poll() is None:
                p.kill()
    assert rc == 1 and "second signal" in (p.stderr.read() if p.stderr else "")


def test_a_draining_group_refuses_new_connections_while_its_stream_completes(tmp_path: Path) -> None:
    """SIGTERM closes the listeners at once: a router's new connection is refused (it can retry
    elsewhere), not queued where nobody will serve it and reset at the exit; the stream in flight
    still completes."""
    held = Held()
    with RawUpstream(held.script) as up:
        p, ready = _start_tap(up.url, tmp_path)
        port = int(ready["taps"]["d0"].rsplit(":", 1)[1])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                body = json.dumps({"model": "m", "prompt": "p", "stream": True}).encode()
                s.sendall(http_post("/v1/completions", body))
                got = b""
                while b" t0" not in got:
                    got += s.recv(65536)
                p.send_signal(signal.SIGTERM)
                wait(lambda: _refused(port), "a new connection refused while the stream is held", 60)
                held.release.set()
                while chunk := s.recv(65536):
                    got += chunk
            rc = p.wait(60)
        finally:
            held.release.set()
            if p.poll() is None:
                p.kill()
    assert rc == 0, p.stderr.read() if p.stderr else ""
    assert b" t1" in got and b"data: [DONE]" in got and got.endswith(b"0\r\n\r\n"), got[-300:]


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False
