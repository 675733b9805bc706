"""The relay → analysis hand-off across processes: frames round-trip into the items the analyzer
reads; a full hand-off drops and counts data but never an end; marks carry the relay's counters."""

from __future__ import annotations

import asyncio
import socket

from shadow.mirror.channel import ChannelReader, ChannelSink
from shadow.mirror.proxy import TapContext


def _ctx(rid: str) -> TapContext:
    return TapContext("d0", "POST", "/v1/completions", rid, b'{"prompt":"p"}', 14, 1.5)


def _pump(
    sink: ChannelSink, reader: ChannelReader, rx: socket.socket
) -> list[tuple[TapContext, int, float, object]]:
    sink.flush()
    rx.setblocking(False)
    items = []
    while True:
        try:
            chunk = rx.recv(1 << 20)
        except BlockingIOError:
            return items
        items += reader.feed(chunk)


def test_round_trip_drops_ends_and_marks() -> None:
    async def main() -> None:
        tx, rx = socket.socketpair()
        sink = ChannelSink(tx, maxsize=3)
        reader = ChannelReader()
        a, b = _ctx("a"), _ctx("b")
        assert sink.put((a, 0, 1.0, None))
        a.status, a.resp_headers = 200, {"content-type": "text/event-stream"}
        a.seq = 1
        assert sink.put((a, 1, 1.1, b"data: x\n\n"), 9)
        a.seq = 2
        assert sink.put((a, 2, 1.2, b"data: y\n\n"), 9)
        assert not sink.put((b, 0, 1.3, None))  # full: dropped and counted
        b.ended = True
        sink.put_end((b, -1, 1.4, "client_cancel"))  # never dropped, even when full
        sink.mark(7, {"taps": {"d0": {"requests": 2}}})
        items = _pump(sink, reader, rx)
        assert [(i[0].request_id, i[1], i[2], i[3]) for i in items] == [
            ("a", 0, 1.0, None),
            ("a", 1, 1.1, b"data: x\n\n"),
            ("a", 2, 1.2, b"data: y\n\n"),
            ("b", -1, 1.4, "client_cancel"),  # its info still came (the start was dropped)
        ]
        ra, rb = items[0][0], items[3][0]
        assert (
            ra is items[2][0] and ra.status == 200 and ra.resp_headers["content-type"] == "text/event-stream"
        )
        assert ra.body == b'{"prompt":"p"}' and ra.path == "/v1/completions" and ra.t_start == 1.5
        assert rb.ended and rb.method == "POST"
        assert (reader.offered, reader.dropped, reader.token) == (5, 1, 7)
        assert reader.offered == len(items) + reader.dropped  # the watermark identity at a mark
        assert reader.stats["taps"]["d0"]["requests"] == 2
        # after a flush the hand-off has room again
        a.seq = 3
        assert sink.put((a, 3, 1.5, b"z"), 1)
        sink.put_end((a, -1, 1.6, "complete"))
        more = _pump(sink, reader, rx)
        assert [(i[1], i[0].seq) for i in more] == [(3, 3), (-1, 3)]
        assert len(reader) == 0  # ended requests are forgotten
        tx.close()
        rx.close()

    asyncio.run(main())


def test_a_gone_analysis_side_never_blocks_or_raises_in_the_relay() -> None:
    async def main() -> None:
        tx, rx = socket.socketpair()
        rx.close()
        sink = ChannelSink(tx)
        c = _ctx("a")
        sink.put((c, 0, 1.0, None))
        sink.flush()  # EPIPE: the sink breaks, counts, and keeps accepting calls
        assert sink.broken
        assert not sink.put((c, 1, 1.1, b"x"), 1)
        sink.put_end((c, -1, 1.2, "complete"))
        assert sink.dropped == sink.offered == 3
        tx.close()

    asyncio.run(main())
