"""A connection to a relay that ends in the middle of a frame (the relay killed, or the link cut
while it was writing) leaves its torn bytes behind: the next connection's stream is read from its
own first byte, so the analysis re-attaches (it does not read the new hello as the rest of the old
frame and stay detached for good)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shadow.contracts import handshake
from shadow.contracts.frames import DATA, DATA_FIXED, HDR, T_DATA, T_HELLO, T_MARK, encode
from shadow.dataplane.rundir import unix_listen
from shadow.mirror.attach import Attachment


def _hello(relay_id: str) -> bytes:
    return encode(T_HELLO, {"relay_id": relay_id, "v": handshake.VERSION, "mono": 0.0, "taps": [],
                            "max_body": 4 << 20})


def _snapshot_mark() -> bytes:
    snap = {"requests": 0, "live": 0, "unkept": 0, "missed": 0}
    return encode(T_MARK, {"token": 0, "offered": 0, "dropped": 0, "snapshot": snap})


def test_a_frame_torn_by_a_cut_connection_does_not_corrupt_the_next_one(tmp_path: Path) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = unix_listen(tmp_path / "attach.sock")
        server.setblocking(False)
        payload = b"data: x\n\n"
        data = DATA.pack(T_DATA, DATA_FIXED + len(payload), 1, 1, 0.0) + payload
        a = Attachment(f"unix:{tmp_path / 'attach.sock'}", lambda r, items: None)
        a.start()
        try:
            for n, tail in enumerate((data[: len(data) // 2], _snapshot_mark())):
                conn, _ = await loop.sock_accept(server)
                conn.setblocking(False)
                await handshake.server(loop, conn, b"")
                _, length = HDR.unpack(await handshake.recv_exact(loop, conn, HDR.size, "head"))
                await handshake.recv_exact(loop, conn, length, "hello")  # the analysis's hello, one frame
                # the first stream ends inside a data frame; the second is a whole one (same relay)
                await loop.sock_sendall(conn, _hello("r1") + tail)
                if n == 0:
                    conn.close()
                else:
                    assert await a.wait_attached(30), a.last_error
                    assert a.attached and not a.last_error and a.attaches == 2
                    assert a.reader.torn_frames == 1 and a.snapshot()["torn_frames"] == 1
                    conn.close()
        finally:
            await a.aclose()
            server.close()

    asyncio.run(main())


def test_a_reader_restarted_between_streams_drops_only_the_torn_bytes() -> None:
    from shadow.mirror.channel_reader import ChannelReader

    r = ChannelReader()
    whole = _hello("r1")
    r.feed(whole + whole[:3])
    assert r.restart() == 3 and r.torn_frames == 1
    r.feed(_hello("r1") + _snapshot_mark())
    assert r.snapshot_done and r.hello["relay_id"] == "r1"
    assert r.restart() == 0 and r.torn_frames == 1  # nothing torn: nothing counted
