"""D1: hostile bytes on the TCP attach port of a real `shadow tap --attach-listen` — a marshal list
header claiming 2^31−1 items, a tuple header, such frames back to back, garbage, a handshake begun
and never finished — are never decoded: the relay reads the handshake's 40 bytes, refuses, and
counts by reason. Meanwhile a completion through the tap completes with the bytes the worker sent,
the relay's peak RSS (VmHWM, from /proc) stays within 64 MiB of what it was before, and an analysis
holding the token still attaches. How long the completion takes with and without the hostile
traffic is bench/bench_attach_hostile.py's to measure, not this test's."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from pathlib import Path

import httpx
import pytest

from shadow.base.procs import shadow_argv
from shadow.contracts import handshake
from shadow.contracts.frames import T_HELLO
from shadow.dataplane.rundir import RunDir
from tests.live.stack import Procs, free_port, wait
from tests.mirror.helpers import attach_by_hand
from tests.mirror.stub_worker import ThreadServer, create_stub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOKEN = "hostile-test-attach-token-0123456789"
_CTL = struct.pack("<BI", 6, 5)  # protocol 1's control frame header, a 5-byte body
HOSTILE = {
    "list": _CTL + b"[\xff\xff\xff\x7f",  # marshal: a list of 2^31-1 items
    "tuple": _CTL + b"(\xff\xff\xff\x7f",  # marshal: a tuple of 2^31-1 items
    "back_to_back": (_CTL + b"[\xff\xff\xff\x7f" + _CTL + b"(\xff\xff\xff\x7f") * 20_000,
    "garbage": bytes(range(256)) * 64,
}
HALF = handshake.opening()[0][:20]  # half a handshake, then nothing
MIB = 1 << 20


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def _refused(metrics: str, reason: str) -> float:
    line = f'shadow_tap_attach_refused_total{{reason="{reason}"}} '
    text = httpx.get(metrics + "/metrics", timeout=10).text
    return float(next(ln for ln in text.splitlines() if ln.startswith(line)).split()[-1])


class _Hostile(threading.Thread):
    """Sends every HOSTILE payload on a connection of its own, round after round (each read until
    the relay closes it, or for a second), and keeps up to 4 half handshakes open, from `with`
    until `stop`; `sent` counts payloads sent, `rounds` rounds done."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.stopping = threading.Event()
        self.rounds = self.sent = 0
        self.held: list[socket.socket] = []

    def __enter__(self) -> _Hostile:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopping.set()
        self.join(120)

    def run(self) -> None:
        while not self.stopping.is_set():
            for payload in HOSTILE.values():
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)) as s:
                    s.settimeout(1)
                    s.sendall(payload)
                    self.sent += 1
                    while s.recv(1 << 16):
                        pass
            if len(self.held) < 4:
                with contextlib.suppress(OSError):
                    s = socket.create_connection(("127.0.0.1", self.port), 30)
                    s.sendall(HALF)
                    self.held.append(s)
            self.rounds += 1
        for s in self.held:
            s.close()


def test_hostile_frames_on_the_tcp_attach_port_are_never_decoded_and_the_tap_is_unaffected(
    tmp_path: Path, state_dir: Path
) -> None:
    with contextlib.closing(Procs(tmp_path)) as procs, ThreadServer(create_stub("d0", tokens=16)) as up:
        port = free_port()
        _, ready = procs.start("tap", shadow_argv(
            "tap", "--upstream", f"d0={up.url}", "--name", "hostile",
            "--attach-listen", f"127.0.0.1:{port}", "--attach-token", TOKEN))
        relay = wait(lambda: (RunDir(state_dir, "hostile").read() or {}).get("relay_pid"), "the relay")
        tap, metrics = ready["taps"]["d0"], ready["metrics"]
        body = {"model": "m", "prompt": "hostile", "max_tokens": 16, "stream": True}
        want = httpx.post(up.url + "/v1/completions", json=body, timeout=30).content
        assert httpx.post(tap + "/v1/completions", json=body, timeout=30).content == want
        before = _kib(relay, "VmRSS")
        with _Hostile(port) as hostile:
            wait(lambda: hostile.sent >= 8, "hostile payloads sent", 120)
            for _ in range(5):  # while they go on: completions through the tap, byte for byte
                r = httpx.post(tap + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200 and r.content == want
            wait(lambda: hostile.rounds >= 3, "three rounds of hostile connections", 120)
            wait(lambda: _refused(metrics, "protocol") >= 9 and _refused(metrics, "magic") >= 3
                 and _refused(metrics, "timeout") >= 1, "the hostile connections refused by reason", 120)
            assert hostile.is_alive()
        peak = _kib(relay, "VmHWM")
        assert peak - before < 64 * 1024, f"the relay's RSS: {before} KiB, then a peak of {peak} KiB"
        # one holding the token attaches over TCP all the same (its hello answered with a hello)
        with socket.create_connection(("127.0.0.1", port), 30) as s:
            s.settimeout(30)
            first = attach_by_hand(s, "after-hostile", TOKEN.encode())
            assert first[:1] == bytes([T_HELLO])
        # and one with another token learns nothing: the relay's proof fails on its side
        with socket.create_connection(("127.0.0.1", port), 30) as s:
            s.settimeout(30)
            with pytest.raises(handshake.HandshakeError, match="does not prove the attach token"):
                attach_by_hand(s, "intruder", b"not-the-token-at-all")
        assert os.path.exists(f"/proc/{relay}")  # the same relay throughout: it never died
