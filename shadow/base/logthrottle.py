"""Rate-limited log lines for inputs a peer controls (rejections): one line per key per interval."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

DEFAULT_INTERVAL_S = 10.0
MAX_KEYS = 1024  # distinct keys remembered; beyond it the oldest interval's keys are forgotten


class Throttled:
    """`warning(key, msg, *args)` logs at most once per `interval_s` per `key`; the next line of a
    key says how many were suppressed since its last one (`suppressed` field). `key` must come
    from a closed set (a reason, a route), never from the peer's bytes."""

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: Any, exc_info: bool = False, **extra: Any) -> bool:
        """Log (True) or count the line as suppressed (False); `exc_info`: with the exception being
        handled and its traceback."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        if len(self._last) >= MAX_KEYS and key not in self._last:
            self._last.clear()
            self._suppressed.clear()
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        self.logger.warning(msg, *args, extra={**extra, "suppressed": suppressed}, exc_info=exc_info,
                            stacklevel=2)
        return True
