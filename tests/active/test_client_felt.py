"""Fallback on what clients feel, and the canary analysis, on the mode controller with a fake
clock: rejections/errors of shadow-routed requests trip `client_errors` (rate over a window with a
minimum count; a client's own 4xx and cancels never count), TTFT/TPOT regressions trip
`slo_regression` (against the router cohort in canary, the shadow-mode baseline in active); a
canary with steps is promoted step by step when no worse, else ends in shadow with the reason."""

from __future__ import annotations

import logging
import random

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shadow.active.canary import CanaryConfig
from shadow.active.cohorts import ClientConfig
from shadow.active.fallback import GuardConfig, Signals
from shadow.active.mode_metrics import ModeCollector
from shadow.active.modes import ModeConfig, ModeController, ModeSetting
from shadow.telemetry.tracing import RoutingSpans


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(mode: str = "active", **kw: object) -> tuple[ModeController, Clock]:
    clock = Clock()
    cfg = ModeConfig(mode=mode, guards=GuardConfig(holddown_s=10.0), **kw)  # type: ignore[arg-type]
    return ModeController(cfg, clock=clock), clock


def feed(c: ModeController, mode: str, n: int, *, fail: int = 0, status: int = 503, ttft: float = 0.1,
         tpot: float = 0.02, outcome: str = "rejected") -> None:
    for i in range(n):
        if i < fail:
            c.on_request(mode, outcome, status, None, None)
        else:
            c.on_request(mode, "ok", 200, ttft, tpot)


def test_rejections_of_shadow_routed_requests_trip_client_errors_at_the_minimum_count() -> None:
    c, clock = make("active")
    feed(c, "active", 19, fail=19)  # one short of the minimum count
    c.check(Signals())
    assert c.snapshot()["current"] == "active"
    feed(c, "active", 1, fail=1)
    c.check(Signals())
    snap = c.snapshot()
    assert snap["current"] == "fallback" and snap["fallback_reason"] == "client_errors"
    assert "20 of 20 shadow-routed requests failed" in snap["transitions"][-1]["detail"]
    assert snap["cohorts"] == {"shadow/failed": 20}
    clock.t += 31.0  # the failures leave the window; the hold-down is over: recovered
    c.check(Signals())
    assert c.snapshot()["current"] == "active"


def test_a_clients_own_4xx_and_cancels_never_count_and_the_rate_needs_its_share() -> None:
    c, _ = make("active")
    feed(c, "active", 50, fail=50, status=400)  # the client's own bad requests
    feed(c, "active", 50, fail=50, status=413)
    for _ in range(50):
        c.on_request("active", "client_cancel", None, None, None)
    feed(c, "shadow", 50, fail=50, outcome="upstream_error", status=502)  # the router's, not ours
    feed(c, "fallback", 50, fail=50)  # round-robin's rounds say nothing about the policy
    c.check(Signals())
    assert c.snapshot()["current"] == "active"
    feed(c, "active", 100, fail=19, outcome="upstream_error", status=502)  # 19 % < 20 %
    c.check(Signals())
    assert c.snapshot()["current"] == "active"
    feed(c, "active", 2, fail=2, outcome="upstream_error", status=502)  # 21 of 102
    c.check(Signals())
    assert c.snapshot()["fallback_reason"] == "client_errors"


def test_ttft_regression_trips_against_the_router_in_canary_and_the_baseline_in_active() -> None:
    c, clock = make("canary", canary_fraction=0.5)
    feed(c, "shadow", 40, ttft=0.1)
    feed(c, "active", 40, ttft=0.19)  # under 2x
    c.check(Signals())
    assert c.snapshot()["current"] == "canary"
    feed(c, "active", 60, ttft=0.5)
    c.check(Signals())
    snap = c.snapshot()
    assert snap["fallback_reason"] == "slo_regression" and "router-routed, same window" in \
        snap["transitions"][-1]["detail"]
    a, clock = make("shadow")
    feed(a, "shadow", 200, ttft=0.1, tpot=0.02)  # the shadow-mode baseline
    clock.t += 60.0
    a.apply(ModeSetting("active"), "operator")
    feed(a, "active", 40, ttft=0.1, tpot=0.05)  # TPOT 2.5x the baseline's
    a.check(Signals())
    snap = a.snapshot()
    assert snap["fallback_reason"] == "slo_regression"
    assert "TPOT" in snap["transitions"][-1]["detail"] and "baseline" in snap["transitions"][-1]["detail"]


CANARY = CanaryConfig(steps=(0.1, 0.25, 0.5), min_requests=40, min_step_s=5.0, max_step_s=60.0,
                      spread_batch=4)


