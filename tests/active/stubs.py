"""Scripted upstreams for the active proxy's tests: a prefill server that returns a KV handle and a
decode/router server that answers each call by the next script entry (status, SSE events, pauses,
an abrupt cut), recording every request's headers and body. All run in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from shadow.active.ledger import LoadSource
from shadow.active.proxy import ActiveConfig, ActiveProxy
from shadow.base.appserver import AppServer
from shadow.base.listener import AsgiListener
from shadow.contracts.modes import ModeSource, StaticModeSource


class Cut(Exception):
    """Raised inside a stub stream: the connection drops without a clean end."""


@dataclass
class Step:
    """One call's answer: `status`, then `events` (bytes, written one per chunk); an item that is an
    asyncio.Event is awaited instead of written; `cut` drops the connection after the events."""

    status: int = 200
    events: list[Any] = field(default_factory=list)
    cut: bool = False
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def sse(text: str, i: int = 0, finish: str | None = None, stop_reason: Any = None) -> bytes:
    doc = {
        "id": f"cmpl-{i}",
        "object": "text_completion",
        "model": "m",
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
        ],
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class Stub:
    """A scripted server; `calls` holds (headers, parsed body or raw bytes) per request."""

    def __init__(self, script: list[Step] | Callable[[int, Any], Step], role: str = "decode") -> None:
        self.script = script
        self.role = role
        self.calls: list[tuple[dict[str, str], Any]] = []
        self.raws: list[bytes] = []
        self.gone = 0  # streams whose client went away
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._handle, methods=["POST"]),
                Route("/v1/chat/completions", self._handle, methods=["POST"]),
            ]
        )
        self.server = AppServer(self.app, lifespan="off")
        self.url = ""

    async def start(self) -> str:
        self.url = await self.server.start()
        return self.url

    def _next(self, body: Any) -> Step:
        n = len(self.calls) - 1
        if callable(self.script):
            return self.script(n, body)
        return self.script[min(n, len(self.script) - 1)]

    async def _handle(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = raw
        self.calls.append((dict(request.headers), body))
        self.raws.append(raw)
        if self.role == "prefill":
            return JSONResponse(
                {
                    "id": "p",
                    "choices": [{"text": "x"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1},
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "remote_request_id": f"kv-{len(self.calls)}",
                        "remote_block_ids": [1],
                    },
                }
            )
        step = self._next(body)
        if step.status != 200 or (not step.events and not step.cut):
            return Response(
                step.body, status_code=step.status, media_type="application/json", headers=step.headers
            )

        async def gen() -> AsyncIterator[bytes]:
            try:
                for ev in step.events:
                    if isinstance(ev, asyncio.Event):
                        await ev.wait()
                    else:
                        yield ev
                if step.cut:
                    raise Cut
            except asyncio.CancelledError:
                self.gone += 1
                raise

        return StreamingResponse(gen(), media_type="text/event-stream", headers=step.headers)

    async def stop(self) -> None:
        await self.server.stop(grace_s=1.0)


@contextlib.asynccontextmanager
async def proxy_on(
    decode: dict[str, str], *, modes: ModeSource | None = None, source: LoadSource | None = None, **kw: Any
) -> AsyncIterator[tuple[ActiveProxy, str]]:
    """An ActiveProxy served on a free port in this loop; yields (proxy, base URL)."""
    kw.setdefault("slots", 4)
    proxy = ActiveProxy(
        ActiveConfig(decode=decode, **kw), modes=modes or StaticModeSource("active", "br0"), source=source
    )
    server = AsgiListener(proxy.app, name="shadow proxy")  # the listener `shadow serve` puts it on
    url = await server.start()
    try:
        yield proxy, url
    finally:
        await server.stop(grace_s=2.0)


async def until(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Wait until `cond()` holds (polling the loop), or fail naming `what`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class FixedSource:
    """A load source that reports fixed running load per worker and knows none of the proxy's legs
    (so every leg the proxy dispatched stays virtual load on its worker)."""

    def __init__(self, kv: list[float], running: list[int]) -> None:
        self.kv, self.running = kv, running

    def counts(self) -> tuple[list[float], list[int]]:
        return list(self.kv), list(self.running)

    def known(self, request_id: str) -> bool:
        return False

    def live(self, request_id: str) -> bool:
        return False

    def down(self) -> list[int]:
        return []


def metric(proxy: ActiveProxy, name: str, **labels: str) -> float:
    v = proxy.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v
