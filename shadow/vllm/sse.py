"""Incremental parser for vLLM OpenAI-compatible SSE streams (the analysis side's per-chunk hot path).

`StreamParser.feed(bytes)` accepts a response body split at any byte, with LF, CRLF or CR line ends;
it never raises on malformed input: invalid JSON and oversized frames are counted and skipped. It
tracks what the mirror needs: generated tokens (usage where present, else the chunks' `token_ids`
(`return_token_ids`), else one per chunk with non-empty text/content/reasoning/tool_calls: a lower
bound, since vLLM merges several tokens into one chunk when the HTTP side lags), prompt tokens,
finish/stop reason, error events, `[DONE]` and `kv_transfer_params`. `parse_json_body` does the
same for a non-streaming response. Prompt or generated text is looked at (non-empty or not) but
never kept. `EventSplitter` cuts a body into its raw events, bytes unchanged, for a relay that
forwards event by event.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

try:  # optional: faster JSON if the environment has it; stdlib otherwise (same accept/reject set)
    import orjson as _orjson

    _loads: Callable[[bytes], Any] = _orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads

DEFAULT_MAX_FRAME = 1 << 20  # bytes of one SSE event kept while it is incomplete

_CONTENT_KEYS = ("content", "reasoning", "reasoning_content", "tool_calls")
# A blank line: two line ends in a row, each CRLF, LF or a CR not followed by LF (SSE spec).
_BLANK = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
_LINE_END = re.compile(rb"\r\n|\r|\n")


class StreamParser:
    """State of one SSE response body; feed it bytes, read the attributes.

    Attributes (all cumulative): `generated` (best token count; `count_source` says from what),
    `content_chunks`, `token_ids` (tokens listed in the chunks' token_ids, None when none did),
    `frames`, `prompt_tokens` (from usage or `prompt_token_ids`, else None),
    `finish_reason`/`stop_reason` (last non-null seen), `error` (True after an error event),
    `done` (saw `[DONE]`), `invalid_json`, `oversized`,
    `role_only` (chunks with no token), `usage_chunks`, `kv_transfer_params` (last seen dict).
    """

    __slots__ = (
        "_buf",
        "_cr_pending",
        "_skipping",
        "content_chunks",
        "continuous_usage",
        "done",
        "error",
        "finish_reason",
        "frames",
        "invalid_json",
        "kv_transfer_params",
        "max_frame",
        "on_frame",
        "oversized",
        "prompt_tokens",
        "role_only",
        "stop_reason",
        "token_ids",
        "usage_chunks",
        "usage_completion",
    )

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, on_frame: Callable[[bytes], None] | None = None):
        self.max_frame = max_frame
        self.on_frame = on_frame
        self._buf = b""
        self._cr_pending = False
        self._skipping = False
        self.frames = 0
        self.content_chunks = 0
        self.role_only = 0
        self.usage_chunks = 0
        self.usage_completion: int | None = None
        self.continuous_usage = False
        self.token_ids: int | None = None
        self.prompt_tokens: int | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.error = False
        self.done = False
        self.invalid_json = 0
        self.oversized = 0
        self.kv_transfer_params: dict[str, Any] | None = None

    @property
    def generated(self) -> int:
        """Output tokens so far: usage's completion_tokens when the stream carries it, else the
        chunks' token_ids, else the number of chunks with content (a lower bound)."""
        uc = self.usage_completion
        if uc is not None:
            return uc
        return self.content_chunks if self.token_ids is None else self.token_ids

    @property
    def count_source(self) -> str:
        """What `generated` is counted from: "usage", "token_ids" or "chunks"."""
        if self.usage_completion is not None:
            return "usage"
        return "chunks" if self.token_ids is None else "token_ids"

    def reset_partial(self) -> None:
        """Forget an incomplete frame (after a gap in the copy): resynchronise on the next blank line."""
        self._buf = b""
        self._cr_pending = False
        self._skipping = True

    def feed(self, data: bytes) -> None:
        """Consume the next piece of the body; complete events are interpreted immediately."""
        if self._cr_pending:
            data = b"\r" + data
            self._cr_pending = False
        if b"\r" in data:
            if data[-1:] == b"\r":
                data = data[:-1]
                self._cr_pending = True
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self._buf
        if buf:
            search_from = len(buf) - 1
            buf += data
        else:
            search_from = 0
            buf = data
        start = 0
        i = buf.find(b"\n\n", search_from)
        while i >= 0:
            if self._skipping:
                self._skipping = False
            else:
                self._frame(buf[start:i])
            start = i + 2
            i = buf.find(b"\n\n", start)
        rest = buf[start:] if start else buf
        if len(rest) > self.max_frame:
            if not self._skipping:
                self.oversized += 1
                self._skipping = True
            # keep the last byte: it may be the first half of the blank line that ends the frame
            rest = rest[-1:]
        self._buf = rest

    def close(self) -> None:
        """End of body: a final event without its blank line still counts (as browsers do not,
        but a truncated stream's last complete `data:` line is real progress)."""
        rest = self._buf
        self._buf = b""
        self._cr_pending = False
        if rest.strip() and not self._skipping:
            self._frame(rest.rstrip(b"\n"))
        self._skipping = False

    # -- one event -----------------------------------------------------------------------------

    def _frame(self, frame: bytes) -> None:
        if frame[:6] == b"data: " and b"\n" not in frame:
            payload = frame[6:]
        else:
            maybe = _data_of(frame)
            if maybe is None:
                return  # comment-only / field-only event (e.g. keep-alive)
            payload = maybe
        self.frames += 1
        if self.on_frame is not None:
            self.on_frame(payload)
        if payload == b"[DONE]":
            self.done = True
            return
        if (
            b'"finish_reason":null' in payload
            and (b'"text":"' in payload or b'"content":"' in payload)
            and b'":""' not in payload
            and b'"usage"' not in payload
            and b'"error"' not in payload
            and b'"kv_transfer_params"' not in payload
            and b'"token_ids":[' not in payload
        ):
            # Fast path for the common mid-stream chunk: one non-empty token, nothing else to learn.
            # Sound on JSON text: an unescaped quote is always structure, never inside a string.
            self.content_chunks += 1
            return
        try:
            obj = _loads(payload)
        except ValueError:
            self.invalid_json += 1
            return
        if not isinstance(obj, dict):
            self.invalid_json += 1
            return
        self.interpret(obj)

    def interpret(self, obj: dict[str, Any]) -> None:
        """Fold one decoded chunk object into the counters (also used for non-streaming bodies)."""
        if obj.get("error") is not None or obj.get("object") == "error":
            self.error = True
            return
        choices = obj.get("choices")
        has_content = False
        if isinstance(choices, list):
            for ch in choices:
                if not isinstance(ch, dict):
                    continue
                delta = ch.get("delta")
                if isinstance(delta, dict):
                    for key in _CONTENT_KEYS:
                        if delta.get(key):
                            has_content = True
                            break
                elif ch.get("text"):
                    has_content = True
                else:
                    msg = ch.get("message")
                    if isinstance(msg, dict) and any(msg.get(k) for k in _CONTENT_KEYS):
                        has_content = True
                tids = ch.get("token_ids")
                if isinstance(tids, list):
                    self.token_ids = (self.token_ids or 0) + len(tids)
                ptids = ch.get("prompt_token_ids")  # completions: on the first chunk's choice
                if isinstance(ptids, list) and self.prompt_tokens is None:
                    self.prompt_tokens = len(ptids)
                fr = ch.get("finish_reason")
                if fr is not None:
                    self.finish_reason = fr if isinstance(fr, str) else str(fr)
                    sr = ch.get("stop_reason")
                    if sr is not None:
                        self.stop_reason = sr
        if has_content:
            self.content_chunks += 1
        elif choices:
            self.role_only += 1
        ptids = obj.get("prompt_token_ids")  # chat: on the role chunk
        if isinstance(ptids, list) and self.prompt_tokens is None:
            self.prompt_tokens = len(ptids)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage_chunks += 1
            ct = usage.get("completion_tokens")
            if isinstance(ct, int) and not isinstance(ct, bool) and ct >= 0:
                if choices:
                    self.continuous_usage = True
                if self.usage_completion is None or ct >= self.usage_completion:
                    self.usage_completion = ct
            pt = usage.get("prompt_tokens")
            if isinstance(pt, int) and not isinstance(pt, bool) and pt >= 0:
                self.prompt_tokens = pt
        kv = obj.get("kv_transfer_params")
        if isinstance(kv, dict):
            self.kv_transfer_params = kv


def _data_of(frame: bytes) -> bytes | None:
    """The joined `data` field of one event (SSE spec: lines, `:` comments, one optional space)."""
    parts: list[bytes] = []
    for line in frame.split(b"\n"):
        if not line or line[:1] == b":":
            continue
        name, sep, value = line.partition(b":")
        if name != b"data":
            continue
        if sep and value[:1] == b" ":
            value = value[1:]
        parts.append(value)
    if not parts:
        return None
    return b"\n".join(parts)


def parse_json_body(body: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> StreamParser:
    """Interpret a complete non-streaming JSON response (completion, chat or error) as one chunk."""
    p = StreamParser(max_frame=max_frame)
    if len(body) > max_frame:
        p.oversized += 1
        return p
    try:
        obj = _loads(body)
    except ValueError:
        p.invalid_json += 1
        return p
    if not isinstance(obj, dict):
        p.invalid_json += 1
        return p
    p.frames = 1
    p.interpret(obj)
    return p


class EventSplitter:
    """Cuts an SSE body, fed at any byte boundary, into whole events with their bytes unchanged
    (each with the blank line that ends it), whatever the line ends (CRLF, LF, CR).

    `feed(data)` returns the pieces to forward now: complete events, or, while one event has grown
    past `max_event` bytes without its blank line, its bytes as they come (`oversized` counts such
    events; they are forwarded, never held). `rest()` returns what is left at the end of the body.
    Work is linear in the bytes fed: each byte is searched once. A blank line ending in a CR at the
    end of the input is taken there; an LF that follows it (CRLF) is passed on at once.
    """

    __slots__ = ("_buf", "_cr_end", "_line_start", "_passing", "max_event", "oversized")

    def __init__(self, max_event: int = DEFAULT_MAX_FRAME) -> None:
        self.max_event = max_event
        self.oversized = 0
        self._buf = b""
        self._passing = False  # inside an oversized event: forwarding its bytes until its end
        self._cr_end = False  # the last event was taken at a CR that ended the input
        self._line_start = True  # the buffer starts at a line start (a line end there is blank)

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        """(piece, whole) pairs: `whole` is False for the bytes of an oversized event."""
        out: list[tuple[bytes, bool]] = []
        if self._cr_end and data:
            self._cr_end = False
            if data[:1] == b"\n":  # the LF of that CR: the end of the event already forwarded
                out.append((b"\n", True))
                data = data[1:]
        buf = self._buf
        scan = max(0, len(buf) - 2)  # a blank line may straddle the previous piece and this one
        buf = buf + data if buf else data
        start = 0
        while True:
            m = _LINE_END.match(buf, start) if self._line_start else None
            if m is None:  # the event has a first line: its end is the next blank line
                m = _BLANK.search(buf, max(scan, start))
                if m is None:
                    break
            out.append((buf[start : m.end()], not self._passing))
            self._passing = False
            self._line_start = True
            start = m.end()
        rest = buf[start:]
        if start and not rest and buf[-1:] == b"\r":
            self._cr_end = True
        if self._passing or len(rest) > self.max_event:
            if not self._passing:
                self._passing = True
                self._line_start = False
                self.oversized += 1
            keep = rest[-2:]  # the start of a blank line, if that is how it ends
            if len(rest) > 2:
                out.append((rest[:-2], False))
            rest = keep
        self._buf = rest
        return out

    def rest(self) -> bytes:
        """The unfinished end of the body (an event without its blank line)."""
        rest = self._buf
        self._buf, self._passing, self._cr_end, self._line_start = b"", False, False, True
        return rest


def event_data(event: bytes) -> bytes | None:
    """The `data` field of one raw event (any line ends), or None when it has none."""
    if b"\r" in event:
        event = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return _data_of(event.strip(b"\n"))
