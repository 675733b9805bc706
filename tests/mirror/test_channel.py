"""The relay → analysis hand-off: frames round-trip into the items the analyzer reads; a full
hand-off drops and counts data but never an end; marks carry the relay's counters; what the relay
keeps makes the snapshot an attaching analysis gets (nothing twice on a resume, everything not yet
acknowledged on a fresh attach, `relay_lost` ends when the relay changes); acks release it. Several
analyses attach side by side by name (replicas behind the same taps): each gets every frame, and
what is kept is released only once every one of them has it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import pytest

from shadow.contracts.tapwire import END_RELAY_LOST, TapContext
from shadow.dataplane.channel import ChannelSink
from shadow.mirror.channel_reader import ChannelReader

HELLO = {"relay_id": "r1", "boot_id": "b", "taps": []}


def _ctx(rid: str) -> TapContext:
    return TapContext("d0", "POST", "/v1/completions", rid, b'{"prompt":"p"}', 14, 1.5)


def _pump(
    sink: ChannelSink, reader: ChannelReader, rx: socket.socket
) -> list[tuple[TapContext, int, float, Any]]:
    sink.flush()
    rx.setblocking(False)
    items = []
    while True:
        try:
            chunk = rx.recv(1 << 20)
        except BlockingIOError:
            return items
        if not chunk:
            return items
        items += reader.feed(chunk)


def _view(items: list[tuple[TapContext, int, float, Any]]) -> list[tuple[Any, ...]]:
    return [(i[0].request_id, i[1], i[2], i[3]) for i in items]


def test_round_trip_drops_ends_and_marks() -> None:
    async def main() -> None:
        tx, rx = socket.socketpair()
        sink = ChannelSink(maxsize=3)
        reader = ChannelReader(boot_id="b")
        sink.attach(tx, HELLO)
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
        assert _view(items) == [
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
        assert reader.relay_id == "r1" and reader.snapshot_done and reader.offset == 0.0  # same boot
        a.seq = 3
        assert sink.put((a, 3, 1.5, b"z"), 1)  # after a flush the hand-off has room again
        sink.put_end((a, -1, 1.6, "complete"))
        more = _pump(sink, reader, rx)
        assert [(i[1], i[0].seq) for i in more] == [(3, 3), (-1, 3)]
        assert len(reader) == 0  # ended requests are forgotten
        tx.close()
        rx.close()

    asyncio.run(main())


def test_a_gone_analysis_never_blocks_or_raises_in_the_relay_and_copies_are_kept() -> None:
    async def main() -> None:
        tx, rx = socket.socketpair()
        rx.close()
        sink = ChannelSink()
        sink.attach(tx, HELLO)
        c = _ctx("a")
        sink.put((c, 0, 1.0, None))
        sink.flush()  # EPIPE: the analysis is detached; keeping goes on
        assert not sink.attached
        assert not sink.put((c, 1, 1.1, b"x"), 1)
        assert sink.live == 1 and sink.detached_items == 1

    asyncio.run(main())


def _stream(sink: ChannelSink, ctx: TapContext, n: int, t0: float) -> None:
    sink.put((ctx, 0, t0, None))
    ctx.status, ctx.resp_headers = 200, {"content-type": "text/event-stream"}
    for i in range(1, n + 1):
        ctx.seq = i
        sink.put((ctx, i, t0 + i, b"data: %d\n\n" % i), 10)


def test_a_fresh_analysis_gets_every_kept_request_once_and_acks_release_them() -> None:
    async def main() -> None:
        sink = ChannelSink()
        live, ended, acked = _ctx("live"), _ctx("ended"), _ctx("acked")
        _stream(sink, acked, 1, 0.0)
        sink.put_end((acked, -1, 2.0, "complete"))
        sink.ack(sink.end_no)  # an earlier analysis processed and recorded it
        _stream(sink, live, 2, 10.0)  # detached: kept, not sent
        _stream(sink, ended, 1, 20.0)
        sink.put_end((ended, -1, 22.0, "complete"))
        assert sink.live == 1 and len(sink._kept) == 2
        tx, rx = socket.socketpair()
        reader = ChannelReader(boot_id="b")
        assert sink.attach(tx, HELLO) == 2
        items = _pump(sink, reader, rx)
        assert _view(items) == [
            ("live", 0, 10.0, None),
            ("live", 1, 11.0, b"data: 1\n\n"),
            ("live", 2, 12.0, b"data: 2\n\n"),
            ("ended", 0, 20.0, None),
            ("ended", 1, 21.0, b"data: 1\n\n"),
            ("ended", -1, 22.0, "complete"),
        ]
        assert reader.snapshot_done and reader.snapshot["requests"] == 2 and reader.snapshot["live"] == 1
        assert reader.end_seen == sink.end_no
        live.seq = 3
        sink.put((live, 3, 13.0, b"data: 3\n\n"), 10)  # then the live stream goes on
        assert _view(_pump(sink, reader, rx)) == [("live", 3, 13.0, b"data: 3\n\n")]
        sink.ack(reader.end_seen)
        assert len(sink._kept) == 1 and sink.live == 1  # the ended one is released, the live one kept
        tx.close()
        rx.close()

    asyncio.run(main())


def test_a_resume_skips_what_the_reader_has_and_another_relay_ends_what_was_open() -> None:
    async def main() -> None:
        sink = ChannelSink()
        a, b = _ctx("a"), _ctx("b")
        tx, rx = socket.socketpair()
        reader = ChannelReader(boot_id="b")
        sink.attach(tx, HELLO)
        _stream(sink, a, 2, 0.0)
        _stream(sink, b, 1, 5.0)
        sink.put_end((b, -1, 7.0, "complete"))
        first = _pump(sink, reader, rx)
        assert len(first) == 6
        tx.close()
        rx.close()  # the connection broke; the relay kept everything (nothing was acked)
        a.seq = 3
        sink.put((a, 3, 3.0, b"data: 3\n\n"), 10)  # while detached
        tx, rx = socket.socketpair()
        sink.attach(tx, HELLO, resume_end=reader.end_seen)  # same relay: resume
        again = _pump(sink, reader, rx)
        assert _view(again) == [("a", 3, 3.0, b"data: 3\n\n")]  # only what it had not seen
        assert reader.skipped == 3  # a's start and two chunks came again and were skipped
        tx.close()
        rx.close()
        # another relay answers now (the first one died): what was open there is lost
        other = ChannelSink()
        tx, rx = socket.socketpair()
        other.attach(tx, {**HELLO, "relay_id": "r2"})
        lost = _pump(other, reader, rx)
        assert [(i[0].request_id, i[1], i[3]) for i in lost] == [("a", -1, END_RELAY_LOST)]
        assert reader.relay_id == "r2" and len(reader) == 0
        tx.close()
        rx.close()

    asyncio.run(main())


def test_two_named_analyses_each_get_every_frame_and_their_own_marks() -> None:
    async def main() -> None:
        sink = ChannelSink(maxsize=4)
        (ta, ra), (tb, rb) = socket.socketpair(), socket.socketpair()
        reader_a, reader_b = ChannelReader(boot_id="b"), ChannelReader(boot_id="b")
        sink.attach(ta, HELLO, name="replica-a")
        c = _ctx("one")
        _stream(sink, c, 2, 0.0)  # before b attaches: b gets it in its snapshot
        sink.attach(tb, HELLO, name="replica-b")
        assert sink.attached == 2 and sorted(sink.analyses) == ["replica-a", "replica-b"]
        c.seq = 3
        sink.put((c, 3, 3.0, b"data: 3\n\n"), 10)
        sink.put_end((c, -1, 4.0, "complete"))
        sink.mark(5, {"taps": {}}, to="replica-b")  # the answer to b's sync: b's only
        want = [("one", 0, 0.0, None), ("one", 1, 1.0, b"data: 1\n\n"), ("one", 2, 2.0, b"data: 2\n\n"),
                ("one", 3, 3.0, b"data: 3\n\n"), ("one", -1, 4.0, "complete")]
        assert _view(_pump(sink, reader_a, ra)) == want
        assert _view(_pump(sink, reader_b, rb)) == want
        assert (reader_a.token, reader_b.token) == (0, 5)
        assert reader_b.offered == 2  # b's counters count what was offered to b since it attached
        # a full hand-off drops for the analysis that is behind, not for the other one: b stops
        # reading (its socket's buffer is filled), a goes on
        tb.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                tb.send(bytes(65536))
        d = _ctx("two")
        sink.put((d, 0, 5.0, None))
        _pump(sink, reader_a, ra)
        for i in range(1, 6):
            d.seq = i
            sink.put((d, i, 5.0 + i, b"x"), 1)
            _pump(sink, reader_a, ra)
        _pump(sink, reader_a, ra)
        assert sink.dropped_total == 2 and reader_a.dropped == 0 and len(reader_a) == 1
        for s in (ta, ra, tb, rb):
            s.close()

    asyncio.run(main())


def test_what_one_analysis_has_not_acknowledged_stays_kept_and_a_name_replaces_its_own() -> None:
    async def main() -> None:
        sink = ChannelSink()
        (ta, ra), (tb, rb) = socket.socketpair(), socket.socketpair()
        reader_a, reader_b = ChannelReader(boot_id="b"), ChannelReader(boot_id="b")
        sink.attach(ta, HELLO, name="a")
        sink.attach(tb, HELLO, name="b")
        c = _ctx("done")
        _stream(sink, c, 1, 0.0)
        sink.put_end((c, -1, 2.0, "complete"))
        _pump(sink, reader_a, ra)
        _pump(sink, reader_b, rb)
        sink.ack(reader_a.end_seen, "a")
        assert sink.kept_requests == 1  # b has not acknowledged it yet
        sink.ack(reader_b.end_seen, "b")
        assert sink.kept_requests == 0
        # b goes away with an end unacknowledged: it stays kept for b's return, a's ack notwithstanding
        e = _ctx("open-for-b")
        _stream(sink, e, 1, 3.0)
        _pump(sink, reader_b, rb)
        sink.detach("b")
        assert sink.attached == 1
        sink.put_end((e, -1, 4.0, "complete"))
        _pump(sink, reader_a, ra)
        sink.ack(reader_a.end_seen, "a")
        assert sink.kept_requests == 1
        tb2, rb2 = socket.socketpair()
        sink.attach(tb2, HELLO, resume_end=reader_b.end_seen, name="b")  # b resumes: its end arrives
        assert [(i[0].request_id, i[1]) for i in _pump(sink, reader_b, rb2)] == [("open-for-b", -1)]
        assert len(reader_b) == 0  # nothing left open in b's mirror: no phantom
        # an analysis attaching under a name already attached replaces that one only
        ta2, ra2 = socket.socketpair()
        sink.attach(ta2, HELLO, name="a")
        assert sink.attached == 2 and sink.attaches == 4
        with pytest.raises(OSError):  # the replaced socket is closed by the sink
            ta.send(b"x")
        for s in (ra, tb, rb, rb2, ta2, ra2, tb2):
            s.close()

    asyncio.run(main())


def test_bounds_of_what_is_kept_are_counted() -> None:
    async def main() -> None:
        sink = ChannelSink(retain_bytes=200, retain_ended=1)
        a = _ctx("a")
        _stream(sink, a, 20, 0.0)  # 20 chunks of ~30 bytes: only some fit
        assert sink.unkept > 0 and sink.kept_bytes <= 200 + 400  # info/start frames always kept
        sink = ChannelSink(retain_ended=1)
        for rid in ("e1", "e2"):
            c = _ctx(rid)
            sink.put((c, 0, 0.0, None))
            sink.put_end((c, -1, 1.0, "complete"))
        assert sink.missed == 1 and len(sink._ended) == 1  # the oldest unacknowledged end dropped
        # ended requests' heads (their bodies) count against retain_bytes too: with no analysis to
        # acknowledge them, the oldest go once the kept bytes pass it, however few they are
        sink = ChannelSink(retain_bytes=10_000)
        for i in range(10):
            c = TapContext("d0", "POST", "/v1/completions", f"big{i}", bytes(3000), 3000, 1.5)
            sink.put((c, 0, 0.0, None))
            sink.put_end((c, -1, 1.0, "complete"))
        assert sink.kept_bytes <= 10_000 and sink.missed >= 7 and sink.kept_requests == 10 - sink.missed

    asyncio.run(main())


def test_times_move_onto_this_hosts_clock_when_the_relay_is_on_another() -> None:
    async def main() -> None:
        sink = ChannelSink()
        tx, rx = socket.socketpair()
        reader = ChannelReader(boot_id="this-host")
        sink.attach(tx, {**HELLO, "boot_id": "other-host"})
        c = _ctx("a")
        sink.put((c, 0, 100.0, None))
        (item,) = _pump(sink, reader, rx)
        assert reader.offset != 0.0 and item[2] == 100.0 + reader.offset
        tx.close()
        rx.close()

    asyncio.run(main())


TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_the_traceparent_reaches_the_analysis_in_the_ten_field_info_frame() -> None:
    """The request head's traceparent arrives with the request, in a field of its own of the info
    frame (not among the response headers the analysis reads)."""
    from shadow.contracts.frames import T_INFO, FrameReader, decode_info, frame_bound

    async def main() -> None:
        tx, rx = socket.socketpair()
        sink = ChannelSink()
        reader = ChannelReader(boot_id="b")
        sink.attach(tx, HELLO)
        a = TapContext("d0", "POST", "/v1/completions", "a", b"{}", 2, 1.5, TP)
        b = _ctx("b")  # no traceparent
        sink.put((a, 0, 1.0, None))
        sink.put((b, 0, 1.0, None))
        a.status, a.resp_headers = 200, {"content-type": "text/event-stream"}
        sink.put_end((a, -1, 1.2, "complete"))  # the second info frame (with the answer's head)
        sink.put_end((b, -1, 1.2, "complete"))
        items = _pump(sink, reader, rx)
        got = {i[0].request_id: i[0] for i in items}
        assert got["a"].traceparent == TP and got["b"].traceparent is None
        assert got["a"].resp_headers == {"content-type": "text/event-stream"}
        assert a.resp_headers == {"content-type": "text/event-stream"}  # the relay's own is untouched
        frames = FrameReader(frame_bound(4 << 20)).feed(b"".join(a.kept or []))
        infos = [decode_info(body) for kind, body in frames if kind == T_INFO]
        assert [(i.traceparent, i.status, i.body) for i in infos] == [(TP, 0, b"{}"), (TP, 200, b"{}")]
        tx.close()
        rx.close()

    asyncio.run(main())


def test_a_snapshot_carries_the_traceparent_to_an_analysis_attaching_later() -> None:
    async def main() -> None:
        sink = ChannelSink()
        live = TapContext("d0", "POST", "/v1/completions", "live", b"{}", 2, 1.5, TP)
        sink.put((live, 0, 1.0, None))  # no analysis attached: only kept
        tx, rx = socket.socketpair()
        reader = ChannelReader(boot_id="b")
        assert sink.attach(tx, HELLO) == 1
        (item,) = _pump(sink, reader, rx)
        assert item[0].request_id == "live" and item[0].traceparent == TP
        tx.close()
        rx.close()

    asyncio.run(main())


def test_a_broken_analysis_is_told_to_the_sinks_owner_before_its_socket_is_closed() -> None:
    """The relay watches each analysis's socket for control frames: it must stop before the sink
    closes it (a closed socket left watched woke the relay's loop for ever, in CI)."""

    async def main() -> None:
        sink = ChannelSink()
        told: list[tuple[str, bool]] = []
        sink.on_detach = lambda name, s: told.append((name, s.fileno() >= 0))
        tx, rx = socket.socketpair()
        rx.close()
        sink.attach(tx, HELLO, name="a")
        sink.put((_ctx("x"), 0, 1.0, None))
        sink.flush()  # EPIPE: detached
        assert told == [("a", True)] and tx.fileno() == -1 and sink.attached == 0

    asyncio.run(main())
