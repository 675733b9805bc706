"""A small vLLM-compatible upstream for tests: vLLM-format SSE and JSON, /metrics, /health.

Deterministic bytes for identical requests (ids from a body hash, fixed `created`), so a response
through a tap can be compared with one fetched directly. Test controls ride in the body under
"stub": {"tokens", "step_s", "error_after", "cut_after", "no_done", "status", "recompute"}.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

CREATED = 1796012760


class StubStats:
    def __init__(self) -> None:
        self.running = 0
        self.seen: list[dict[str, Any]] = []  # per request: rid, path, stream, kv


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def create_stub(name: str = "w", *, tokens: int = 8, step_s: float = 0.0, model: str = "m") -> FastAPI:
    app = FastAPI()
    stats = StubStats()
    app.state.stats = stats

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="{model}"}} {float(stats.running)}\n'
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} 0.0\n'
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} {min(1.0, stats.running / 64)}\n'
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def handle(request: Request, chat: bool) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        ctl = body.get("stub") or {}
        rid = request.headers.get("x-request-id")
        kv = body.get("kv_transfer_params")
        stream = bool(body.get("stream"))
        stats.seen.append({"rid": rid, "chat": chat, "stream": stream, "kv": kv})
        if ctl.get("status"):
            return JSONResponse(
                {
                    "error": {
                        "message": "stub failure",
                        "type": "BadRequestError",
                        "param": None,
                        "code": ctl["status"],
                    }
                },
                status_code=ctl["status"],
            )
        n = int(ctl.get("tokens", tokens))
        mt = body.get("max_tokens")
        if isinstance(mt, int):
            n = min(n, mt)
        delay = float(ctl.get("step_s", step_s))
        src = body.get("messages", body.get("prompt", ""))
        prompt_tokens = max(1, len(_dumps(src)) // 4)
        cid = ("chatcmpl-" if chat else "cmpl-") + hashlib.sha1(raw).hexdigest()[:16]
        obj = "chat.completion.chunk" if chat else "text_completion"
        so = body.get("stream_options") or {}
        include_usage = bool(so.get("include_usage"))
        continuous = include_usage and bool(so.get("continuous_usage_stats"))
        finish = "length" if isinstance(mt, int) and n >= mt else "stop"
        kv_out = None
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            kv_out = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [1, 2],
                "remote_engine_id": name,
                "remote_host": "127.0.0.1",
                "remote_port": 1,
            }

        if not stream:
            stats.running += 1
            try:
                if delay:
                    await asyncio.sleep(delay * n)
            finally:
                stats.running -= 1
            text = "".join(f" t{i}" for i in range(n))
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion" if chat else "text_completion",
                "created": CREATED,
                "model": model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "total_tokens": prompt_tokens + n,
                    "completion_tokens": n,
                },
            }
            if kv_out is not None:
                out["kv_transfer_params"] = kv_out
            return JSONResponse(out)

        async def gen() -> Any:
            stats.running += 1
            try:

                def usage(k: int) -> dict[str, int]:
                    return {
                        "prompt_tokens": prompt_tokens,
                        "total_tokens": prompt_tokens + k,
                        "completion_tokens": k,
                    }

                if chat:
                    first: dict[str, Any] = {
                        "id": cid,
                        "object": obj,
                        "created": CREATED,
                        "model": model,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                    if continuous:
                        first["usage"] = usage(0)
                    yield f"data: {_dumps(first)}\n\n"
                for i in range(n):
                    if delay:
                        await asyncio.sleep(delay)
                    if ctl.get("cut_after") is not None and i >= ctl["cut_after"]:
                        raise RuntimeError("stub: upstream cut")
                    if ctl.get("error_after") is not None and i >= ctl["error_after"]:
                        err = {
                            "error": {
                                "message": "Internal server error",
                                "type": "InternalServerError",
                                "param": None,
                                "code": 500,
                            }
                        }
                        yield f"data: {_dumps(err)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    last = i == n - 1
                    fr = finish if last else None
                    sr = "recomputed" if last and ctl.get("recompute") else None
                    if chat:
                        ch: dict[str, Any] = {
                            "index": 0,
                            "delta": {"content": f" t{i}"},
                            "logprobs": None,
                            "finish_reason": fr,
                        }
                    else:
                        ch = {
                            "index": 0,
                            "text": f" t{i}",
                            "logprobs": None,
                            "finish_reason": fr,
                            "stop_reason": sr,
                        }
                    if chat and sr:
                        ch["stop_reason"] = sr
                    chunk: dict[str, Any] = {
                        "id": cid,
                        "object": obj,
                        "created": CREATED,
                        "model": model,
                        "choices": [ch],
                    }
                    if continuous:
                        chunk["usage"] = usage(i + 1)
                    if last and kv_out is not None:
                        chunk["kv_transfer_params"] = kv_out
                    yield f"data: {_dumps(chunk)}\n\n"
                if include_usage:
                    u = {
                        "id": cid,
                        "object": obj,
                        "created": CREATED,
                        "model": model,
                        "choices": [],
                        "usage": usage(n),
                    }
                    yield f"data: {_dumps(u)}\n\n"
                if not ctl.get("no_done"):
                    yield "data: [DONE]\n\n"
            finally:
                stats.running -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    return app


class ThreadServer:
    """Serve an ASGI app with uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(
            app, log_level="critical", access_log=False, lifespan="off", timeout_keep_alive=30
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
