"""How a shadow server process runs: one JSON ready line on stdout, SIGINT/SIGTERM/SIGHUP to stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Mapping
from typing import Any

from shadow.base.runtime import tune_gc

#: The signals that stop a server (SIGHUP too: a closed terminal or `kill -HUP` is not a reason
#: to drop requests in flight without their drain).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_event(*, hard_exit: str | None = None, says: str | None = None) -> asyncio.Event:
    """An event the first SIGINT/SIGTERM/SIGHUP sets (on the running loop); with `hard_exit` (the
    program's name) a second signal ends the process at once, exit code 1; `says` is logged on
    stderr (after the program's name and the signal) when the first arrives."""
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set() and hard_exit is not None:
            logging.getLogger("shadow").warning("%s: second signal (%s), exiting now", hard_exit, sig.name)
            os._exit(1)
        if not stop.is_set() and says is not None:
            logging.getLogger("shadow").warning("%s: %s: %s", hard_exit or "shadow", sig.name, says)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)
    return stop


def announce(ready: Mapping[str, Any], *, latency: bool = False, young: int = 700) -> None:
    """Print the ready document as one JSON line; `latency`: first make full collections rare and
    leave the start-up objects out of them (servers on the request path; `young`: the first
    generation's threshold, `tune_gc`)."""
    if latency:
        tune_gc(young)
    print(json.dumps(ready), flush=True)
    logging.getLogger("shadow").info("ready", extra={"ready": dict(ready)})
