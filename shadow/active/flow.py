"""One request's routing state in the P/D flow (`Flow`) and how a leg fails before the client got a
byte (`LegFailed`, carrying the answer the client gets if no retry hides it).

`Flow` is created per request and mutated only by that request's task; `LegFailed` is raised by a
leg and caught by the attempt loop (retryable unless final) or turned into the client's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from opentelemetry import trace

from shadow.active.prefill import Prefiller


def error_body(status: int, message: str, kind: str) -> bytes:
    """The proxy's own JSON error answer: `{"error": {message, type: kind, code: status}}`."""
    return orjson.dumps({"error": {"message": message, "type": kind, "code": status}})


class LegFailed(Exception):
    """An upstream attempt failed before anything reached the client (retryable unless final).

    `kind` names the failure (the error body's `type`, or `<leg>_status` for an upstream's own
    error answer); `kv` is the prefill's KV handle when the decode leg failed before any of its
    bytes were written (the decode worker never saw it: a retry may use it again)."""

    def __init__(
        self,
        status: int,
        content: bytes,
        media: str,
        retryable: bool,
        leg: str,
        worker: str,
        kind: str = "",
        kv: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{leg} {worker}: HTTP {status}")
        self.status, self.content, self.media = status, content, media
        self.retryable, self.leg, self.worker = retryable, leg, worker
        self.kind = kind or f"{leg}_status"
        self.kv = kv

    @classmethod
    def ours(
        cls, status: int, message: str, kind: str, retryable: bool, leg: str, worker: str = ""
    ) -> LegFailed:
        """A failure the proxy answers itself (JSON error body of `kind`)."""
        body = error_body(status, message, kind)
        return cls(status, body, "application/json", retryable, leg, worker, kind)

    def holding(self, kv: dict[str, Any] | None) -> LegFailed:
        """This failure, carrying the unused KV handle `kv` back to the attempt loop."""
        self.kv = kv
        return self


@dataclass
class Flow:
    """One request's routing state across its (re)tried and recomputed legs."""

    rid: str
    path: str
    mode: str
    policy: str
    body: dict[str, Any]
    raw: bytes
    t0: float
    bucket: str
    prefiller: Prefiller | None = None
    prefill_cost: float = 0.0
    worker: int = -1
    dispatched_at: float = 0.0
    prompt_tokens: int = 0
    kv_from: str = ""  # the prefiller holding this request's KV until a decode pulls it
    call: trace.Span | None = None  # the decode call's CLIENT span while its answer streams
