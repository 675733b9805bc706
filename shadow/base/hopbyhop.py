"""The hop-by-hop headers (RFC 9110 §7.6.1): they describe one connection and no proxy relays them.

One list for the taps (`shadow.dataplane.http1`, as bytes) and the active proxy's shadow-mode
passthrough (`shadow.active.passthrough`); each says beside it what it drops more or keeps: a tap
relays a body's framing as it came (its Transfer-Encoding with it) and answers Expect itself; the
proxy re-frames every body (Host, Content-Length, Transfer-Encoding are its own) and consumes proxy
credentials.
"""

from __future__ import annotations

HOP_BY_HOP: frozenset[str] = frozenset(
    ("connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade")
)
HOP_BY_HOP_BYTES: frozenset[bytes] = frozenset(h.encode("ascii") for h in HOP_BY_HOP)
