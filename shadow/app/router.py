"""`shadow router` as a process: the stand-in router's proxy on one listener until a signal; its
spans go where the standard OTEL_* variables say (none unless they name an exporter)."""

from __future__ import annotations

import asyncio

from shadow.active.standin import RouterConfig, router_proxy
from shadow.app.process import announce, stop_event
from shadow.base.listener import AsgiListener
from shadow.telemetry.tracing import RoutingSpans, get_tracer, otlp_provider


async def serve(config: RouterConfig, host: str, port: int) -> None:
    """Serve the stand-in until SIGINT/SIGTERM, announcing `{"url": URL}` once it listens
    (OSError naming host:port when it cannot be bound)."""
    tracing = otlp_provider()
    spans = RoutingSpans(get_tracer(tracing)) if tracing is not None else None
    try:
        server = AsgiListener(router_proxy(config, spans=spans).app, host, port, name="shadow router")
        url = await server.start()
        stop = stop_event()
        announce({"url": url})
        await stop.wait()
        await server.stop()
    finally:
        if tracing is not None:
            tracing.shutdown()  # the last spans are exported


def run(config: RouterConfig, host: str, port: int) -> None:
    asyncio.run(serve(config, host, port))
