"""`shadow router` as a process: the stand-in router's proxy on one listener until a signal."""

from __future__ import annotations

import asyncio

from shadow.active.standin import RouterConfig, router_proxy
from shadow.app.process import announce, stop_event
from shadow.base.listener import AsgiListener


async def serve(config: RouterConfig, host: str, port: int) -> None:
    """Serve the stand-in until SIGINT/SIGTERM, announcing `{"url": URL}` once it listens
    (OSError naming host:port when it cannot be bound)."""
    server = AsgiListener(router_proxy(config).app, host, port, name="shadow router")
    url = await server.start()
    stop = stop_event()
    announce({"url": url})
    await stop.wait()
    await server.stop()


def run(config: RouterConfig, host: str, port: int) -> None:
    asyncio.run(serve(config, host, port))
