"""Continuing a request its decode worker recomputed (vLLM preempted it and ended its stream with
`stop_reason: "recomputed"`): telling such an answer, keeping what a stream sent, and the body that
continues it on a new P/D flow (prompt + text so far, the remaining `max_tokens`).

Bytes kept for continuations are bounded per stream (`MAX_RESUME_BYTES`) and for all streams
together (`ResumeBudget`, one per proxy): a stream over either keeps nothing more and can no longer
be continued (counted in `ResumeBudget.dropped` and `shadow_router_resume_dropped_total`).
"""

from __future__ import annotations

from typing import Any

import orjson
from prometheus_client import Counter

from shadow.vllm.sse import EventSplitter, event_data

MAX_RESUME_BYTES = 4 << 20  # stream bytes kept per request for a recompute continuation


class ResumeBudget:
    """The bytes all streams keep for continuations (`held`, at most `limit`); `dropped`: streams
    that stopped keeping them. Mutated by the streams' relays, in the event loop only."""

    def __init__(self, limit: int, dropped_total: Counter) -> None:
        self.limit = limit
        self.held = 0
        self.dropped = 0
        self._dropped_total = dropped_total

    def drop(self) -> None:
        """A stream gave up its kept bytes (over a limit)."""
        self.dropped += 1
        self._dropped_total.inc()


class Kept:
    """The bytes one stream sent to its client, kept (within `budget`) for a continuation."""

    def __init__(self, budget: ResumeBudget) -> None:
        self.budget = budget
        self.parts: list[bytes] | None = []  # None: too much to keep, no continuation
        self.size = 0

    def keep(self, out: bytes) -> None:
        """`out` is being sent to the client: keep it, unless that goes over a limit."""
        if self.parts is None:
            return
        self.parts.append(out)
        self.size += len(out)
        self.budget.held += len(out)
        if self.size > MAX_RESUME_BYTES or self.budget.held > self.budget.limit:
            self.budget.held -= self.size  # too much to keep: no continuation
            self.parts, self.size = None, 0
            self.budget.drop()

    def release(self) -> None:
        """The stream ended: its bytes leave the budget."""
        self.budget.held -= self.size
        self.size = 0

    def continuation(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The body that continues `body` after what was kept (None: it cannot be continued)."""
        return continuation(body, self.parts) if self.parts is not None else None


def whole_recomputed(content: bytes) -> bool:
    """A non-streamed answer that ends a choice with stop_reason "recomputed"."""
    try:
        doc = orjson.loads(content)
        return any(c.get("stop_reason") == "recomputed" for c in doc.get("choices") or [])
    except (orjson.JSONDecodeError, AttributeError):
        return False


def _chunk_of(event: bytes) -> Any:
    """The JSON object one raw SSE event carries, or None."""
    data = event_data(event)
    if data is None or not data.startswith(b"{"):
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def recomputed(event: bytes) -> bool:
    """The event ends its stream with stop_reason "recomputed" (the worker preempted it)."""
    if b'"recomputed"' not in event:
        return False
    doc = _chunk_of(event)
    try:
        return any(c.get("stop_reason") == "recomputed" for c in doc.get("choices") or [])
    except AttributeError:
        return False


def continuation(body: dict[str, Any], sent: list[bytes]) -> dict[str, Any] | None:
    """The body that continues a recomputed request: its prompt plus the text sent so far, and
    the remaining `max_tokens` (None when nothing is left or the body cannot be continued)."""
    text: list[str] = []
    tokens = 0
    split = EventSplitter(max_event=MAX_RESUME_BYTES + 1)
    for whole, _ in [*split.feed(b"".join(sent)), (split.rest(), True)]:
        doc = _chunk_of(whole)
        if not isinstance(doc, dict):
            continue
        for c in doc.get("choices") or []:
            piece = c.get("text")
            if piece is None:
                piece = (c.get("delta") or {}).get("content")
            if isinstance(piece, str) and piece:
                text.append(piece)
                tokens += 1
    nxt = dict(body)
    limit_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    limit = body.get(limit_key)
    if isinstance(limit, int):
        if limit - tokens <= 0:
            return None
        nxt[limit_key] = limit - tokens
        if isinstance(body.get("min_tokens"), int):
            nxt["min_tokens"] = max(0, body["min_tokens"] - tokens)
    so_far = "".join(text)
    if isinstance(body.get("prompt"), str):
        nxt["prompt"] = body["prompt"] + so_far
    elif isinstance(body.get("messages"), list):
        nxt["messages"] = [*body["messages"], {"role": "assistant", "content": so_far}]
        nxt["continue_final_message"] = True
        nxt["add_generation_prompt"] = False
    else:
        return None
    return nxt
