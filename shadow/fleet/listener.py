"""One listening port served by uvicorn, with start / crash (stop listening and drop every
connection at once) / graceful stop, and restart on the same port after a crash.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from shadow.base.net import bind_listen
from shadow.fleet.asgi import Receive, Scope, Send


class _App:
    """Typed indirection so uvicorn sees a plain ASGI3 callable."""

    def __init__(self, target: object) -> None:
        self._target = target

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._target(scope, receive, send)  # type: ignore[operator]


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket; bind errors name host:port (see `shadow.base.net`)."""
    return bind_listen(host, port)


class Listener:
    """uvicorn on one (host, port); `port` 0 picks a free port, kept across crashes."""

    def __init__(self, app: object, host: str, port: int) -> None:
        self._app = _App(app)
        self.host = host
        self.port = port
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None

    @property
    def listening(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        if self._server is not None:
            return
        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app,
            log_config=None,
            access_log=False,
            lifespan="off",
            proxy_headers=False,
            server_header=True,
            date_header=True,
            timeout_graceful_shutdown=1,
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        await server.on_tick(0)
        self._server, self._sock = server, sock

    async def tick(self) -> None:
        """Refresh the Date header (uvicorn's own loop is not run)."""
        if self._server is not None:
            await self._server.on_tick(0)

    def _close_listening(self) -> uvicorn.Server | None:
        server, sock = self._server, self._sock
        self._server = self._sock = None
        if server is None:
            return None
        for s in server.servers:
            s.close()
        if sock is not None:
            sock.close()
        return server

    @staticmethod
    def _abort_connections(server: uvicorn.Server) -> None:
        for conn in list(server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()

    async def crash(self) -> None:
        """Stop listening and reset every open connection now."""
        server = self._close_listening()
        if server is not None:
            self._abort_connections(server)
            await asyncio.sleep(0)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop listening, let open connections finish for up to `grace_s`, then drop them."""
        server = self._close_listening()
        if server is None:
            return
        for conn in list(server.server_state.connections):
            conn.shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while server.server_state.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self._abort_connections(server)
        await asyncio.sleep(0)
