"""What the active proxy and the mode controller promise each other (types only, no behaviour).

The proxy asks `ModeSource.choose(request_id)` once per new request and routes it as told:
`shadow` passes it to the existing router, `active` runs the P/D flow with `policy`, `fallback`
runs it with round-robin. A canary fraction is resolved by the source (a request-id hash), so the
proxy only ever sees the three effective modes. The request keeps that choice until it ends.
The proxy reports what happened (`on_decision`, `on_upstream`, and how each request ended for its
client, `on_request`) so the source can trip fallback and judge a canary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

#: Modes an operator can set. `canary` routes a deterministic fraction actively.
Mode = Literal["shadow", "canary", "active", "fallback"]
MODES: tuple[Mode, ...] = ("shadow", "canary", "active", "fallback")

#: Modes a single request is routed in.
RouteMode = Literal["shadow", "active", "fallback"]

#: Closed set of reasons (metric label `reason`) for a mode transition or a fallback trip.
TRANSITION_REASONS: tuple[str, ...] = (
    "operator",  # admin API PUT /v1/mode
    "flag_file",  # the watched flag file was written
    "flag",  # the mode given at start by a command-line flag
    "config",  # ... by the YAML --config file
    "env",  # ... by the environment (SHADOW_SERVE_MODE)
    "default",  # ... by no source: the default mode
    "flag_error",  # a flag source was unreadable or invalid: mode forced to shadow
    "decision_error",  # a routing decision raised
    "decision_slow",  # decision time over budget N times in the window
    "drift",  # mirror drift over threshold
    "telemetry_stale",  # worker telemetry older than allowed
    "upstream_errors",  # upstream failure rate over threshold
    "worker_down",  # a worker unreachable
    "client_errors",  # shadow-routed requests failing for their clients over the threshold
    "slo_regression",  # shadow-routed TTFT or TPOT P50 over the threshold times the router's
    "canary_step",  # a canary step passed its analysis: the next step's fraction
    "canary_promoted",  # the last canary step passed: active
    "canary_failed",  # a canary step failed its analysis (or fallback tripped): back to shadow
    "recovered",  # hold-down expired and all checks pass: back to the configured mode
)

#: The start reasons: where the mode at start came from.
START_REASONS: tuple[str, ...] = ("flag", "config", "env", "default")

#: Closed set of reasons active BR-H degrades to BR-0.
DEGRADE_REASONS: tuple[str, ...] = ("calibration", "oracle_gap", "net_gain")


@dataclass(frozen=True)
class RouteChoice:
    """How one request is routed: its effective mode and the policy (`rr` in fallback, `router`
    in shadow mode = whatever the existing router does)."""

    mode: RouteMode
    policy: str


class ModeSource(Protocol):
    """The mode controller as the proxy sees it. All methods are cheap and never raise."""

    def choose(self, request_id: str) -> RouteChoice: ...

    def on_decision(self, seconds: float, error: BaseException | None = None) -> None:
        """One routing decision (or coalesced round) took `seconds`; `error` if it raised."""
        ...

    def on_upstream(self, worker: str, leg: str, ok: bool) -> None:
        """One upstream call (leg = prefill | decode | router) succeeded or failed."""
        ...

    def on_request(self, mode: str, outcome: str, status: int | None, ttft_s: float | None,
                   tpot_s: float | None) -> None:
        """A request routed in `mode` ended with `outcome` (OUTCOMES) and the HTTP `status` its
        client got; its time to first token and per output token when streamed."""
        ...


class StaticModeSource:
    """A fixed choice, for tests and for a proxy run without a controller."""

    def __init__(self, mode: RouteMode = "active", policy: str = "br0") -> None:
        fixed = {"active": policy, "fallback": "rr", "shadow": "router"}
        self.choice = RouteChoice(mode, fixed[mode])

    def choose(self, request_id: str) -> RouteChoice:
        return self.choice

    def on_decision(self, seconds: float, error: BaseException | None = None) -> None:
        return None

    def on_upstream(self, worker: str, leg: str, ok: bool) -> None:
        return None

    def on_request(self, mode: str, outcome: str, status: int | None, ttft_s: float | None,
                   tpot_s: float | None) -> None:
        return None
