"""Process settings of the long-running servers: the event loop, the collector, open files."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import resource
from collections.abc import Callable, Coroutine
from typing import Any

LOOPS = ("auto", "asyncio", "uvloop")

Runner = Callable[[Coroutine[Any, Any, None]], None]


def loop_runner(kind: str) -> Runner:
    """asyncio.run, or uvloop's (`auto`: uvloop when installed); ValueError when `uvloop` is
    asked for and missing."""
    if kind not in LOOPS:
        raise ValueError(f"--loop must be one of {', '.join(LOOPS)}, got {kind!r}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ValueError("--loop uvloop needs the uvloop package") from None
        else:
            return uvloop.run
    return asyncio.run


#: the young generation's threshold of an analysis process (`shadow serve`): it allocates per event
#: and keeps every live request's state (~1M objects at G×B = 256×256), so a young collection every
#: 700 allocations cost it 6-7 CPU-s per 10 fleet-seconds there (bench/bench_analysis.py --stage,
#: node and centre in one process: GC 14.7 s at 700, 2.9 s at 50,000); a collection of 50,000 young
#: objects is still a pause of about a millisecond
ANALYSIS_YOUNG = 50_000


def tune_gc(young: int = 700) -> None:
    """Full (generation 2) collections are the relay's worst pauses: make them rare and leave the
    objects made so far out of them. Memory is still freed by reference counting. `young`: the
    first generation's threshold (700, Python's default, for the relay; `ANALYSIS_YOUNG` for an
    analysis process)."""
    gc.freeze()
    gc.set_threshold(young, 10, 1000)


def raise_fd_limit() -> None:
    """Lift the soft open-files limit to the hard one (each relayed request holds two sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard)
            )


async def cancel_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (when there is one) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
