"""`shadow capture` as a process: the mirror fed by a passive capture until a signal."""

from __future__ import annotations

import asyncio

from shadow.app.process import announce, stop_event
from shadow.mirror.config import MirrorConfig
from shadow.mirror.service import MirrorService

PROG = "shadow capture"


async def serve(config: MirrorConfig) -> None:
    """Run until SIGINT/SIGTERM (a second one exits at once). OSError when the packet socket
    cannot be opened (not root, no such interface)."""
    stop = stop_event(hard_exit=PROG)
    svc = MirrorService(config)
    announce(await svc.start())
    try:
        await stop.wait()
    finally:
        await svc.stop()


def run(config: MirrorConfig) -> None:
    """`serve` on asyncio (ValueError: bad configuration; OSError: socket, ports, files)."""
    asyncio.run(serve(config))
