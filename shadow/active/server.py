"""Serve an ASGI app (the active proxy) with uvicorn on a socket in the running event loop."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Literal

import uvicorn

from shadow.base.net import bind_listen


class AppServer:
    """`await start()` binds host:port (0 = free; OSError names it) and returns the base URL;
    `await stop()` lets in-flight requests finish (up to `grace_s`) and closes."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        lifespan: Literal["auto", "on", "off"] = "on",
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.lifespan = lifespan
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        sock = bind_listen(self.host, self.port)
        port = sock.getsockname()[1]
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app, log_level="warning", access_log=False, timeout_keep_alive=30, lifespan=self.lifespan
            )
        )
        # the host process owns SIGINT/SIGTERM (uvicorn would take them over for itself)
        self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("proxy server stopped while starting")
            await asyncio.sleep(0.005)
        h = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{h}:{port}"
        return self.url

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s)
        except TimeoutError:
            self._server.force_exit = True
            with contextlib.suppress(BaseException):
                await self._task
        self._server = None
        self._task = None
