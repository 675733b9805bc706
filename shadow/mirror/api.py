"""The mirror's HTTP API: event ingestion, recent events, state, schema and /metrics.

`create_app(mirror, registry, ...)` builds a FastAPI app:
- `POST /v1/events` (bearer token when configured; loopback-only without one; see `events_access`):
  an NDJSON batch; each line is validated with `from_dict` (plus the schema's type rules) and
  applied; reply `{"accepted", "rejected": {reason: n}, "outcomes": {outcome: n}}`; a body over
  `max_body` bytes is refused with 413 and nothing is applied.
- `GET /v1/events?after=SEQ&limit=N`: recent applied events as NDJSON (header `X-Last-Seq`).
- `GET /v1/events/schema`: the published JSON Schema; `GET /v1/state`; `GET /metrics`; `GET /health`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from shadow.base.listener import capped_body
from shadow.base.logthrottle import Throttled
from shadow.base.security import bearer_ok, is_loopback
from shadow.contracts.events import EVENT_TYPES, Arrive, Event, Step, from_dict, load_schema
from shadow.mirror.hub import Mirror, event_line

try:  # faster, and refuses nesting beyond 1024 levels and integers beyond 64 bits by itself
    import orjson as _orjson

    _loads: Callable[[bytes], Any] = _orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads

NEEDS_EVENTS_TOKEN = (
    "event ingestion is off: an admin token guards this process and events can trip its mode, "
    "so they need their own token (--events-token or SHADOW_EVENTS_TOKEN)"
)
DEFAULT_MAX_BODY = 8 << 20
DEFAULT_MAX_ID_LEN = 256
MAX_INT = 1 << 53  # integers in events stay exact in a float (Prometheus) and in JSON readers
MAX_LINE = 64 << 10  # one NDJSON line
REJECT_REASONS = (
    "invalid_json",
    "too_long",
    "not_object",
    "unknown_type",
    "unknown_field",
    "missing_field",
    "invalid_value",
    "apply_error",
    "unauthorized_kind",
)
STEP_KINDS = frozenset({Step.kind})  # what the probe token admits: they move the lanes' clock, nothing else
ALL_KINDS = frozenset(cls.kind for cls in EVENT_TYPES.values())


def events_access(
    host: str, events_token: str | None, probe_token: str | None, authorization: str | None,
    token_required: bool = False,
) -> frozenset[str] | tuple[int, str]:
    """The event kinds a POST /v1/events may carry, or (HTTP status, one-line reason) refused.

    The events token admits every kind; the probe token (the engine probe's, `--probe-token`) only
    `step` lines, which move the live lanes' clock and change nothing else (they are bounded there:
    `shadow.live.stepcheck`). Without a matching token, the kinds no token guards are admitted on
    a loopback listener only (secure by default), and nowhere when `token_required` (another token
    guards this process: events could trip its mode)."""
    guards = {"step": (probe_token, events_token), "other": (events_token,)}
    open_here = is_loopback(host) and not token_required
    allowed = {
        cls for cls, tokens in guards.items()
        if any(t is not None and bearer_ok(authorization, t) for t in tokens)
        or (open_here and all(t is None for t in tokens))
    }
    kinds = (ALL_KINDS - STEP_KINDS if "other" in allowed else frozenset()) | (
        STEP_KINDS if "step" in allowed else frozenset())
    if kinds:
        return kinds
    if events_token is not None or probe_token is not None:
        return 401, "event ingestion needs 'Authorization: Bearer <token>'"
    if token_required:
        return 403, NEEDS_EVENTS_TOKEN
    return 403, "event ingestion over the network needs a token"


def reject_reason(message: str) -> str:
    """Map a `from_dict` ValueError message to a bounded reason label."""
    if "must be a JSON object" in message:
        return "not_object"
    if "unknown event type" in message:
        return "unknown_type"
    if "unknown field" in message:
        return "unknown_field"
    if "missing field" in message:
        return "missing_field"
    return "invalid_value"


class TooLong(ValueError):
    """An id, worker name or prompt key longer than the configured limit."""


def parse_event(obj: Any, max_id_len: int = DEFAULT_MAX_ID_LEN) -> Event:
    """`from_dict` plus the type rules the schema states and `from_dict` leaves open, bounded
    integers (|n| <= 2^53), finite numbers, and strings of at most `max_id_len` characters."""
    ev = from_dict(obj)
    if isinstance(ev, Arrive) and ev.prompt_key is not None and not isinstance(ev.prompt_key, str):
        raise ValueError("arrive: prompt_key must be a string")
    if isinstance(ev, Step) and ev.worker is not None and not isinstance(ev.worker, str):
        raise ValueError("step: worker must be a string")
    for name in ev.__match_args__:
        v = getattr(ev, name)
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, int):
            if not -MAX_INT <= v <= MAX_INT:
                raise ValueError(f"{ev.kind}: {name} out of range")
        elif isinstance(v, float):
            if not math.isfinite(v) or abs(v) > MAX_INT:
                raise ValueError(f"{ev.kind}: {name} out of range")
        elif isinstance(v, str):
            if len(v) > max_id_len:
                raise TooLong(f"{ev.kind}: {name} longer than {max_id_len}")
        elif isinstance(v, list | tuple | dict):
            _check_nested(v, ev.kind, name, max_id_len)
    return ev


def _check_nested(v: Any, kind: str, name: str, max_id_len: int) -> None:
    items = v.values() if isinstance(v, dict) else v
    if len(v) > 100_000:
        raise TooLong(f"{kind}: {name} has too many items")
    for x in items:
        if isinstance(x, bool) or x is None:
            continue
        if isinstance(x, int) and not -MAX_INT <= x <= MAX_INT:
            raise ValueError(f"{kind}: {name} out of range")
        if isinstance(x, float) and (not math.isfinite(x) or abs(x) > MAX_INT):
            raise ValueError(f"{kind}: {name} out of range")
        if isinstance(x, str) and len(x) > max_id_len:
            raise TooLong(f"{kind}: {name} longer than {max_id_len}")
        if isinstance(x, list | tuple | dict):
            raise ValueError(f"{kind}: {name} nested too deep")


def ingest_ndjson(
    body: bytes,
    mirror: Mirror,
    now: float,
    rejected: MutableMapping[str, int],
    max_id_len: int = DEFAULT_MAX_ID_LEN,
    kinds: frozenset[str] = ALL_KINDS,
) -> dict[str, Any]:
    """Validate and apply every line of an NDJSON batch; never raises (a bad line is rejected
    with a reason and the others still apply; a line of a kind not in `kinds` is rejected as
    `unauthorized_kind`)."""
    tally = _Tally()
    _ingest_lines(body.split(b"\n"), mirror, now, rejected, max_id_len, tally, kinds)
    return tally.result()


async def ingest_ndjson_sliced(
    body: bytes,
    mirror: Mirror,
    now: float,
    rejected: MutableMapping[str, int],
    max_id_len: int = DEFAULT_MAX_ID_LEN,
    slice_lines: int = 1000,
    kinds: frozenset[str] = ALL_KINDS,
) -> dict[str, Any]:
    """`ingest_ndjson` in slices, returning to the event loop between them (its I/O poll hands
    the GIL to the relay thread and lets other handlers run)."""
    tally = _Tally()
    lines = body.split(b"\n")
    for i in range(0, len(lines), slice_lines):
        _ingest_lines(lines[i : i + slice_lines], mirror, now, rejected, max_id_len, tally, kinds)
        await asyncio.sleep(0)
    return tally.result()


class _Tally:
    __slots__ = ("accepted", "outcomes", "rej")

    def __init__(self) -> None:
        self.accepted = 0
        self.rej: dict[str, int] = {}
        self.outcomes: dict[str, int] = {}

    def result(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "rejected": self.rej, "outcomes": self.outcomes}


def _ingest_lines(
    lines: list[bytes],
    mirror: Mirror,
    now: float,
    rejected: MutableMapping[str, int],
    max_id_len: int,
    tally: _Tally,
    kinds: frozenset[str],
) -> None:
    rej, outcomes = tally.rej, tally.outcomes
    every_kind = kinds == ALL_KINDS
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        reason: str | None = None
        ev: Event | None = None
        obj: Any = None
        if len(line) > MAX_LINE:
            reason = "too_long"
        else:
            try:
                obj = _loads(line)
            except (ValueError, RecursionError):  # RecursionError: JSON nested beyond reason
                reason = "invalid_json"
        if reason is None:
            try:
                ev = parse_event(obj, max_id_len)
            except TooLong:
                reason = "too_long"
            except ValueError as exc:
                reason = reject_reason(str(exc))
            except Exception:
                reason = "invalid_value"
        if ev is not None and not every_kind and ev.kind not in kinds:
            ev, reason = None, "unauthorized_kind"
        if ev is not None:
            try:
                out = mirror.emit(ev, "api", now)
            except Exception:
                mirror.count_error("api_apply")
                reason = "apply_error"
            else:
                tally.accepted += 1
                outcomes[out] = outcomes.get(out, 0) + 1
        if reason is not None:
            rej[reason] = rej.get(reason, 0) + 1
            rejected[reason] = rejected.get(reason, 0) + 1


def events_router(
    mirror: Mirror,
    rejected_counts: MutableMapping[str, int],
    *,
    max_body: int,
    clock: Callable[[], float],
    host: str,
    ingest_token: str | None,
    max_id_len: int,
    token_required: bool,
    probe_token: str | None,
) -> APIRouter:
    """The event API: `POST /v1/events` (NDJSON in, guarded as `create_app` says), `GET /v1/events`
    (the recent ones after a sequence number) and `GET /v1/events/schema`."""
    router = APIRouter()
    schema = load_schema()
    rejections = Throttled(logging.getLogger("shadow.mirror.api"))

    @router.post("/v1/events")
    async def post_events(request: Request) -> Response:
        access = events_access(host, ingest_token, probe_token, request.headers.get("authorization"),
                               token_required)
        if isinstance(access, tuple):
            rejected_counts["unauthorized"] = rejected_counts.get("unauthorized", 0) + 1
            rejections.warning("unauthorized", "POST /v1/events refused (%s): %s", access[0], access[1])
            return JSONResponse({"error": access[1]}, status_code=access[0])
        body = await capped_body(request, max_body)
        if body is None:
            rejected_counts["too_large"] = rejected_counts.get("too_large", 0) + 1
            rejections.warning("too_large", "POST /v1/events refused: body over %d bytes", max_body)
            return JSONResponse({"error": f"body over {max_body} bytes"}, status_code=413)
        result = await ingest_ndjson_sliced(body, mirror, clock(), rejected_counts, max_id_len, kinds=access)
        if result["rejected"]:
            why = dict(result["rejected"])
            rejections.warning("lines", "POST /v1/events: %d lines rejected", sum(why.values()), reasons=why)
        return JSONResponse(result)

    @router.get("/v1/events")
    async def get_events(after: int = Query(0, ge=0), limit: int = Query(1000, ge=1, le=100_000)) -> Response:
        items = mirror.recent_after(after, limit)
        last = items[-1][0] if items else max(after, 0)
        body = "".join(event_line(ev) + "\n" for _, ev in items)
        return Response(body, media_type="application/x-ndjson", headers={"X-Last-Seq": str(last)})

    @router.get("/v1/events/schema")
    async def get_schema() -> Response:
        return JSONResponse(schema, media_type="application/schema+json")

    return router


def create_app(
    mirror: Mirror,
    registry: CollectorRegistry,
    *,
    rejected: MutableMapping[str, int] | None = None,
    extra_state: Callable[[float], dict[str, Any]] | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    clock: Callable[[], float] = time.monotonic,
    host: str = "127.0.0.1",
    ingest_token: str | None = None,
    max_id_len: int = DEFAULT_MAX_ID_LEN,
    routers: Sequence[APIRouter] = (),
    token_required: bool = False,
    probe_token: str | None = None,
) -> FastAPI:
    """The API app over one mirror (plus the routes of `routers`); `rejected` is the counter dict
    the metrics collector exports.

    Ingestion changes the mirrored state, so `POST /v1/events` needs `ingest_token` as a bearer
    token when one is set, and is refused on a non-loopback `host` when none is — and everywhere
    when `token_required` (another token guards this process: events could trip its mode);
    `probe_token` admits `step` lines only (`events_access`).
    """
    app = FastAPI(title="shadow mirror", docs_url=None, redoc_url=None, openapi_url=None)
    rejected_counts: MutableMapping[str, int] = rejected if rejected is not None else {}
    app.include_router(events_router(
        mirror, rejected_counts, max_body=max_body, clock=clock, host=host, ingest_token=ingest_token,
        max_id_len=max_id_len, token_required=token_required, probe_token=probe_token))

    @app.get("/v1/state")
    async def get_state() -> Response:
        now = clock()
        snap = mirror.state.snapshot(now)
        if extra_state is not None:
            snap.update(extra_state(now))
        return JSONResponse(snap)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text, or OpenMetrics (with exemplars) when the scraper asks for it."""
        encode, media = choose_encoder(request.headers.get("accept", ""))
        try:
            body = encode(registry)
        except Exception as exc:  # never a 500 because of some event's content: say what failed
            mirror.count_error("metrics")
            return Response(f"# metrics failed: {type(exc).__name__}\n", status_code=200)
        return Response(body, media_type=media)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    for router in routers:
        app.include_router(router)
    return app
