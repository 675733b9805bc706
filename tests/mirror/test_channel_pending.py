"""What a relay holds for analyses that do not read: data copies beyond an analysis's share of
`max_bytes` (the total over every attached analysis) are dropped for it and counted; what cannot
be dropped (heads, ends, marks) past another share (or one largest head) detaches it at once
(`overflow`); one whose socket takes nothing for `stall_s` while its share is full is detached
(`stalled`); a detached one's pending copies are released. A snapshot refers to the kept copies
instead of copying them."""

from __future__ import annotations

import asyncio
import socket

from shadow.contracts.frames import frame_bound
from shadow.contracts.tapwire import TapContext
from shadow.dataplane.channel import STALL_S, ChannelSink
from shadow.mirror.channel_reader import ChannelReader

HELLO = {"relay_id": "r1", "boot_id": "b", "taps": []}
PAYLOAD = b"data: " + bytes(1000) + b"\n\n"


def _small_pair() -> tuple[socket.socket, socket.socket]:
    """A socket pair with the smallest kernel buffers: what the relay sends fills them at once."""
    tx, rx = socket.socketpair()
    for s in (tx, rx):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return tx, rx


def _ctx(rid: str) -> TapContext:
    return TapContext("d0", "POST", "/v1/completions", rid, b"{}", 2, 1.0)


async def _turn() -> None:
    for _ in range(3):  # the sink writes (and detaches) on the next turns of the loop
        await asyncio.sleep(0)


def test_analyses_that_never_read_hold_at_most_their_share_then_are_detached_and_released() -> None:
    async def main() -> None:
        sink = ChannelSink(max_bytes=256 << 10)
        pairs = {name: _small_pair() for name in ("a", "b")}
        for name, (tx, _) in pairs.items():
            sink.attach(tx, HELLO, name=name)
        c = _ctx("r")
        sink.put((c, 0, 1.0, None))
        for seq in range(1, 2001):  # 2 MB of copies, eight times the cap; nobody reads
            c.seq = seq
            sink.put((c, seq, 1.0 + seq, PAYLOAD), len(PAYLOAD))
            if seq % 50 == 0:
                await _turn()
        share = sink.max_bytes // 2
        assert sink.dropped_total > 2000 and sink.attached == 2
        assert all(a.bytes <= share for a in sink._subs.values())  # each within its share
        assert sink.pending_bytes <= sink.max_bytes  # all together within the cap
        # their sockets took nothing for stall_s with their shares full: detached, released
        assert sink.reap() == []  # (not yet)
        assert sorted(sink.reap(sink._subs["a"].full_since + STALL_S + 1)) == ["a", "b"]
        assert sink.detached["stalled"] == 2 and sink.attached == 0 and sink.pending_bytes == 0
        assert sink.kept_requests == 1  # what they had not acknowledged stays kept for their return
        for tx, rx in pairs.values():
            rx.close()
            assert tx.fileno() == -1

    asyncio.run(main())


def test_an_analysis_that_reads_slowly_is_not_stalled() -> None:
    """It drops copies (its share fills) but its socket keeps taking bytes: stalled only once it
    has taken nothing for stall_s."""

    async def main() -> None:
        sink = ChannelSink(max_bytes=64 << 10)
        tx, rx = _small_pair()
        sink.attach(tx, HELLO, name="slow")
        c = _ctx("r")
        sink.put((c, 0, 1.0, None))
        rx.setblocking(False)
        for seq in range(1, 301):
            c.seq = seq
            sink.put((c, seq, 1.0, PAYLOAD), len(PAYLOAD))
            await _turn()
            if seq % 10 == 0:  # it reads now and then: its socket keeps taking bytes
                while True:
                    try:
                        rx.recv(1 << 16)
                    except BlockingIOError:
                        break
                await _turn()
                sub = sink._subs["slow"]
                assert sink.reap(sub.sent_at + STALL_S / 2) == []
        sub = sink._subs["slow"]
        assert sink.dropped_total > 0 and sub.full_since is not None and sub.sent_at >= sub.full_since
        assert sink.reap(sub.sent_at + STALL_S + 1) == ["slow"]
        rx.close()
        tx.close()

    asyncio.run(main())


def test_what_cannot_be_dropped_past_its_limit_detaches_an_analysis_at_once() -> None:
    async def main() -> None:
        sink = ChannelSink(max_bytes=64 << 10, max_body=1 << 10)
        tx, rx = _small_pair()
        sink.attach(tx, HELLO, name="deaf")
        limit = sink.max_bytes + frame_bound(sink.max_body)
        n = 0
        while sink.attached:  # request ends (never dropped) until its pending passes the limit
            c = _ctx(f"r{n}")
            sink.put((c, 0, 1.0, None))
            sink.put_end((c, -1, 2.0, "complete"))
            n += 1
            if sink.attached and sink._subs["deaf"].bytes > limit:
                await _turn()
                break
        assert sink.detached["overflow"] == 1 and sink.attached == 0 and sink.pending_bytes == 0
        rx.close()

    asyncio.run(main())


def test_a_snapshot_refers_to_the_kept_copies_and_is_joined_as_it_is_written() -> None:
    async def main() -> None:
        sink = ChannelSink()
        kept = [_ctx(f"k{i}") for i in range(3)]
        for c in kept:
            sink.put((c, 0, 1.0, None))
            c.seq = 1
            sink.put((c, 1, 1.5, PAYLOAD), len(PAYLOAD))
        tx, rx = socket.socketpair()
        assert sink.attach(tx, HELLO, name="late") == 3
        sub = sink._subs["late"]
        snapshot = [e for e in sub.out if e[1] < 0]
        assert [e[0] for e in snapshot] == [c.kept for c in kept]  # the very lists: nothing copied
        assert all(e[0] is c.kept for e, c in zip(snapshot, kept, strict=True))
        assert sink.pending_bytes < 1000  # the hello and the mark only
        reader = ChannelReader(boot_id="b")
        sink.flush()
        rx.setblocking(False)
        items = []
        while not reader.snapshot_done:
            items += reader.feed(rx.recv(1 << 20))
        assert [(i[0].request_id, i[1], i[3]) for i in items] == [
            (f"k{n}", s, p) for n in range(3) for s, p in ((0, None), (1, PAYLOAD))
        ]
        tx.close()
        rx.close()

    asyncio.run(main())
