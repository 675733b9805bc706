"""Log lines for refusals counted elsewhere (taps' rejected requests, refused worker scrapes): read
the counters on the analysis side, one rate-limited line per place and reason when they grew."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from shadow.base.logthrottle import Throttled

Counts = Callable[[], Iterable[tuple[str, Mapping[str, int]]]]


class RejectionLog:
    """`check()` logs, for every (place, reason) whose count grew since its last line, how many more
    there were (at most once per `interval_s` per key; the next line covers what was held back)."""

    def __init__(self, what: str, counts: Counts, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] | None = None) -> None:
        self.what, self.counts = what, counts
        self.throttle = Throttled(logger, interval_s, *(() if clock is None else (clock,)))
        self._logged: dict[tuple[str, str], int] = {}

    def check(self) -> None:
        for place, counts in self.counts():
            for reason, n in counts.items():
                key = (place, reason)
                more = n - self._logged.get(key, 0)
                if more > 0 and self.throttle.warning(f"{place}/{reason}", "%s %s: %d refused (%s)",
                                                      self.what, place, more, reason, reason=reason):
                    self._logged[key] = n
