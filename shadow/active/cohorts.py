"""What clients got, by cohort: the request outcomes the active proxy reports, and the fallback
checks read from them (pure: time is passed in).

Cohort `shadow` = requests routed by shadow's policy (mode `active`, in canary too); cohort
`router` = requests passed to the existing router (mode `shadow`). Fallback's round-robin rounds
belong to neither: they say nothing about the policy. A request *failed* when the client got an
error that is not its own: shadow's or an upstream's rejection (429/5xx, pool TTL, KV budget), an
upstream error, a cut stream, a stream that ended without its finish (`stream_incomplete`) or a
timeout (`contracts.labels.FAILED_OUTCOMES`); a client's own 4xx and a client's cancel do not count.

`ClientChecks.failing(now, window)` trips on
- `client_errors`: the shadow cohort's failed fraction over the last `client_window_s` at or above
  `client_error_rate`, with at least `client_min_requests` requests;
- `slo_regression`: the shadow cohort's TTFT or TPOT P50 over `slo_ratio` × the reference P50 with
  at least `slo_min_requests` on both sides; the reference is the router cohort in the same window
  (canary), else its most recent samples (the shadow-mode baseline, for active).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from shadow.base.knobs import AT_LEAST_ONE, OPEN_FRACTION, OVER_ONE, POSITIVE_S, check_knobs, knob
from shadow.core.stats import quantile

COHORTS = ("shadow", "router")


def client_fault(status: int | None) -> bool:
    """A 4xx that blames the request itself (429 is an overloaded upstream, not the client)."""
    return status is not None and 400 <= status < 500 and status != 429


def cohort_of(mode: str) -> str | None:
    """The cohort of a request routed in `mode` (None: fallback's, in no cohort)."""
    return {"active": "shadow", "shadow": "router"}.get(mode)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request as its client saw it."""

    t: float
    failed: bool
    ttft_s: float | None = None
    tpot_s: float | None = None


class CohortWindow:
    """The last `cap` outcomes of each cohort (kept past any window: the router cohort's last
    samples are the shadow-mode baseline once everything is routed actively)."""

    def __init__(self, cap: int = 4096) -> None:
        self.cap = cap
        self.outcomes: dict[str, deque[Outcome]] = {c: deque(maxlen=cap) for c in COHORTS}
        self.counts: dict[tuple[str, str], int] = {}  # (cohort, ok|failed) all time

    def add(self, cohort: str, outcome: Outcome) -> None:
        self.outcomes[cohort].append(outcome)
        key = (cohort, "failed" if outcome.failed else "ok")
        self.counts[key] = self.counts.get(key, 0) + 1

    def since(self, cohort: str, t0: float) -> list[Outcome]:
        """Outcomes of `cohort` at or after `t0` (oldest first)."""
        out: list[Outcome] = []
        for o in reversed(self.outcomes[cohort]):
            if o.t < t0:
                break
            out.append(o)
        out.reverse()
        return out

    def recent(self, cohort: str) -> list[Outcome]:
        return list(self.outcomes[cohort])


@dataclass(frozen=True)
class ClientConfig:
    """Thresholds of the client-felt fallback checks (defaults are `shadow serve`'s)."""

    client_error_rate: float = knob(
        0.2, "--trip-client-error-rate", "fraction of shadow-routed requests failing for their clients "
        "(rejections, upstream errors, cut streams, timeouts; not a client's own 4xx) over "
        "--trip-client-window that trips fallback ...", OPEN_FRACTION, metavar="FRACTION")
    client_min_requests: int = knob(
        20, "--trip-client-min-requests", "... given at least N of them", AT_LEAST_ONE, metavar="N")
    client_window_s: float = knob(
        30.0, "--trip-client-window", "window of the client-felt checks", POSITIVE_S, metavar="SECONDS")
    slo_ratio: float = knob(
        2.0, "--trip-slo-ratio", "shadow-routed TTFT or TPOT P50 over this many times the router-routed one "
        "(same window in canary, the recent shadow-mode baseline in active) trips fallback ...", OVER_ONE,
        metavar="RATIO")
    slo_min_requests: int = knob(
        30, "--trip-slo-min-requests", "... given N requests on both sides", AT_LEAST_ONE, metavar="N")

    def validate(self) -> None:
        """ValueError of one line naming the flag of a value out of its bound."""
        check_knobs(self)


def p50(values: Iterable[float | None]) -> tuple[float | None, int]:
    """(median of the values that are there, how many there are)."""
    got = [v for v in values if v is not None]
    return quantile(got, 0.5), len(got)


class ClientChecks:
    """See module docstring."""

    def __init__(self, config: ClientConfig) -> None:
        config.validate()
        self.config = config

    def failing(self, now: float, window: CohortWindow) -> tuple[str, str] | None:
        """(reason, one-line detail) of the first failing check, else None."""
        c = self.config
        mine = window.since("shadow", now - c.client_window_s)
        n = len(mine)
        failed = sum(o.failed for o in mine)
        if n >= c.client_min_requests and failed >= c.client_error_rate * n:
            return "client_errors", (f"{failed} of {n} shadow-routed requests failed in "
                                     f"{c.client_window_s:g} s (trips at {c.client_error_rate:.0%} of >= "
                                     f"{c.client_min_requests})")
        same = window.since("router", now - c.client_window_s)
        ref, label = (same, "router-routed, same window") if len(same) >= c.slo_min_requests else (
            window.recent("router"), "router-routed baseline")
        for name in ("ttft_s", "tpot_s"):
            got, n_got = p50(getattr(o, name) for o in mine if not o.failed)
            want, n_want = p50(getattr(o, name) for o in ref if not o.failed)
            if got is None or want is None or n_got < c.slo_min_requests or n_want < c.slo_min_requests:
                continue
            if got > c.slo_ratio * want:
                metric = name.removesuffix("_s").upper()
                return "slo_regression", (f"{metric} P50 {got * 1e3:.0f} ms of {n_got} shadow-routed "
                                          f"requests over {c.slo_ratio:g}x {want * 1e3:.0f} ms ({label}, "
                                          f"{n_want})")
        return None
