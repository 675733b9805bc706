"""Optional (`--inject-usage`, off by default): ask the worker for continuous usage, hide it from the client.

`inject_request(body)` returns the request body with `stream_options.include_usage` and
`continuous_usage_stats` turned on, plus what to strip from the response so the client sees what it
asked for: STRIP_ALL (no usage at all: drop `usage` keys and the usage-only final chunk) or
STRIP_CONTINUOUS (only the final usage chunk); None when nothing needs injecting. `FrameRewriter`
applies that to the de-chunked SSE body, frame by frame. The analysis copy keeps the usage.
"""

from __future__ import annotations

import json
from typing import Any

STRIP_ALL = 2
STRIP_CONTINUOUS = 1


def inject_request(body: bytes) -> tuple[bytes, int] | None:
    """New body and strip mode for a streaming JSON request, or None (leave the request alone)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("stream") is not True:
        return None
    so = obj.get("stream_options")
    if so is not None and not isinstance(so, dict):
        return None
    so = dict(so or {})
    wants_usage = so.get("include_usage") is True
    if wants_usage and so.get("continuous_usage_stats") is True:
        return None
    so["include_usage"] = True
    so["continuous_usage_stats"] = True
    obj["stream_options"] = so
    new = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    return new, (STRIP_CONTINUOUS if wants_usage else STRIP_ALL)


def _without_usage(frame: bytes) -> bytes:
    """Remove the top-level "usage" member, textually when it is not the first member."""
    key = b',"usage":{'
    i = frame.rfind(key)
    if i >= 0:
        j = i + len(key)
        depth = 1
        n = len(frame)
        while j < n and depth:
            c = frame[j]
            if c == 0x7B:
                depth += 1
            elif c == 0x7D:
                depth -= 1
            j += 1
        if depth == 0:
            return frame[:i] + frame[j:]
    obj: Any = json.loads(frame[6:])
    obj.pop("usage", None)
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )


def rewrite_frame(frame: bytes, mode: int) -> bytes | None:
    """The frame as the client should see it (None = drop it). `frame` excludes the blank line."""
    if not frame.startswith(b"data: {") or b'"usage"' not in frame:
        return frame
    try:
        obj = json.loads(frame[6:])
    except ValueError:
        return frame
    if not isinstance(obj, dict) or "usage" not in obj:
        return frame
    final = obj.get("choices") == []
    if final:
        return None if mode == STRIP_ALL else frame
    return _without_usage(frame)


class FrameRewriter:
    """Incremental: `feed(payload)` returns the rewritten complete frames, `flush()` the rest."""

    __slots__ = ("_buf", "mode")

    def __init__(self, mode: int) -> None:
        self.mode = mode
        self._buf = b""

    def feed(self, payload: bytes) -> bytes:
        buf = self._buf + payload if self._buf else payload
        out: list[bytes] = []
        start = 0
        i = buf.find(b"\n\n")
        while i >= 0:
            try:
                f = rewrite_frame(buf[start:i], self.mode)
            except Exception:  # never break the client's stream over a rewrite
                f = buf[start:i]
            if f is not None:
                out.append(f + b"\n\n")
            start = i + 2
            i = buf.find(b"\n\n", start)
        self._buf = buf[start:]
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest
