"""A canary whose policy rejects what clients send, end to end: `shadow serve --active` in canary
at saturation with a Prompt Pool TTL too short for a request waiting for a slot (shadow's own
503s), behind the real Prometheus (shipped rules, `for:` 1s) and Alertmanager. The canary takes
every request id (`--canary-fraction 1`): beside a router cohort the pool's requests join the
queues the router's requests build at the workers (the ledger shows an over-full worker one free
slot a round), so they never wait in the pool long enough for its TTL to bite (at 0.5 and 0.9,
6 and 9 rejections in 2 minutes, far below the trip's 20 %). Nothing in shadow's internals
fails: no decision error, no worker down, no upstream error. The client-felt trigger trips fallback
on the rejections (reason client_errors, within its window), and ShadowFallbackActive reaches the
webhook."""

from __future__ import annotations

from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.telemetry.dashboards._kit import ANNOTATIONS
from tests.alerts.test_alertmanager_integration import Traffic
from tests.telemetry.active_stack import active_stack, require_active
from tests.telemetry.promql import substitute
from tests.telemetry.servers import Alertmanager, Prometheus, Webhook, wait_for

pytestmark = pytest.mark.integration


def _at(t: dict[str, str]) -> float:
    return datetime.fromisoformat(t["at"].replace("Z", "+00:00")).timestamp()


def _started(ctx: ExitStack, tmp: Path, extra: tuple[str, ...]) -> Any:
    """The active stack; tried again on a free port run taken by another process meanwhile."""
    for attempt in range(3):
        try:
            return ctx.enter_context(active_stack(tmp / f"stack{attempt}", policy="br0", extra=extra))
        except AssertionError as exc:
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def test_a_rejecting_canary_trips_client_errors_and_the_alert_fires(tmp_path: Path) -> None:
    require_active()
    hook = Webhook()
    for d in ("am", "prom", "stack0", "stack1", "stack2"):
        (tmp_path / d).mkdir()
    am = Alertmanager(tmp_path / "am", hook.url)
    try:
        wait_for(am.ready, 60, "alertmanager ready")
        extra = ("--pool-ttl", "0.001", "--canary-fraction", "1", "--trip-client-window", "30",
                 "--trip-client-min-requests", "20")
        with ExitStack() as stack_ctx:
            stack = _started(stack_ctx, tmp_path, extra)
            prom = Prometheus(tmp_path / "prom", [stack.api.removeprefix("http://")],
                              alertmanager=am.address, rule_for="1s")
            traffic = Traffic(stack.front, 32, max_tokens=200)  # 32 streams on 16 slots: the pool waits
            try:
                wait_for(prom.ready, 60, "prometheus ready")
                doc = wait_for(lambda: (d := httpx.get(stack.api + "/v1/mode", timeout=10).json())
                               ["fallback_reason"] == "client_errors" and d, 120, "the client_errors trip")
                trip = next(t for t in reversed(doc["transitions"]) if t["reason"] == "client_errors")
                assert trip["from"] == "canary" and trip["to"] == "fallback"
                assert "shadow-routed requests failed" in trip["detail"]
                start = next(t for t in doc["transitions"] if t["to"] == "canary")
                assert _at(trip) - _at(start) <= 30 + 5, (start, trip)  # within its window (+ slack)
                failed, ok = doc["cohorts"].get("shadow/failed", 0), doc["cohorts"].get("shadow/ok", 0)
                assert failed + ok >= 20 and failed >= 0.2 * (failed + ok), doc["cohorts"]
                assert doc["trips"] == {"client_errors": doc["trips"]["client_errors"]}  # nothing else
                alerts = wait_for(lambda: hook.firing("ShadowFallbackActive"), 90,
                                  "ShadowFallbackActive at the webhook")
                assert alerts[0]["labels"]["instance"] == stack.api.removeprefix("http://")
                trips = prom.query('shadow_fallback_trips_total{reason="client_errors"}')["data"]["result"]
                assert trips and float(trips[0]["value"][1]) >= 1
                rejected = prom.query('shadow_cohort_requests_total{cohort="shadow",result="failed"}')
                assert rejected["data"]["result"]
                # the dashboards mark the first trip of its reason (a series born at 1) at the first
                # scrape that saw it (on a loaded host that scrape can come seconds after the trip)
                mark = substitute(next(expr for name, _, expr in ANNOTATIONS if name == "Fallback trips"),
                                  {"fleet": ".*", "instance": ".*"})
                seen = prom.query('shadow_fallback_trips_total{reason="client_errors"}[15m]')
                seen = seen["data"]["result"]
                first = min(float(t) for series in seen for t, v in series["values"] if float(v) >= 1)
                assert first >= _at(trip) - 1, (first, trip)  # the sidecar's and Prometheus's clocks are one
                trip_marks = prom.query(mark, at=first)["data"]["result"]
                assert {r["metric"]["reason"] for r in trip_marks} == {"client_errors"}, trip_marks
            finally:
                traffic.stop()
                prom.close()
    finally:
        am.close()
        hook.close()
