"""One ASGI app served by uvicorn on one listening socket, inside the running event loop.

Only the simulated fleet serves through it, on purpose: vLLM's API server is uvicorn, so the fleet
answers on the wire as uvicorn does (keep-alive, errors, chunking). Every listener of shadow's own
(router, active proxy, analysis API) is `shadow.base.listener.AsgiListener`, with its caps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import uvicorn

from shadow.base.net import bind_listen

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]
Lifespan = Literal["auto", "on", "off"]
TICK_S = 1.0  # how often the Date header is refreshed (uvicorn's own main loop does it as often)
# How uvicorn reports an app that ended a response without completing it: our proxies do that on
# purpose to abort a stream that was cut upstream (after logging the cause themselves).
INCOMPLETE = "ASGI callable returned without completing response."


class _DeliberateAbort(logging.Filter):
    """Drops uvicorn's error line for a response an app left incomplete on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != INCOMPLETE


def _quiet_deliberate_aborts() -> None:
    log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DeliberateAbort) for f in log.filters):
        log.addFilter(_DeliberateAbort())


class AppServer:
    """`await start()` listens on host:port (0: a free port, kept for a restart) and returns the
    base URL; `await stop(grace_s)` stops accepting, lets open requests finish for up to `grace_s`
    and drops the rest; `await crash()` drops every connection at once. Either may be followed by
    `start()` again. Signals stay with the host process (uvicorn's own loop and handlers never run).
    """

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        lifespan: Lifespan = "on",
        keep_alive_s: float = 30.0,
    ) -> None:
        self.app, self.host, self.port = app, host, port
        self.lifespan, self.keep_alive_s = lifespan, keep_alive_s
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self._ticker: asyncio.Task[None] | None = None

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self, sock: socket.socket | None = None) -> str:
        """Listen (on `sock` when given, else a new socket on host:port; OSError names it)."""
        if self._server is not None:
            return self.url
        sock = sock if sock is not None else bind_listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        _quiet_deliberate_aborts()
        config = uvicorn.Config(
            self.app, log_config=None, log_level="warning", access_log=False, lifespan=self.lifespan,
            timeout_keep_alive=int(self.keep_alive_s), proxy_headers=False,
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        try:
            await server.startup(sockets=[sock])
        except SystemExit:  # uvicorn exits when the app's lifespan startup fails
            sock.close()
            raise RuntimeError(f"the app on {self.url} failed to start (see its log)") from None
        await server.on_tick(0)
        self._server, self._sock = server, sock
        self._ticker = asyncio.get_running_loop().create_task(self._tick(server))
        return self.url

    async def stop(self, grace_s: float = 5.0) -> None:
        server = self._close_listening()
        if server is None:
            return
        for conn in list(server.server_state.connections):
            conn.shutdown()  # idle ones close now, busy ones after their response
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while server.server_state.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await self._drop(server)

    async def crash(self) -> None:
        """Stop listening and reset every open connection now."""
        server = self._close_listening()
        if server is not None:
            await self._drop(server)

    async def _tick(self, server: uvicorn.Server) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await server.on_tick(0)

    def _close_listening(self) -> uvicorn.Server | None:
        server, sock, ticker = self._server, self._sock, self._ticker
        self._server = self._sock = self._ticker = None
        if server is None:
            return None
        if ticker is not None:
            ticker.cancel()
        for s in server.servers:
            s.close()
        if sock is not None:
            sock.close()
        return server

    @staticmethod
    async def _drop(server: uvicorn.Server) -> None:
        """Abort what is still open, cancel its request tasks, end the app's lifespan."""
        for conn in list(server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()
        for task in list(server.server_state.tasks):
            task.cancel()
        await asyncio.sleep(0)
        with contextlib.suppress(Exception):
            await server.lifespan.shutdown()
