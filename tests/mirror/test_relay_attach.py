"""A relay in this process with analyses attached over its unix socket: one that dies while the
relay is writing to it is detached cleanly — its socket is no longer watched, the loop does not
spin on it, nothing is logged as an error — and the other attached analysis goes on receiving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from pathlib import Path

import pytest

from shadow.contracts.frames import T_HELLO, FrameReader, frame_bound
from shadow.dataplane.relay import Relay, RelaySockets, RelaySpec
from shadow.dataplane.rundir import unix_listen
from tests.mirror.helpers import attach_on_loop


async def _attach(path: Path, name: str) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await loop.sock_connect(sock, str(path))
    await attach_on_loop(sock, name)
    frames = FrameReader(frame_bound(4 << 20))
    got: list[tuple[int, bytes]] = []
    while not any(k == T_HELLO for k, _ in got):
        data = await loop.sock_recv(sock, 1 << 16)
        assert data, "the relay closed the attach"
        got += frames.feed(data)
    return sock


def test_an_analysis_killed_mid_write_is_detached_without_spinning_the_relay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        tap = socket.create_server(("127.0.0.1", 0))
        path = tmp_path / "attach.sock"
        spec = RelaySpec(taps=[{"name": "d0", "upstream": "http://127.0.0.1:9", "role": "decode"}])
        relay = Relay(spec, RelaySockets(taps={"d0": tap}, attach=[unix_listen(path)]))
        calls = 0
        on_control = relay._on_control

        def counted(*args: object) -> None:
            nonlocal calls
            calls += 1
            on_control(*args)  # type: ignore[arg-type]

        relay._on_control = counted  # type: ignore[method-assign]
        detached = asyncio.Event()
        hook = relay.sink.on_detach
        assert hook is not None

        def told(name: str, sock: socket.socket) -> None:
            hook(name, sock)
            detached.set()

        relay.sink.on_detach = told
        run = asyncio.ensure_future(relay.run())
        try:
            dying = await _attach(path, "dying")
            staying = await _attach(path, "staying")
            assert relay.sink.attached == 2
            # the dying analysis goes with a reset while the relay keeps writing frames to it

            async def keep_writing() -> None:
                while not detached.is_set():
                    relay.mark()  # frames for both, written on the next loop iteration
                    await asyncio.sleep(0)  # (a turn of the loop, not a wait)

            writer = asyncio.ensure_future(keep_writing())
            dying.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            dying.close()
            await asyncio.wait_for(detached.wait(), 30)
            await writer
            before = calls
            for _ in range(200):  # the loop turns; the dead socket must not wake it any more
                await asyncio.sleep(0)
            assert calls - before <= 1, f"the dead analysis's socket woke the relay {calls - before} times"
            assert relay.sink.analyses == ["staying"]
            relay.mark()
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(30):
                assert await loop.sock_recv(staying, 1 << 16)  # the other one still gets frames
            staying.close()
        finally:
            relay.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run, 30)
            tap.close()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]
