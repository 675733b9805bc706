"""vLLM's error shape (`ErrorResponse`: `{"error": {message, type, param, code}}`), as the SSE event
a relay writes into a stream it has to cut, so that a client sees an error, never a short success.

vLLM itself ends a stream whose generation failed with `data: {"error": {...}}` then `[DONE]`; a
relay that cuts a stream sends the same event and then aborts the body instead (no `[DONE]`, no
terminating chunk), so clients that ignore the event still see a broken response. A stream cut
inside an event gets no event (`cut_event`): it could only follow the blank line that ends the open
one, and a client would parse that truncated event (the `openai` client raises a JSON decoding
error, not an API error); the aborted body alone tells the client.
"""

from __future__ import annotations

import json

CUT_ERROR_TYPE = "InternalServerError"  # what vLLM names a generation that failed mid-stream
CUT_ERROR_CODE = 500


def error_body(message: str, err_type: str = CUT_ERROR_TYPE, code: int = CUT_ERROR_CODE) -> bytes:
    """`{"error": {"message", "type", "param": null, "code"}}` as vLLM's ErrorResponse serialises it."""
    return json.dumps(
        {"error": {"message": message, "type": err_type, "param": None, "code": code}},
        separators=(", ", ": "),
    ).encode()


def stream_error_event(message: str, err_type: str = CUT_ERROR_TYPE, code: int = CUT_ERROR_CODE) -> bytes:
    """One SSE event carrying the error (`data: {...}` and the blank line that ends it)."""
    return b"data: " + error_body(message, err_type, code) + b"\n\n"


#: Bytes of a stream's end that tell whether it leaves an SSE event open (`event_open`).
TAIL_BYTES = 4


def event_open(tail: bytes) -> bool:
    """Whether an SSE stream whose last bytes are `tail` (its last TAIL_BYTES at least; empty: no
    byte yet) leaves an event open: its blank line has not come (lines end in CRLF, LF or CR)."""
    if not tail:
        return False
    return not tail.replace(b"\r\n", b"\n").replace(b"\r", b"\n").endswith(b"\n\n")


def cut_event(message: str, tail: bytes) -> bytes | None:
    """The error event that ends a stream cut after `tail` (see `event_open`), or None when an event
    is open there: the stream is then cut without one."""
    return None if event_open(tail) else stream_error_event(message)
