"""Racing a request's upstream work against its client going away.

`wait_disconnect(receive)` ends when the ASGI server reports the client gone; `race(aw, gone)`
awaits `aw` unless `gone` completes first, in which case `aw` is cancelled (and awaited to its end)
and `Gone` is raised. Nothing here keeps state between calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.types import Receive


class Gone(Exception):
    """The client went away while its request waited."""


async def wait_disconnect(receive: Receive) -> None:
    """Return once `receive` yields `http.disconnect` (the request body was read already)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def race(aw: Any, gone: asyncio.Future[Any]) -> Any:
    """Await `aw` unless the client goes first (then `Gone`, and `aw` is cancelled)."""
    task = asyncio.ensure_future(aw)
    if gone.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise Gone
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise Gone
