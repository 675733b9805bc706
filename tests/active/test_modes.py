"""`ModeController` as the proxy and the operator see it: choices per mode, the canary hash,
flag errors, automatic fallback and recovery on a test clock, pin, BR-H degrade, the transition
log/count/span, the flag file, and the Prometheus families of COORDINATION's table."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shadow.active.calibration import CalibrationMonitor
from shadow.active.fallback import GuardConfig, Signals
from shadow.active.flagfile import MAX_FLAG_BYTES, FlagFileWatcher
from shadow.active.mode_metrics import ModeCollector
from shadow.active.modes import ModeConfig, ModeController, ModeSetting, canary_point
from shadow.contracts.events import Arrive, Finish
from shadow.contracts.modes import DEGRADE_REASONS, MODES, TRANSITION_REASONS, RouteChoice
from shadow.telemetry.attrs import MODE_FROM, MODE_REASON, MODE_TO
from shadow.telemetry.tracing import RoutingSpans


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(mode: str = "active", policy: str = "br0", **kw: object) -> tuple[ModeController, Clock]:
    clock = Clock()
    guards = GuardConfig(holddown_s=10.0, holddown_max_s=40.0)
    cfg = ModeConfig(mode=mode, policy=policy, guards=guards, **kw)  # type: ignore[arg-type]
    return ModeController(cfg, clock=clock), clock


def test_choices_per_mode() -> None:
    c, _ = make("shadow")
    assert c.choose("a") == RouteChoice("shadow", "router")
    c.apply(ModeSetting("active", "brh"), "operator")
    assert c.choose("a") == RouteChoice("active", "brh")
    c.apply(ModeSetting("fallback"), "operator")
    assert c.choose("a") == RouteChoice("fallback", "rr")
    assert c.snapshot()["policy"] == "rr" and c.snapshot()["configured_policy"] == "brh"


def test_canary_is_a_stable_fraction_of_request_ids() -> None:
    c, _ = make("canary", canary_fraction=0.25)
    ids = [f"req-{i}" for i in range(20_000)]
    active = [rid for rid in ids if c.choose(rid).mode == "active"]
    n, p = len(ids), 0.25
    assert abs(len(active) - n * p) < 5 * math.sqrt(n * p * (1 - p))  # ~ Binomial(n, p)
    assert all(c.choose(rid).mode == "active" for rid in active)  # same answer every time
    assert all(canary_point(rid) < 0.25 for rid in active)
    # a larger fraction keeps every id of the smaller one (monotone in the fraction)
    c.apply(ModeSetting("canary", canary_fraction=0.5), "operator")
    assert all(c.choose(rid).mode == "active" for rid in active)


def test_canary_point_does_not_depend_on_the_process() -> None:
    code = "from shadow.active.modes import canary_point; print(repr(canary_point('req-42')))"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {repr(canary_point("req-42"))}


def test_invalid_start_mode_means_shadow_counted_as_flag_error() -> None:
    c, _ = make("actve")
    assert c.choose("x") == RouteChoice("shadow", "router")
    snap = c.snapshot()
    assert snap["current"] == "shadow" and snap["transitions_total"] == {"shadow/flag_error": 1}
    assert "actve" in snap["last_flag_error"]
    with pytest.raises(ValueError, match="policy must be one of"):
        c.apply(ModeSetting("active", "nope"), "operator")
    assert c.snapshot()["current"] == "shadow"  # nothing changed


def test_a_decision_error_trips_fallback_and_recovery_honours_the_hold_down(
        caplog: pytest.LogCaptureFixture) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    c, clock = make("active", "br0")
    c.spans = RoutingSpans(provider.get_tracer("t"))
    caplog.set_level(logging.WARNING, logger="shadow.active.modes")
    c.on_decision(0.001, RuntimeError("boom"))
    assert c.choose("r1") == RouteChoice("fallback", "rr")
    snap = c.snapshot()
    assert snap["current"] == "fallback" and snap["fallback_reason"] == "decision_error"
    assert snap["transitions"][-1]["reason"] == "decision_error"
    lines = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
    assert lines[-1].startswith("shadow mode: active -> fallback (reason=decision_error")
    assert "\n" not in lines[-1]
    c.on_decision(0.5, RuntimeError("round-robin's round"))  # fallback's own rounds do not count
    c.check(Signals())
    assert c.choose("r2").mode == "fallback"  # hold-down not over
    clock.t += 10.0  # the error leaves the 10 s window and the 10 s hold-down is over
    c.check(Signals())
    assert c.choose("r3") == RouteChoice("active", "br0")
    assert c.snapshot()["transitions"][-1]["reason"] == "recovered"
    spans = [s for s in exporter.get_finished_spans() if s.name == "shadow.mode.transition"]
    got = [tuple((s.attributes or {}).get(k) for k in (MODE_FROM, MODE_TO, MODE_REASON)) for s in spans]
    assert got == [("shadow", "active", "environment"), ("active", "fallback", "decision_error"),
                   ("fallback", "active", "recovered")][1:]


def test_fallback_only_guards_active_and_canary() -> None:
    c, _ = make("shadow")
    c.on_decision(1.0, RuntimeError("x"))
    c.check(Signals(drift={"d0": 1e6}))
    assert c.snapshot()["current"] == "shadow" and c.snapshot()["trips"] == {}


inputs = st.lists(st.one_of(
    st.tuples(st.just("decision"), st.floats(0, 1), st.booleans()),
    st.tuples(st.just("upstream"), st.sampled_from(["d0", "p0"]), st.booleans()),
    st.tuples(st.just("check"), st.sampled_from(["drift", "down", "stale", "ok", "cal"]), st.just(0)),
    st.tuples(st.just("tick"), st.floats(0, 30), st.just(0)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(inputs, st.sampled_from(["active", "canary"]), st.sampled_from(["br0", "brh"]))
def test_a_pinned_mode_never_trips_nor_degrades(events: list, mode: str, policy: str) -> None:  # type: ignore[type-arg]
    c, clock = make(mode, policy, pin=True, canary_fraction=1.0)
    for kind, a, b in events:
        if kind == "decision":
            c.on_decision(a, RuntimeError() if b else None)
        elif kind == "upstream":
            c.on_upstream(a, "decode", b)
        elif kind == "check":
            c.check(Signals(drift={"d0": 99.0} if a == "drift" else {},
                            unreachable=frozenset({"d0"}) if a == "down" else frozenset(),
                            scrape_age_s={"d0": 1e4} if a == "stale" else {},
                            calibration_error=0.9 if a == "cal" else None, calibration_samples=10_000))
        else:
            clock.t += a
        assert c.choose("rid") == RouteChoice("active", policy)
    assert c.snapshot()["trips"] == {} and c.metrics()["fallback"] is False


def test_brh_degrades_to_br0_on_calibration_drift_and_comes_back() -> None:
    c, clock = make("active", "brh")
    bad = Signals(calibration_error=0.5, calibration_samples=1000)
    c.check(bad)
    assert c.choose("a") == RouteChoice("active", "br0")
    assert c.snapshot()["degraded_reason"] == "calibration" and c.degraded_total == {"calibration": 1}
    clock.t += 10.0
    c.check(Signals(calibration_error=0.01, calibration_samples=1000))
    assert c.choose("a") == RouteChoice("active", "brh")
    c2, _ = make("active", "br0")
    c2.check(bad)
    assert c2.degraded_total == {}  # only BR-H degrades


def test_calibration_monitor_scores_end_probabilities_against_outcomes() -> None:
    m = CalibrationMonitor(horizon=10)
    for i in range(400):  # every request ends after exactly 25 tokens; same prompt key
        m(Arrive(f"r{i}", 0.0, prompt_key="k"))
        m(Finish(f"r{i}", 1.0, "stop", 25))
        if i % 50 == 0:
            m.update()
    m.update()
    err, n = m.error()
    assert n > 0 and err is not None and err < 0.05  # a stable length is predicted well
    assert m.lookups == {"hit": 399, "miss": 1}
    for i in range(400):  # the length distribution shifts: predictions from the old one are off
        m(Finish(f"s{i}", 2.0, "stop", 3))
    m.update()
    err2, _ = m.error()
    assert err2 is not None and err2 > 0.2 > 4 * err  # 400 of ~1450 pairs now wrong by p = 1


def test_flag_file_changes_errors_and_recovery(tmp_path: Path) -> None:
    c, _ = make("shadow")
    f = tmp_path / "mode.yaml"
    w = FlagFileWatcher(str(f), c)
    w.poll()  # missing file: a flag error, reported once
    w.poll()
    assert c.snapshot()["transitions_total"]["shadow/flag_error"] == 1
    f.write_text('{"mode": "canary", "policy": "brh", "canary_fraction": 0.5}')
    w.poll()
    snap = c.snapshot()
    assert (snap["configured"], snap["configured_policy"], snap["canary_fraction"]) == ("canary", "brh", 0.5)
    assert snap["transitions"][-1]["reason"] == "flag_file"
    w.poll()  # unchanged: nothing new
    assert c.snapshot()["transitions_total"].get("canary/flag_file") == 1
    for bad in ("mode: [", "mode: turbo", "mode: active\nspeed: 3", "policy: br0", "pin: maybe\nmode: active",
                "x" * (MAX_FLAG_BYTES + 1)):
        f.write_text("mode: active\n")
        w.poll()
        assert c.snapshot()["current"] == "active"
        f.write_text(bad)
        w.poll()
        assert c.choose("x") == RouteChoice("shadow", "router"), bad
    assert c.snapshot()["transitions_total"]["shadow/flag_error"] == 7


def test_prometheus_families_follow_the_coordination_table() -> None:
    c, _ = make("active", "brh")
    cal = CalibrationMonitor()
    cal(Arrive("r", 0.0, prompt_key="k"))
    reg = CollectorRegistry()
    reg.register(ModeCollector(c, cal))
    c.on_decision(0.0, RuntimeError())
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    want = {
        "shadow_mode": ("gauge", {"mode"}),
        "shadow_mode_transitions": ("counter", {"mode", "reason"}),
        "shadow_mode_pinned": ("gauge", set()),
        "shadow_fallback_active": ("gauge", set()),
        "shadow_fallback_trips": ("counter", {"reason"}),
        "shadow_fallback_holddown_seconds": ("gauge", set()),
        "shadow_policy_active": ("gauge", {"policy"}),
        "shadow_policy_degraded": ("counter", {"reason"}),
        "shadow_predictor_calibration_error": ("gauge", set()),
        "shadow_predictor_key_lookups": ("counter", {"result"}),
        "shadow_predictor_oracle_gap_ratio": ("gauge", set()),
        "shadow_cohort_requests": ("counter", {"cohort", "result"}),
        "shadow_canary_step_fraction": ("gauge", set()),
        "shadow_canary_verdicts": ("counter", {"verdict"}),
        "shadow_canary_p_value": ("gauge", {"metric"}),
    }
    assert set(fams) == set(want)
    for name, (typ, labels) in want.items():
        assert fams[name].type == typ, name
        for s in fams[name].samples:
            assert set(s.labels) == labels, (name, s.labels)
    val = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert val[("shadow_mode", (("mode", "active"),))] == 1.0
    assert sum(v for (n, lab), v in val.items() if n == "shadow_mode") == 1.0
    assert val[("shadow_fallback_active", ())] == 1.0
    assert val[("shadow_fallback_trips_total", (("reason", "decision_error"),))] == 1.0
    assert val[("shadow_mode_transitions_total", (("mode", "fallback"), ("reason", "decision_error")))] == 1.0
    assert val[("shadow_policy_active", (("policy", "rr"),))] == 1.0
    assert val[("shadow_fallback_holddown_seconds", ())] == 10.0
    assert val[("shadow_predictor_key_lookups_total", (("result", "miss"),))] == 1.0
    for s in fams["shadow_mode_transitions"].samples:
        assert s.labels["mode"] in MODES and s.labels["reason"] in TRANSITION_REASONS
    assert {s.labels["reason"] for s in fams["shadow_policy_degraded"].samples} == set(DEGRADE_REASONS)


def test_oracle_gap_replays_the_recent_window_against_the_oracle() -> None:
    import random

    from shadow.active.oraclegap import OracleGap
    from shadow.contracts.events import Cancel, Route
    from shadow.core.params import BRParams
    from shadow.core.stepmodel import StepTimeModel

    g = OracleGap(4, 8, StepTimeModel(), BRParams(), window=200, min_jobs=100)
    rng = random.Random(1)
    t = 0.0
    for i in range(260):
        t += rng.expovariate(30.0)
        g(Arrive(f"r{i}", t, None))
        g(Route(f"r{i}", t, f"d{i % 4}", rng.randint(50, 400)))  # prompt size known at routing
        if i % 13 == 0:
            g(Cancel(f"r{i}", t + 0.5))  # cancelled: not in the window
        g(Finish(f"r{i}", t + 1.0, "stop", int(rng.lognormvariate(4.0, 1.0)) + 1))
    g(Finish("never-arrived", t, "stop", 5))
    jobs = g.jobs()
    assert len(jobs) == 200 and g.finished == 260 - 20
    assert jobs[0].arrival_s == 0.0 and all(j.prompt_tokens >= 50 for j in jobs)
    assert g.compute(jobs[:99]) is None  # too few
    gap = g.compute(jobs)
    assert gap is not None and math.isfinite(gap) and gap > -1.0


def test_slow_decisions_trip_on_exactly_the_nth_and_the_next_request_goes_round_robin() -> None:
    c, clock = make("active", "brh")  # budget 20 ms, 5 in 10 s
    for i in range(4):
        c.on_decision(0.05)
        c.on_decision(0.001)
        clock.t += 1.0
        assert c.choose(f"r{i}") == RouteChoice("active", "brh")
    c.on_decision(0.021)
    assert c.choose("next") == RouteChoice("fallback", "rr")
    trip = c.snapshot()["transitions"][-1]
    assert trip["reason"] == "decision_slow" and trip["observed"]["slow_decisions"] == 5
    assert trip["observed"]["decisions"] == 9


def test_upstream_failures_trip_and_on_calls_never_raise() -> None:
    c, _ = make("active", "br0")
    for _ in range(9):
        c.on_upstream("p0", "prefill", False)
    assert c.choose("x").mode == "active"
    c.on_upstream("p0", "prefill", False)
    assert c.snapshot()["fallback_reason"] == "upstream_errors"
    c.on_upstream(None, "decode", True)  # type: ignore[arg-type]  # garbage in: no exception out
    c.on_decision(float("nan"), None)
    assert c.snapshot()["observed"]["upstream_calls"] == 11


def test_the_mode_controller_refuses_the_retired_spelling_and_keeps_its_setting() -> None:
    refused = ModeController(ModeConfig(mode="active", policy="jsq"))  # at start: shadow, and why
    assert refused.choose("r0").mode == "shadow"
    assert "retired" in refused.snapshot()["last_flag_error"] and "say 'jsq-bytes'" in refused.last_error
    c = ModeController(ModeConfig(mode="active", policy="jsq-bytes"))
    with pytest.raises(ValueError, match="retired"):
        c.apply(ModeSetting("active", "jsq"), "operator")
    assert c.choose("r1").policy == "jsq-bytes"  # the refused setting changed nothing
    c.apply(ModeSetting("active", "br0"), "operator")
    assert c.choose("r1").policy == "br0"
    with pytest.raises(ValueError, match="policy must be one of"):
        ModeSetting("active", "jsq-count").validate()


def test_serve_refuses_the_retired_spelling_and_unknown_policies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from shadow.commands.serve import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--upstream", "d0=http://127.0.0.1:1", "--active-policy", "jsq"])
    err = capsys.readouterr().err
    assert "--active-policy" in err and "retired" in err and "say 'jsq-bytes'" in err
    assert build_parser().parse_args(["--upstream", "d0=http://127.0.0.1:1"]).active_policy == "br0"
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--upstream", "d0=http://127.0.0.1:1", "--active-policy", "jsq-count"])
    assert "policy must be one of br0, brh, rr, jsq-bytes, got 'jsq-count'" in capsys.readouterr().err
