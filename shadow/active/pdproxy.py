"""A P/D (or plain) proxy with a pluggable pick function; the default is the vllm-ascend
load-balance proxy's JSQ rule, so `shadow demo` has an existing router to observe.

Per request (P/D mode), as the vllm-ascend proxy does it:
1. prefill pick: minimum of 0.3 × outstanding prefill score, where one request's score is
   0.0345 × (body bytes / 4) + 120.0745; ties go to the first registered backend;
2. prefill leg, not streamed: the client's body with `stream: false`, `max_tokens: 1`,
   `min_tokens: 1` (and `max_completion_tokens: 1` when present), no `stream_options`, and
   `kv_transfer_params {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`;
3. decode pick: minimum of outstanding decode score (the client body's length in bytes), ties to
   the first registered; the decode leg is the client's original body plus the prefill's returned
   `kv_transfer_params`, streamed back as it arrives;
4. the prefill reservation is released at the first non-empty decode chunk (or when the request
   ends), the decode reservation when the decode stream ends, fails or the client goes away.
Both legs carry one `X-Request-Id` (uuid4 hex), also returned to the client. Plain mode (no
prefill backends) forwards the client's body to the decode pick unchanged.

`PdProxy(config).app` is an ASGI app (Starlette, served by uvicorn); upstream calls go through one
persistent httpx connection pool. Pick functions take the candidates' outstanding scores and return
an index, so an active-routing proxy can reuse everything but the rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from shadow._net import bind_listen

log = logging.getLogger("shadow.router")

PREFILL_SCORE_PER_TOKEN = 0.0345  # vllm-ascend proxy: prefill cost per (body bytes / 4)
PREFILL_SCORE_BASE = 120.0745  # ... plus a fixed cost per request
PREFILL_PRIORITY_WEIGHT = 0.3  # prefill priority = 0.3 × outstanding prefill score
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Backend:
    """One upstream server and the work the proxy has outstanding on it."""

    name: str
    url: str
    ordinal: int
    outstanding: float = 0.0
    requests: int = 0


@dataclass(frozen=True)
class Pick:
    """What a pick function sees: the candidates (registration order) and this request's score."""

    backends: Sequence[Backend]
    score: float
    body: dict[str, Any]


# A pick function returns the index (into `Pick.backends`) of the chosen backend.
PickFn = Callable[[Pick], int]


def jsq_pick(weight: float = 1.0) -> PickFn:
    """Join the shortest queue: least `weight × outstanding`, ties to the first registered."""

    def pick(p: Pick) -> int:
        return min(range(len(p.backends)), key=lambda i: (weight * p.backends[i].outstanding,
                                                          p.backends[i].ordinal))

    return pick


def round_robin_pick() -> PickFn:
    """vLLM's toy proxy: cycle through the backends in registration order."""
    counter = itertools.count()

    def pick(p: Pick) -> int:
        return next(counter) % len(p.backends)

    return pick


# name → (prefill pick factory, decode pick factory)
POLICIES: dict[str, tuple[Callable[[], PickFn], Callable[[], PickFn]]] = {
    "jsq-bytes": (lambda: jsq_pick(PREFILL_PRIORITY_WEIGHT), lambda: jsq_pick(1.0)),
    "round-robin": (round_robin_pick, round_robin_pick),
}


def prefill_score(body_bytes: int) -> float:
    """The vllm-ascend proxy's prefill cost estimate for a body of `body_bytes` bytes."""
    return PREFILL_SCORE_PER_TOKEN * (body_bytes / 4) + PREFILL_SCORE_BASE


