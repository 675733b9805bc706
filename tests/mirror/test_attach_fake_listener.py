"""D1, the analysis's side: whatever listens at `shadow serve --attach tcp://…` — silent, answering
garbage or a frame claiming a gigabyte, an answer of the right shape with a proof made up, a relay
of protocol 1's hello — gets the handshake's first message (a version and a random nonce: 40
bytes) and nothing more: never the token, never a name. Meanwhile serve answers its API, and it
stops on SIGTERM: while starting (it never attached), and once running (the listener took the
port of a tap group that died)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import threading
from pathlib import Path

import httpx
import pytest

from shadow.base.procs import shadow_argv
from shadow.contracts import handshake
from tests.live.stack import Procs, free_port, wait
from tests.mirror.stub_worker import ThreadServer, create_stub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOKEN = "fake-listener-test-attach-token-42"
_FLOOD = struct.pack("<BI", 7, 1 << 30) + bytes(1 << 16)  # a frame claiming a GiB, and data


def _answer(mode: str) -> bytes:
    if mode == "garbage":
        return _FLOOD
    if mode == "made_up_proof":
        return handshake.head() + os.urandom(handshake.ANSWER)
    if mode == "protocol_1":  # what a relay before the handshake sent first (its hello, marshal)
        return handshake.legacy_refusal()
    return b""  # silent


class _FakeListener(threading.Thread):
    """Accepts on `port`, answers each connection in turn as one of MODES (the garbage one keeps
    sending), and records every byte each connection sent until the peer closed it."""

    MODES = ("made_up_proof", "garbage", "protocol_1", "silent")

    def __init__(self, port: int = 0) -> None:
        super().__init__(daemon=True)
        self.server = socket.create_server(("127.0.0.1", port))
        self.port = self.server.getsockname()[1]
        self.received: list[tuple[str, bytes]] = []
        self.stop = threading.Event()

    def __enter__(self) -> _FakeListener:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(30)
        self.server.close()

    def run(self) -> None:
        n = 0
        self.server.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            mode = self.MODES[n % len(self.MODES)]
            n += 1
            threading.Thread(target=self._serve, args=(conn, mode), daemon=True).start()

    def _serve(self, conn: socket.socket, mode: str) -> None:
        got = b""
        conn.settimeout(0.05)
        with conn:
            answer, sent = _answer(mode), False
            while not self.stop.is_set():
                try:
                    chunk = conn.recv(1 << 16)
                except TimeoutError:
                    chunk = None
                except OSError:  # reset by serve
                    break
                if chunk == b"":
                    break
                got += chunk or b""
                with contextlib.suppress(TimeoutError, OSError):
                    if answer and (not sent or mode == "garbage"):
                        conn.sendall(answer)
                        sent = True
        self.received.append((mode, got))


def _nothing_but_openings(fake: _FakeListener) -> None:
    for mode, got in list(fake.received):
        assert len(got) == handshake.OPEN, (mode, got[:64])
        assert got[: handshake.HEAD] == handshake.head()
        assert TOKEN.encode() not in got


def _each_kind_twice(fake: _FakeListener) -> bool:
    return {m for m, _ in fake.received} == set(_FakeListener.MODES) and len(fake.received) >= 8


def test_a_fake_listener_gets_the_opening_nonce_only_and_a_starting_serve_stops(tmp_path: Path) -> None:
    with (_FakeListener() as fake, contextlib.closing(Procs(tmp_path)) as procs,
          ThreadServer(create_stub("d0")) as up):
        api = free_port()
        serve, _ = procs.start("serve", shadow_argv(
            "serve", "--attach", f"tcp://127.0.0.1:{fake.port}", "--attach-token", TOKEN,
            "--upstream", f"d0={up.url}", "--port", str(api), "--slots", "8", "--scrape-interval", "0"),
            ready=False)
        wait(lambda: fake.received, "a connection ended", 120)
        _nothing_but_openings(fake)
        wait(lambda: _each_kind_twice(fake), "two connections of each kind ended", 240)
        state = httpx.get(f"http://127.0.0.1:{api}/v1/state", timeout=30)
        assert state.status_code == 200  # serve answers meanwhile
        assert serve.poll() is None
        _nothing_but_openings(fake)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0  # it stops there, not when its wait to attach would end
        assert "stopped while starting" in (tmp_path / "serve.log").read_text()


def test_a_fake_listener_in_place_of_a_dead_relay_gets_nothing_and_a_running_serve_stops(
    tmp_path: Path, state_dir: Path
) -> None:
    with contextlib.closing(Procs(tmp_path)) as procs, ThreadServer(create_stub("d0")) as up:
        port, api = free_port(), free_port()
        tap, ready = procs.start("tap", shadow_argv(
            "tap", "--upstream", f"d0={up.url}", "--name", "dies",
            "--attach-listen", f"127.0.0.1:{port}", "--attach-token", TOKEN))
        serve, _ = procs.start("serve", shadow_argv(
            "serve", "--attach", f"tcp://127.0.0.1:{port}", "--attach-token", TOKEN,
            "--upstream", f"d0={up.url}", "--port", str(api), "--slots", "8", "--scrape-interval", "0"))
        r = httpx.post(ready["taps"]["d0"] + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 200
        state = f"http://127.0.0.1:{api}/v1/state"
        wait(lambda: httpx.get(state, timeout=10).json()["workers"]["d0"]["finished"] == 1, "the mirror")
        os.killpg(tap.pid, signal.SIGKILL)  # the group dies; something else takes its port
        tap.wait(30)
        wait(lambda: not httpx.get(state, timeout=10).json()["attached"][0]["attached"], "serve detached")
        with _FakeListener(port) as fake:
            wait(lambda: _each_kind_twice(fake), "two connections of each kind ended", 240)
            assert httpx.get(state, timeout=30).status_code == 200 and serve.poll() is None
            _nothing_but_openings(fake)
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(60) == 0
