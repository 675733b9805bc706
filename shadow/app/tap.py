"""`shadow tap` as a process: the mirror's `TapService` until a signal, drained on the way out."""

from __future__ import annotations

import asyncio

from shadow.app.process import announce, stop_event
from shadow.base.runtime import loop_runner, raise_fd_limit
from shadow.mirror.service import TapConfig, TapService

PROG = "shadow tap"


async def serve(config: TapConfig, drain_timeout_s: float = 30.0) -> None:
    """Run until SIGINT/SIGTERM (a second one exits at once), then let in-flight requests finish
    for up to `drain_timeout_s`. OSError when the relay process dies (the taps are down)."""
    raise_fd_limit()
    says = f"draining (up to {drain_timeout_s:g} s; a second signal exits now)"
    stop = stop_event(hard_exit=PROG, says=says)
    svc = TapService(config)
    announce(await svc.start(), latency=True)
    stopped = asyncio.ensure_future(stop.wait())
    relay_gone = asyncio.ensure_future(svc.relay_exited())
    try:
        await asyncio.wait({stopped, relay_gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in (stopped, relay_gone):
            f.cancel()
        await svc.stop(drain_timeout_s=drain_timeout_s)
    if relay_gone.done() and not relay_gone.cancelled():
        raise OSError(f"the relay process exited (code {relay_gone.result()}); the taps are down")


def run(config: TapConfig, drain_timeout_s: float = 30.0) -> None:
    """`serve` on the configured event loop (ValueError: bad configuration; OSError: ports, files)."""
    loop_runner(config.loop)(serve(config, drain_timeout_s))
