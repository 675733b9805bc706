"""HTTP/1.1 pieces the tap needs around llhttp (httptools): limits, the path allow-list, header
filtering and the canned responses it answers itself. No framing is parsed here (llhttp does).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from shadow.base import listener
from shadow.base.hopbyhop import HOP_BY_HOP_BYTES
from shadow.base.knobs import AT_LEAST_ONE, POSITIVE_S, knob
from shadow.contracts.ids import request_hash

# The inference API (OpenAI-compatible, vLLM's side endpoints) — what a router sends a worker.
# An entry ending in "/" is a prefix; any other entry must match the whole path.
DEFAULT_ALLOW_PATHS: tuple[str, ...] = (
    "/v1/",
    "/health",
    "/ping",
    "/version",
    "/metrics",
    "/load",
    "/get_load",
    "/get_server_info",
    "/get_model_info",
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/score",
    "/rerank",
    "/invocations",
)

#: not relayed by a tap: the hop-by-hop headers but Transfer-Encoding (a body's framing is relayed
#: as it came, its header with it), and Expect (the tap answers it)
HOP_BY_HOP = (HOP_BY_HOP_BYTES - {b"transfer-encoding"}) | {b"expect"}


@dataclass(frozen=True)
class TapLimits:
    """Per-tap caps and timeouts; every one has a counter in `Tap.rejected` when it bites."""

    max_head: int = knob(64 << 10, "--max-head", "request head size cap (request line + headers), 431 beyond",
                         AT_LEAST_ONE, metavar="BYTES")
    max_headers: int = 128  # header lines per message (431 beyond)
    # never while its bytes wait unread or the loop was stalled (`front.Conn`)
    header_timeout_s: float = knob(10.0, "--header-timeout", "a request head begun must be complete within "
                                   "this, else 408; also a body's longest silence", POSITIVE_S, metavar="S")
    idle_timeout_s: float = knob(60.0, "--idle-timeout", "a connection without a request, new or kept alive, "
                                 "is closed after this, with no answer", POSITIVE_S, metavar="S")
    max_connections: int = knob(4096, "--max-connections", "client connections per tap; beyond it the oldest "
                                "idle one is closed, else 503", AT_LEAST_ONE)
    max_buffer: int = 256 << 10  # request bytes held (upstream not writable, pipelined) before reading pauses
    # Pooled upstream connections idle longer are not reused. Servers (vLLM/uvicorn) close idle
    # keep-alive connections after 5 s counted from when they sent the response end; the tap stamps
    # a connection when its relay thread has processed that end, which on a busy host can be over a
    # second later — so the margin is 3 s, not 1 s (seen: a POST on a connection the worker had just
    # closed, answered 502 not-resent, ~1 in 400 decode legs of `shadow demo` under load 11 on 2 cores).
    pool_idle_s: float = 2.0
    linger_s: float = 5.0  # after a last response: read and drop what the client still sends (0: off)
    linger_bytes: int = 1 << 20  # ... this many at most (beyond: closed at once)
    allow_paths: tuple[str, ...] = DEFAULT_ALLOW_PATHS


def canned(status: int, reason: str, message: str) -> bytes:
    """A complete JSON error response that closes the connection."""
    return listener.canned(status, reason, message, "shadow tap")


BAD_REQUEST = canned(400, "Bad Request", "malformed or ambiguous HTTP/1.1 framing")
BAD_GATEWAY = canned(502, "Bad Gateway", "upstream unavailable")
NOT_RESENT = canned(
    502, "Bad Gateway", "upstream closed before answering; a non-idempotent request is not resent"
)
HEAD_TOO_LARGE = canned(431, "Request Header Fields Too Large", "request head too large")
TIMEOUT = canned(408, "Request Timeout", "request head not received in time")
BODY_TIMEOUT = canned(408, "Request Timeout", "request body not received in time")
BUSY = canned(503, "Service Unavailable", "connection limit reached")
NOT_RELAYED = canned(404, "Not Found", "path not relayed by this tap (see --allow-path)")
NO_UPGRADE = canned(501, "Not Implemented", "protocol upgrades are not relayed")
IDEMPOTENT = frozenset((b"GET", b"HEAD", b"OPTIONS"))


def bad_head(fault: str) -> bytes:
    """The 400 for a request head `front.head_fault` refuses, naming why."""
    return listener.bad_head(fault, "shadow tap")


def path_allowed(target: bytes, allow: tuple[str, ...]) -> bool:
    """True when the request target's path (percent-decoded, no dot segments) is on the allow-list.

    Absolute-form targets are judged by their path; a path with `.`/`..` segments, a backslash or
    an encoded slash is refused whatever the list says (upstreams normalise them differently).
    """
    try:
        raw = target.decode("ascii")
    except UnicodeDecodeError:
        return False
    if not raw.startswith("/"):
        if not raw.lower().startswith(("http://", "https://")):
            return False
        raw = urllib.parse.urlsplit(raw).path or "/"
    path = raw.split("?", 1)[0].split("#", 1)[0]
    low = path.lower()
    if "\\" in path or "%2f" in low or "%5c" in low:
        return False
    path = urllib.parse.unquote(path)
    if not path.startswith("/") or any(seg in (".", "..") for seg in path.split("/")) or "//" in path:
        return False
    return any(path.startswith(a) if a.endswith("/") else path == a for a in allow)


def connection_tokens(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    """Lower-cased tokens of every Connection header."""
    out: set[bytes] = set()
    for n, v in headers:
        if n.lower() == b"connection":
            out.update(t.strip().lower() for t in v.split(b","))
    return out


def kept_headers(
    headers: list[tuple[bytes, bytes]], drop_extra: frozenset[bytes] = frozenset()
) -> list[bytes]:
    """`name: value` lines without hop-by-hop headers (nor those named by Connection, nor `drop_extra`)."""
    drop = HOP_BY_HOP | drop_extra
    conn = connection_tokens(headers)
    conn.discard(b"transfer-encoding")  # framing headers are the tap's business, never the peer's choice
    conn.discard(b"content-length")
    conn.discard(b"host")
    return [n + b": " + v for n, v in headers if (k := n.lower()) not in drop and k not in conn]


MAX_TRACEPARENT = 128  # a W3C traceparent is 55 characters (version 00); longer values are not kept


def head_ids(headers: list[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """The hash of the request's `X-Request-Id` (`contracts.ids.request_hash`: the id itself is
    never kept) and its W3C `traceparent` (the first of each; a traceparent as sent, None over
    MAX_TRACEPARENT): what the analysis reads of a request head besides its line."""
    rid: bytes | None = None
    tp: bytes | None = None
    for n, v in headers:
        k = n.lower()
        if rid is None and k == b"x-request-id":
            rid = v
        elif tp is None and k == b"traceparent":
            tp = v.strip()
        else:
            continue
        if rid is not None and tp is not None:
            break
    return (request_hash(rid.decode("latin-1")) if rid else None,
            tp.decode("latin-1") if tp and len(tp) <= MAX_TRACEPARENT else None)
