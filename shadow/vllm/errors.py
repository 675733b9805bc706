"""vLLM's error shape (`ErrorResponse`: `{"error": {message, type, param, code}}`), as the SSE event
a relay writes into a stream it has to cut, so that a client sees an error, never a short success.

vLLM itself ends a stream whose generation failed with `data: {"error": {...}}` then `[DONE]`; a
relay that cuts a stream sends the same event and then aborts the body instead (no `[DONE]`, no
terminating chunk), so clients that ignore the event still see a broken response.
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
