"""The attach handshake's refusals, each with one clear line or a counted reason: over the unix
socket a peer of another uid is refused by the relay (a relay's answer PEER) and by the analysis
(before it sends a byte); an analysis meets a relay of protocol 1 (it closes without answering)
or of another version (it says which), and a relay meets an analysis of protocol 1 (it answers
the one frame that analysis reads, naming the fix)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import os
import shutil
import socket
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadow.contracts import handshake
from shadow.dataplane.relay import Relay, RelaySockets, RelaySpec
from shadow.dataplane.rundir import unix_listen
from shadow.mirror.attach import LEGACY_TRIES, Attachment

NOBODY = 65534
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # one another uid may run
needs_root = pytest.mark.skipif(os.geteuid() != 0 or SYSTEM_PYTHON is None,
                                reason="a peer of another uid needs root to start it, and a system python3")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory another uid may reach (pytest's are the owner's only)."""
    d = Path(tempfile.mkdtemp(prefix="shadow-peer-"))
    d.chmod(0o777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _as_nobody(code: str, *args: str) -> subprocess.Popen[str]:
    assert SYSTEM_PYTHON is not None
    return subprocess.Popen([SYSTEM_PYTHON, "-c", code, *args], user=NOBODY, group=NOBODY, extra_groups=[],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _relay(path: Path) -> Relay:
    spec = RelaySpec(taps=[{"name": "d0", "upstream": "http://127.0.0.1:9", "role": "decode"}])
    tap = socket.create_server(("127.0.0.1", 0))
    return Relay(spec, RelaySockets(taps={"d0": tap}, attach=[unix_listen(path)]))


async def _serving(relay: Relay) -> asyncio.Future[None]:
    run = asyncio.ensure_future(relay.run())
    while not relay._attach_listeners:
        await asyncio.sleep(0.01)
    return run


async def _stopped(relay: Relay, run: asyncio.Future[None]) -> None:
    relay.stop()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(run, 30)
    for s in relay.sockets.taps.values():
        s.close()


_CONNECT_AND_OPEN = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(bytes.fromhex(sys.argv[2]))
got = b""
while chunk := s.recv(4096):
    got += chunk
print(got.hex())
"""


@needs_root
def test_the_relay_refuses_a_peer_of_another_uid_on_its_unix_socket(open_dir: Path) -> None:
    async def main() -> None:
        path = open_dir / "attach.sock"
        relay = _relay(path)
        path.chmod(0o666)  # (as if its permissions let others in: the uid check holds anyway)
        run = await _serving(relay)
        try:
            peer = _as_nobody(_CONNECT_AND_OPEN, str(path), handshake.opening()[0].hex())
            out, err = await asyncio.to_thread(peer.communicate, timeout=60)
            assert peer.returncode == 0, err
            assert bytes.fromhex(out.strip()) == handshake.head(handshake.PEER)  # told why, nothing else
            assert relay.refused["peer"] == 1 and relay.sink.attached == 0
        finally:
            await _stopped(relay, run)

    asyncio.run(main())


_LISTEN_AND_RECORD = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o666)
s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
got = b""
while chunk := c.recv(4096):
    got += chunk
print(len(got), flush=True)
"""


@needs_root
def test_an_analysis_refuses_a_relay_of_another_uid_before_it_sends_a_byte(
    open_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = open_dir / "attach.sock"
    impostor = _as_nobody(_LISTEN_AND_RECORD, str(path))
    assert impostor.stdout is not None and impostor.stdout.readline().strip() == "ready"

    async def main() -> None:
        a = Attachment(f"unix:{path}", lambda r, items: None)
        a.start()
        try:
            line = await asyncio.to_thread(impostor.stdout.readline)  # type: ignore[union-attr]
            assert line.strip() == "0"  # it got nothing at all: no opening, no name
        finally:
            await a.aclose()

    with caplog.at_level(logging.WARNING, logger="shadow.attach"):
        asyncio.run(main())
    impostor.wait(30)
    assert f"runs as uid {NOBODY}, not this user" in caplog.text


async def _listen(path: Path, answer: bytes, n: int) -> int:
    """A relay stand-in on `path`: `n` connections, each sent `answer` after a read (a protocol-1
    relay sends nothing and closes: the frame header it reads claims too much); the bytes read."""
    loop = asyncio.get_running_loop()
    server = unix_listen(path)
    server.setblocking(False)
    got = 0
    try:
        for _ in range(n):
            conn, _ = await loop.sock_accept(server)
            with conn:
                got += len(await loop.sock_recv(conn, 1 << 16))
                if answer:
                    await loop.sock_sendall(conn, answer)
    finally:
        server.close()
    return got


def _meets(path: Path, answer: bytes, n: int) -> tuple[Attachment, int]:
    """An analysis attaching to a relay stand-in answering `answer` (for `n` connections): the
    attachment once it gave up, and the bytes the stand-in read."""

    async def main() -> tuple[Attachment, int]:
        listening = asyncio.ensure_future(_listen(path, answer, n))
        while not path.exists():
            await asyncio.sleep(0.01)
        a = Attachment(f"unix:{path}", lambda r, items: None)
        a.start()
        try:
            assert not await a.wait_attached(60)
            return a, await listening
        finally:
            await a.aclose()

    return asyncio.run(main())


def test_an_analysis_meeting_a_relay_of_protocol_1_stops_with_one_line_naming_the_fix(tmp_path: Path) -> None:
    a, got = _meets(tmp_path / "attach.sock", b"", LEGACY_TRIES)
    assert a.rejected and "attach protocol 1" in a.last_error and "shadow tap --reload" in a.last_error
    assert got == handshake.OPEN * LEGACY_TRIES  # its opening, never more


def test_an_analysis_meeting_a_relay_of_another_version_says_both(tmp_path: Path) -> None:
    other = struct.pack("<4sHH", handshake.MAGIC, handshake.VERSION + 1, 0)
    a, got = _meets(tmp_path / "attach.sock", other, 1)
    assert a.rejected and got == handshake.OPEN
    assert f"speaks attach protocol {handshake.VERSION + 1}, this one {handshake.VERSION}" in a.last_error


def test_a_relay_answers_an_analysis_of_protocol_1_with_the_one_frame_it_reads(tmp_path: Path) -> None:
    async def main() -> None:
        path = tmp_path / "attach.sock"
        relay = _relay(path)
        run = await _serving(relay)
        loop = asyncio.get_running_loop()
        try:
            resume = {"relay_id": "", "end_seen": 0}
            old = marshal.dumps(("hello", {"token": "", "name": "", "resume": resume}))
            sock = socket.socket(socket.AF_UNIX)
            sock.setblocking(False)
            await loop.sock_connect(sock, str(path))
            await loop.sock_sendall(sock, struct.pack("<BI", 6, len(old)) + old)
            got = b""
            while chunk := await loop.sock_recv(sock, 1 << 16):
                got += chunk
            sock.close()
            kind, length = struct.unpack_from("<BI", got)
            hello = marshal.loads(got[5 : 5 + length])  # (our own frame: what protocol 1 reads)
            assert kind == 7 and "shadow tap --reload" in hello["taps"][0]["name"]
            assert relay.refused["protocol"] == 1 and relay.sink.attached == 0
        finally:
            await _stopped(relay, run)

    asyncio.run(main())