def canary_run(worse_ttft: float, worse_errors: int = 0) -> tuple[ModeController, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = Clock()
    c = ModeController(ModeConfig(mode="shadow", canary=CANARY), clock=clock,
                       spans=RoutingSpans(provider.get_tracer("t")))
    rng = random.Random(7)
    for _ in range(120):  # baseline spread while shadow routes nothing
        c.check(Signals(spread_tokens=100 + rng.random() * 10))
        clock.t += 0.25
    c.apply(ModeSetting("canary"), "operator")
    assert c.snapshot()["canary_fraction"] == 0.1
    for _ in range(400):
        if c.snapshot()["configured"] != "canary":
            break
        for _ in range(3):
            c.on_request("shadow", "ok", 200, 0.1 + rng.random() * 0.05, 0.02 + rng.random() * 0.005)
            failed = rng.random() < worse_errors / 100
            c.on_request("active", "rejected" if failed else "ok", 503 if failed else 200,
                         None if failed else worse_ttft + rng.random() * 0.05, 0.02 + rng.random() * 0.005)
        c.check(Signals(spread_tokens=80 + rng.random() * 10))
        clock.t += 0.25
    return c, exporter


def test_a_canary_no_worse_is_promoted_step_by_step_with_every_verdict_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shadow.active.modes")
    c, exporter = canary_run(worse_ttft=0.1)
    snap = c.snapshot()
    assert snap["configured"] == "active" and snap["current"] == "active"
    report = snap["canary"]
    assert report["outcome"] == "promoted"
    assert [(v["fraction"], v["verdict"]) for v in report["verdicts"]] == [(0.1, "pass"), (0.25, "pass"),
                                                                           (0.5, "promoted")]
    for v in report["verdicts"]:
        f = v["figures"]
        assert f["requests"]["canary"] >= 40 and f["requests"]["router"] >= 40
        assert f["error_rate"]["test"] == "fisher_exact_greater"
        assert f["ttft"]["test"] == f["tpot"]["test"] == "mann_whitney_u_noninferiority"
        assert f["ttft"]["p"] < 0.05 and f["ttft"]["margin"] == 0.25 and f["tpot"]["margin"] == 0.10
        assert f["spread"]["p"] is not None and f["spread"]["canary"] < f["spread"]["router"]
    reasons = [t["reason"] for t in snap["transitions"]]
    assert reasons[-3:] == ["canary_step", "canary_step", "canary_promoted"]
    lines = [r.getMessage() for r in caplog.records if "canary step" in r.getMessage()]
    assert len(lines) == 3 and all("\n" not in x and "p=" in x for x in lines)
    spans = [s for s in exporter.get_finished_spans() if s.name == "shadow.canary.verdict"]
    assert [(s.attributes or {})["shadow.canary.verdict"] for s in spans] == ["pass", "pass", "promoted"]
    assert "shadow.canary.ttft.p" in (spans[0].attributes or {})
    text = "\n".join(str(m) for m in ModeCollector(c).collect())
    assert "shadow_canary_verdicts_total" in text and "shadow_canary_p_value" in text


def test_a_canary_worse_within_the_margin_is_promoted() -> None:
    """TTFT 12 % worse (clearly: a difference test rejects "no different") but within the 25 % margin:
    tolerated, as canary analysis judges against a stated tolerance."""
    c, _ = canary_run(worse_ttft=0.115)
    report = c.snapshot()["canary"]
    assert report["outcome"] == "promoted", report["verdicts"]
    last = report["verdicts"][-1]["figures"]["ttft"]
    assert 1.05 < last["ratio"] < 1.25 and last["p_worse"] < 0.001 and last["p"] < 0.05


@pytest.mark.parametrize(("ttft", "errors", "why"), [(0.16, 0, "TTFT not shown within 25%"),
                                                     (0.1, 10, "error rate")])
def test_a_worse_canary_ends_in_shadow_with_the_reason(ttft: float, errors: int, why: str) -> None:
    # worse beyond the margins, within the fast fallback thresholds (2x TTFT, 20 % errors)
    c, _ = canary_run(worse_ttft=ttft, worse_errors=errors)
    snap = c.snapshot()
    assert snap["configured"] == "shadow" and snap["canary"]["outcome"] == "failed"
    last = snap["transitions"][-1]
    assert last["reason"] == "canary_failed" and why in last["detail"]


def test_a_step_without_enough_requests_ends_the_canary() -> None:
    c, clock = make("shadow", canary=CANARY)
    c.apply(ModeSetting("canary"), "operator")
    feed(c, "shadow", 100)
    feed(c, "active", 10)
    clock.t += 61.0
    c.check(Signals())
    assert c.snapshot()["configured"] == "shadow"
    assert "not enough requests" in c.snapshot()["transitions"][-1]["detail"]


def test_a_fallback_trip_during_an_analysed_canary_ends_it_in_shadow() -> None:
    c, _ = make("shadow", canary=CANARY, clients=ClientConfig(client_min_requests=5))
    c.apply(ModeSetting("canary"), "operator")
    feed(c, "active", 10, fail=10)
    c.check(Signals())
    snap = c.snapshot()
    assert snap["configured"] == "shadow" and snap["current"] == "shadow"
    assert [t["reason"] for t in snap["transitions"][-2:]] == ["client_errors", "canary_failed"]
    assert "fallback tripped (client_errors)" in snap["transitions"][-1]["detail"]
    assert snap["canary"]["outcome"] == "failed" and snap["canary"]["verdicts"][-1]["verdict"] == "fail"
