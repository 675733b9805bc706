"""A small OpenAI-compatible stub server for the load-generator tests (vLLM wire format).

It serves ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` on a
free loopback port (uvicorn in a thread), streams vLLM-format SSE (``data: {...}\\n\\n``, a
role-only first chat chunk, a usage chunk when ``stream_options.include_usage``, then
``data: [DONE]``; optionally the finish reason in a separate chunk with empty content, as vLLM
sends it when the last step generates no text, e.g. EOS), honours ``max_tokens``/``ignore_eos``,
and records every request (body, headers, arrival time) and the maximum number of requests in
flight.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class StubConfig:
    """Behaviour of the stub (mutable between tests through ``StubServer.config``)."""

    model: str = "stub-model"
    ttft_s: float = 0.05  # delay before the first generated token
    itl_s: float = 0.01  # delay between generated tokens
    eos_after: int = 3  # without ignore_eos the "model" stops after this many tokens
    fail_ids: set[str] = field(default_factory=set)  # X-Request-Id -> HTTP 500 before streaming
    midstream_fail_ids: set[str] = field(default_factory=set)  # -> error event after one token
    short_ids: set[str] = field(default_factory=set)  # -> a clean end after one token: no finish, no [DONE]
    models_status: int = 200
    # The finish reason on a chunk of its own with empty content (text "" / delta.content ""),
    # `finish_delay_s` after the last token, instead of on the last token's chunk.
    separate_finish: bool = False
    finish_delay_s: float = 0.0
    usage: bool = True  # False: ignore stream_options.include_usage (no usage chunk)


@dataclass
class Recorded:
    """One request as the stub saw it."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    arrived: float  # time.perf_counter() at arrival


class StubServer:
    """The stub app plus its uvicorn server thread."""

    def __init__(self, config: StubConfig | None = None) -> None:
        self.config = config or StubConfig()
        self.requests: list[Recorded] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.max_chunks = 0  # most token chunks any one stream has sent (tests wait on it)
        self._lock = threading.Lock()
        self.app = self._build()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self, config: StubConfig | None = None) -> None:
        with self._lock:
            self.config = config or StubConfig()
            self.requests.clear()
            self.in_flight = 0
            self.max_in_flight = 0
            self.max_chunks = 0

    # -- bookkeeping -------------------------------------------------------------------------

    def _enter(self, rec: Recorded) -> None:
        with self._lock:
            self.requests.append(rec)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    # -- app ---------------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> Response:
            cfg = self.config
            if cfg.models_status != 200:
                return JSONResponse(
                    {"error": {"message": "nope", "code": cfg.models_status}}, cfg.models_status
                )
            return JSONResponse(
                {
                    "object": "list",
                    "data": [{"id": cfg.model, "object": "model", "created": 0, "owned_by": "stub"}],
                }
            )

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._generate(request, chat=True)

        return app

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        body = await request.json()
        rec = Recorded(
            request.url.path, body, {k.lower(): v for k, v in request.headers.items()}, time.perf_counter()
        )
        cfg = self.config
        rid = rec.headers.get("x-request-id", "")
        self._enter(rec)
        if rid in cfg.fail_ids:
            self._leave()
            return JSONResponse(
                {
                    "error": {
                        "message": "injected failure",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                },
                500,
            )
        max_tokens = int(body.get("max_tokens") or 16)
        n = max_tokens if body.get("ignore_eos") else min(max_tokens, cfg.eos_after)
        finish = "length" if n == max_tokens else "stop"
        prompt_tokens = self._prompt_tokens(body, chat)
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n}
        if not body.get("stream"):
            try:
                await asyncio.sleep(cfg.ttft_s + cfg.itl_s * (n - 1))
            finally:
                self._leave()
            text = "".join(f" t{i}" for i in range(n))
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                obj = "text_completion"
            return JSONResponse(
                {
                    "id": "cmpl-stub",
                    "object": obj,
                    "created": 0,
                    "model": cfg.model,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        include_usage = cfg.usage and bool((body.get("stream_options") or {}).get("include_usage"))
        midstream_fail = rid in cfg.midstream_fail_ids
        return StreamingResponse(
            self._stream(chat, n, finish, usage if include_usage else None, midstream_fail,
                         rid in cfg.short_ids),
            media_type="text/event-stream",
        )

    @staticmethod
    def _prompt_tokens(body: dict[str, Any], chat: bool) -> int:
        if chat:
            return sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        return len(str(body.get("prompt", "")).split())

    async def _stream(
        self, chat: bool, n: int, finish: str, usage: dict[str, int] | None, midstream_fail: bool,
        short: bool = False,
    ) -> AsyncIterator[bytes]:
        cfg = self.config
        cid = "chatcmpl-stub" if chat else "cmpl-stub"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(payload: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return event(
                {"id": cid, "object": obj, "created": 0, "model": cfg.model, "choices": choices, **extra}
            )

        left = False
        try:
            if chat:
                yield chunk(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            for i in range(n):
                await asyncio.sleep(cfg.ttft_s if i == 0 else cfg.itl_s)
                if midstream_fail and i == 1:
                    yield event(
                        {
                            "error": {
                                "message": "injected stream error",
                                "type": "InternalServerError",
                                "param": None,
                                "code": 500,
                            }
                        }
                    )
                    break
                fr = finish if i == n - 1 and not cfg.separate_finish else None
                yield chunk([self._choice(chat, f" t{i}", fr)])
                self.max_chunks = max(self.max_chunks, i + 1)
                if short:
                    return  # a body that ends cleanly, short: neither a finish reason nor [DONE]
            else:
                if cfg.separate_finish:
                    await asyncio.sleep(cfg.finish_delay_s)
                    yield chunk([self._choice(chat, "", finish)])
                if usage is not None:
                    yield chunk([], usage=usage)
            self._leave()
            left = True
            yield b"data: [DONE]\n\n"
        finally:
            if not left:
                self._leave()

    @staticmethod
    def _choice(chat: bool, text: str, finish_reason: str | None) -> dict[str, Any]:
        """One streamed choice in vLLM's shape (chat delta or completion text)."""
        if chat:
            return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": None}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> StubServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1, access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)


def free_port() -> int:
    """A loopback port nobody listens on (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