@dataclass
class ProxyConfig:
    """Backends as {name: base URL}; `prefill` empty = plain mode (decode only)."""

    decode: dict[str, str]
    prefill: dict[str, str] = field(default_factory=dict)
    policy: str = "jsq-bytes"
    max_body_bytes: int = 8 << 20
    max_connections: int = 1024
    prefill_retries: int = 3
    retry_delay_s: float = 0.001  # base of the exponential backoff between prefill attempts
    timeout_s: float = 600.0
    api_key: str | None = None  # sent upstream as a bearer token when set

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("router: need at least one decode backend")
        if self.policy not in POLICIES:
            raise ValueError(f"router: unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        for url in [*self.decode.values(), *self.prefill.values()]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"router: backend URL must start with http:// or https://, got {url!r}")
        if self.max_body_bytes < 1 or self.max_connections < 1 or self.prefill_retries < 0:
            raise ValueError("router: max body, connections must be >= 1 and retries >= 0")


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter("shadow_router_decisions", "backends picked, by stage",
                                 ["stage", "backend"], registry=registry)
        self.outstanding = Gauge("shadow_router_outstanding_score",
                                 "outstanding score per backend (decode: body bytes)",
                                 ["stage", "backend"], registry=registry)
        self.errors = Counter("shadow_router_errors", "requests that failed, by reason", ["reason"],
                              registry=registry)


class PdProxy:
    """See module docstring. `start()` opens the upstream pool, `close()` releases it."""

    def __init__(self, config: ProxyConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.prefill = [Backend(n, u.rstrip("/"), i) for i, (n, u) in enumerate(config.prefill.items())]
        self.decode = [Backend(n, u.rstrip("/"), i) for i, (n, u) in enumerate(config.decode.items())]
        pre, dec = POLICIES[config.policy]
        self.pick_prefill, self.pick_decode = pre(), dec()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        self._client: httpx.AsyncClient | None = None
        self.app = Starlette(
            routes=[
                *(Route(p, self._generate, methods=["POST"]) for p in GENERATE_PATHS),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/healthcheck", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ],
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.close()

    async def start(self) -> None:
        if self._client is None:
            limits = httpx.Limits(max_connections=self.config.max_connections,
                                  max_keepalive_connections=self.config.max_connections)
            self._client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(self.config.timeout_s,
                                                                                  connect=10.0))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("router not started")
        return self._client

    # -- bookkeeping -----------------------------------------------------------------------------
    def _reserve(self, stage: str, pool: list[Backend], pick: PickFn, score: float,
                 body: dict[str, Any]) -> Backend:
        i = pick(Pick(pool, score, body))
        if not 0 <= i < len(pool):
            raise RuntimeError(f"pick function returned {i} for {len(pool)} backends")
        b = pool[i]
        b.outstanding += score
        b.requests += 1
        self.metrics.decisions.labels(stage, b.name).inc()
        self.metrics.outstanding.labels(stage, b.name).set(b.outstanding)
        return b

    def _release(self, stage: str, b: Backend, score: float) -> None:
        b.outstanding = max(0.0, b.outstanding - score)
        b.requests -= 1
        if b.requests == 0:
            b.outstanding = 0.0  # no float residue once idle
        self.metrics.outstanding.labels(stage, b.name).set(b.outstanding)

    def _headers(self, request_id: str) -> dict[str, str]:
        h = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        if self.config.api_key:
            h["Authorization"] = f"Bearer {self.config.api_key}"
        return h

    def _error(self, status: int, message: str, reason: str) -> JSONResponse:
        self.metrics.errors.labels(reason).inc()
        return JSONResponse({"error": {"message": message, "type": reason, "code": status}},
                            status_code=status)

    # -- endpoints -------------------------------------------------------------------------------
    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "prefill_instances": len(self.prefill),
                             "decode_instances": len(self.decode),
                             "request_num": sum(b.requests for b in self.decode)})

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    async def _models(self, request: Request) -> Response:
        for b in [*self.decode, *self.prefill]:
            with contextlib.suppress(httpx.HTTPError):
                r = await self.client.get(b.url + "/v1/models", timeout=10.0)
                if r.status_code == 200:
                    return Response(r.content, media_type="application/json")
        return self._error(503, "no backend answered /v1/models", "unavailable")

    async def _read_body(self, request: Request) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.config.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _generate(self, request: Request) -> Response:
        try:
            raw = await self._read_body(request)
        except ClientDisconnect:
            self.metrics.errors.labels("client_gone").inc()
            return Response(status_code=499)
        if raw is None:
            return self._error(413, f"request body over {self.config.max_body_bytes} bytes", "too_large")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return self._error(400, "request body is not JSON", "bad_request")
        if not isinstance(body, dict):
            return self._error(400, "request body must be a JSON object", "bad_request")
        request_id = uuid.uuid4().hex
        path = request.url.path
        kv_params: dict[str, Any] | None = None
        pre: Backend | None = None
        pre_score = prefill_score(len(raw))
        if self.prefill:
            pre = self._reserve("prefill", self.prefill, self.pick_prefill, pre_score, body)
            got = await self._prefill_leg(pre, path, body, request_id)
            if isinstance(got, Response):
                self._release("prefill", pre, pre_score)
                return got
            kv_params = got
        released = [pre is None]

        def release_prefill() -> None:
            if not released[0] and pre is not None:
                released[0] = True
                self._release("prefill", pre, pre_score)

        dec_score = float(len(raw))
        dec = self._reserve("decode", self.decode, self.pick_decode, dec_score, body)
        dec_body = dict(body)
        if kv_params is not None:
            dec_body["kv_transfer_params"] = kv_params
        payload = raw if kv_params is None else orjson.dumps(dec_body)
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", dec.url + path, content=payload,
                                          headers=self._headers(request_id)),
                stream=True,
            )
        except httpx.HTTPError as exc:
            release_prefill()
            self._release("decode", dec, dec_score)
            log.warning("decode leg %s to %s failed before a response: %s: %s", request_id, dec.name,
                        type(exc).__name__, exc)
            return self._error(502, f"decode backend {dec.name} unreachable: {type(exc).__name__}",
                               "decode_unreachable")
        if upstream.status_code != 200:
            try:
                content = await upstream.aread()
            except httpx.HTTPError:
                content = b""
            finally:
                await upstream.aclose()
                release_prefill()
                self._release("decode", dec, dec_score)
            self.metrics.errors.labels("decode_status").inc()
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type", "application/json"))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    if chunk:
                        release_prefill()
                        yield chunk
            except httpx.HTTPError as exc:
                self.metrics.errors.labels("decode_stream").inc()
                log.warning("decode stream %s from %s broke: %s: %s", request_id, dec.name,
                            type(exc).__name__, exc)
            finally:
                release_prefill()
                self._release("decode", dec, dec_score)
                await upstream.aclose()

        media = upstream.headers.get("content-type", "application/json")
        return _Relay(relay(), status_code=200, media_type=media,
                                 headers={"X-Request-Id": request_id})

    async def _prefill_leg(self, b: Backend, path: str, body: dict[str, Any],
                           request_id: str) -> dict[str, Any] | Response:
        """Run the prefill leg on `b`; its `kv_transfer_params`, or the error response to send."""
        leg = dict(body)
        leg.pop("stream_options", None)
        leg.update(stream=False, max_tokens=1, min_tokens=1, kv_transfer_params=dict(PREFILL_KV_PARAMS))
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        payload = orjson.dumps(leg)
        delay = self.config.retry_delay_s
        last = "no attempt"
        for attempt in range(self.config.prefill_retries + 1):
            try:
                r = await self.client.post(b.url + path, content=payload, headers=self._headers(request_id))
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            else:
                if r.status_code == 200:
                    try:
                        params = orjson.loads(r.content).get("kv_transfer_params")
                    except (orjson.JSONDecodeError, AttributeError):
                        params = None
                    if not isinstance(params, dict):
                        return self._error(502, f"prefill backend {b.name} returned no kv_transfer_params",
                                           "prefill_bad_response")
                    return params
                if r.status_code == 400 or attempt == self.config.prefill_retries:
                    self.metrics.errors.labels("prefill_status").inc()
                    return Response(r.content, status_code=r.status_code,
                                    media_type=r.headers.get("content-type", "application/json"))
                last = f"HTTP {r.status_code}"
            if attempt < self.config.prefill_retries:
                await asyncio.sleep(delay * (2**attempt))
        return self._error(502, f"prefill backend {b.name} failed: {last}", "prefill_unreachable")


class _Relay(StreamingResponse):
    """A streaming response that always closes its body iterator (so reservations are released
    at once, also when the client goes away mid-stream)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def serve_proxy(config: ProxyConfig, host: str, port: int,
                on_ready: Callable[[str], None] | None = None) -> int:
    """Serve the proxy with uvicorn until SIGINT/SIGTERM; `on_ready(url)` once it listens.

    Raises OSError naming host:port when the port cannot be bound.
    """
    proxy = PdProxy(config)
    sock = bind_listen(host, port)
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(proxy.app, log_level="warning", access_log=False,
                                           timeout_keep_alive=30, lifespan="on"))

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started and on_ready is not None:
            h = f"[{host}]" if ":" in host else host
            on_ready(f"http://{h}:{bound}")
        await task

    asyncio.run(main())
    return 0
