"""TCP reassembly of one direction of a connection, from segments seen on the wire (in any order,
duplicated, retransmitted, overlapping), bounded and with counted gaps.

`Direction.add(seq, payload, syn, fin)` returns what became contiguous: byte strings in stream
order, and `GAP` where bytes were never seen and the direction moved on (its out-of-order buffer
grew past `max_pending`, or the stream ended with a hole). Sequence numbers wrap at 2^32.
"""

from __future__ import annotations

from typing import Final

GAP: Final = None  # a hole in the stream (its size is counted in `gap_bytes`)
_MOD = 1 << 32
_HALF = 1 << 31


def seq_delta(a: int, b: int) -> int:
    """a − b in sequence space (negative: a is before b)."""
    return ((a - b + _HALF) % _MOD) - _HALF


class Direction:
    """One direction's reassembly state (see module docstring)."""

    __slots__ = (
        "delivered",
        "fin",
        "gap_bytes",
        "gaps",
        "max_pending",
        "next",
        "pending",
        "pending_bytes",
        "retransmitted",
    )

    def __init__(self, max_pending: int = 256 << 10) -> None:
        self.max_pending = max_pending
        self.next: int | None = None  # the next sequence number to deliver
        self.pending: dict[int, bytes] = {}  # out-of-order segments by sequence number
        self.pending_bytes = 0
        self.delivered = 0
        self.gap_bytes = 0
        self.gaps = 0
        self.retransmitted = 0
        self.fin = False

    def add(self, seq: int, payload: bytes, syn: bool = False, fin: bool = False) -> list[bytes | None]:
        out: list[bytes | None] = []
        if syn:
            if self.next is None:
                self.next = (seq + 1) % _MOD
            seq = (seq + 1) % _MOD  # data on a SYN starts after it
        if self.next is None:  # the capture started mid-connection: take the stream from here
            self.next = seq
        if payload:
            d = seq_delta(seq, self.next)
            if d < 0:  # (partly) seen before
                if -d >= len(payload):
                    self.retransmitted += 1
                    payload = b""
                else:
                    payload, seq = payload[-d:], self.next
            if payload:
                if seq == self.next:
                    out.append(payload)
                    self._advance(len(payload))
                    self._drain(out)
                elif seq not in self.pending or len(self.pending[seq]) < len(payload):
                    self.pending_bytes += len(payload) - len(self.pending.get(seq, b""))
                    self.pending[seq] = payload
                    if self.pending_bytes > self.max_pending:
                        self._skip(out)
        if fin:
            self.fin = True
            if self.pending:
                self._skip(out, to_end=True)
        return out

    def _advance(self, n: int) -> None:
        assert self.next is not None
        self.next = (self.next + n) % _MOD
        self.delivered += n

    def _drain(self, out: list[bytes | None]) -> None:
        """Deliver pending segments that have become contiguous."""
        while self.pending:
            nxt = self.next
            assert nxt is not None
            hit = self.pending.pop(nxt, None)
            if hit is None:
                # a pending segment overlapping `next` (sent again with other boundaries)
                over = [s for s in self.pending if seq_delta(s, nxt) < 0]
                if not over:
                    return
                for s in over:
                    data = self.pending.pop(s)
                    self.pending_bytes -= len(data)
                    end = seq_delta(s, nxt) + len(data)
                    if end > 0:
                        self.pending[nxt] = data[-end:]
                        self.pending_bytes += end
                continue
            self.pending_bytes -= len(hit)
            out.append(hit)
            self._advance(len(hit))

    def _skip(self, out: list[bytes | None], to_end: bool = False) -> None:
        """Give up on the hole before the earliest pending segment (and, at the end, on every one)."""
        while self.pending and (to_end or self.pending_bytes > self.max_pending):
            assert self.next is not None
            first = min(self.pending, key=lambda s: seq_delta(s, self.next or 0))
            hole = seq_delta(first, self.next)
            if hole > 0:
                self.gap_bytes += hole
                self.gaps += 1
                out.append(GAP)
                self.next = first
            self._drain(out)
