"""The lanes' step model says where its samples came from, compares the configured model on the
report's own per-step mean, and says so when a·max L + b does not explain the engine's steps."""

from __future__ import annotations

import pytest

from shadow.contracts.events import Arrive, Event, Route, Step, Token
from shadow.core.stepmodel import StepTimeModel
from shadow.live.lanes import LiveLanes
from tests.live.sessions import feed


def _lanes(events: list[Event]) -> dict[str, object]:
    live = LiveLanes(workers=["d0", "d1"], slots=64, policies=["br0"], lag_s=0.0,
                     step=StepTimeModel(a=0.0, b=0.010), window_s=0.5)
    for ev in events:
        live.listener(ev)
        live.process_now()
    live._publish()
    return live.report()["step_model"]  # type: ignore[no-any-return]


def test_probe_steps_are_named_and_the_configured_model_is_judged_on_the_per_step_mean() -> None:
    # window 1: ten 10 ms steps; window 2: one 40 ms step. Per step: 140 ms / 11 = 12.73 ms (a mean of
    # the windows' means would say 25 ms, twice the report's figure)
    events: list[Event] = [Arrive("r", 0.0, 100), Route("r", 0.0, "d0", 100)]
    events += [Step(0.01 * (i + 1), 0.010, worker="d0", engine=0, source="probe") for i in range(10)]
    events += [Step(0.6, 0.040, worker="d0", engine=0, source="probe"), Arrive("z", 1.2, 1)]
    sm = _lanes(events)
    assert sm["samples_from"] == "the engine probe (the engine's own step times)"
    assert sm["step_event_sources"] == {"probe": 11}
    assert sm["measured_step_mean_s"]["events"] == pytest.approx(0.140 / 11)  # type: ignore[index]
    assert sm["measured_vs_configured"] == pytest.approx(0.140 / 11 / 0.010)


def test_steps_the_linear_model_cannot_explain_are_reported_as_such() -> None:
    """Step times unrelated to the mirrored max load (independent servers stepping apart): with
    enough samples the fit is poor, and the report says the linear model does not hold."""
    events: list[Event] = []
    t = 0.0
    for i in range(40):
        t += 0.5
        events += [Arrive(f"r{i}", t, 50 * (1 + i % 7)), Route(f"r{i}", t, f"d{i % 2}", 50 * (1 + i % 7))]
        d = (0.004, 0.019, 0.011, 0.007)[i % 4]  # no relation to the load
        events += [Step(t + 0.01, d, worker="d0", source="probe"),
                   Step(t + 0.02, d, worker="d1", source="probe")]
    live = LiveLanes(workers=["d0", "d1"], slots=64, policies=["br0"], lag_s=0.0, window_s=0.5)
    for ev in events:
        live.listener(ev)
        live.process_now()
    live._publish()
    rep = live.report()
    sm = rep["step_model"]
    assert sm["quality"] == "poor" and sm["linear_model_holds"] is False, sm
    assert any("does not hold" in w and "engine probe" in w for w in rep["warnings"]), rep["warnings"]


def _stream_and_steps(token_every: float, step_s: float, n: int = 120) -> list[Event]:
    """One stream whose tokens the tap sees every `token_every` s while the engine's probe reports
    steps of `step_s`."""
    events: list[Event] = [Arrive("r", 0.0, 50), Route("r", 0.0, "d0", 50)]
    for i in range(1, n + 1):
        t = i * token_every
        events += [Token("r", t, i), Step(t, step_s, worker="d0", source="probe")]
    return events


def test_the_sse_estimate_is_checked_against_the_probe_of_the_same_windows() -> None:
    ok = _lanes(_stream_and_steps(0.010, 0.010))["sse_check"]
    assert ok["trusted"] is True and ok["ratio"] == pytest.approx(1.0, abs=0.02), ok
    # chunks arriving every 30 ms while the engine steps in 10 ms: the gaps are not steps
    off = _lanes(_stream_and_steps(0.030, 0.010))["sse_check"]
    assert off["trusted"] is False and off["ratio"] == pytest.approx(3.0, rel=0.05), off
    assert "merges several tokens" in off["reason"] and "+200% off" in off["reason"]
    none = _lanes([Arrive("r", 0.0, 50), Route("r", 0.0, "d0", 50)]
                  + [Token("r", 0.01 * i, i) for i in range(1, 100)])["sse_check"]
    assert none["trusted"] is None and "no worker-reported steps" in none["reason"]


def _two_servers(fast: float, slow: float, seconds: float = 12.0, *, shared: bool = False) -> LiveLanes:
    """Two workers with one stream each, their probes reporting steps `fast` and `slow` s apart
    (independent servers), or both on the slow one's step ends (`shared`: one barrier)."""
    live = LiveLanes(workers=["d0", "d1"], slots=8, policies=["br0"], lag_s=0.0, window_s=0.5)
    events: list[Event] = []
    for g in range(2):
        events += [Arrive(f"r{g}", 0.0, 100), Route(f"r{g}", 0.0, f"d{g}", 100)]
    for g, period in enumerate((slow, slow) if shared else (fast, slow)):
        t, n = 0.0013 * g * (not shared), 0
        while t < seconds:
            t += period
            n += 1
            events += [Step(t, 0.8 * period, worker=f"d{g}", source="probe", interval_s=period),
                       Token(f"r{g}", t, n)]
    events.sort(key=lambda e: e.t)
    return feed(live, events)


def test_independent_servers_get_a_clock_each_from_the_probe() -> None:
    """The issue's two real servers, 3.9 vs 18.9 ms: no shared barrier, each worker's lane clock is
    its own measured step period (the probe's interval between busy steps), said in the report."""
    live = _two_servers(0.0039, 0.0189, seconds=30.0)
    sm = live.report()["step_model"]
    clock = sm["clock"]
    assert sm["model_in_use"] == "per worker" and clock["groups"] == [["d0"], ["d1"]], clock
    assert sm["model_source"] == "probe" and sm["figures_use"] == "measured"
    w0, w1 = clock["workers"]["d0"], clock["workers"]["d1"]
    assert w0["source"] == w1["source"] == "probe"
    assert w0["mean_step_s"] == pytest.approx(0.0039, rel=0.01)
    assert w1["mean_step_s"] == pytest.approx(0.0189, rel=0.01)
    # the loads do not drive these steps: the linear fit cannot hold, the mean step is the clock
    assert w0["model"] == "mean step" and w0["a_s_per_token"] == 0
    assert w0["b_s"] == pytest.approx(0.0039, rel=0.01)
    assert live.lane_clock.groups == ((0,), (1,))
    assert [m.b for m in live.lane_clock.models or ()] == pytest.approx([0.0039, 0.0189], rel=0.01)
    # the recent windows' steps against the clock the lanes stepped on in them
    assert sm["measured_vs_clock"] == pytest.approx(1.0, abs=0.05)


def test_ranks_behind_one_barrier_share_the_fleet_wide_model() -> None:
    live = _two_servers(0.0189, 0.0189, shared=True)
    sm = live.report()["step_model"]
    assert sm["model_in_use"] == "fleet-wide barrier" and sm["clock"]["groups"] == [["d0", "d1"]], sm["clock"]
    assert live.lane_clock.groups == ((0, 1),)
    assert sm["clock"]["coincidence"]["d0~d1"] == pytest.approx(1.0)


def test_the_configured_lane_clock_is_kept_when_asked() -> None:
    live = LiveLanes(workers=["d0", "d1"], slots=8, policies=["br0"], lane_clock="configured")
    sm = live.report()["step_model"]
    assert sm["model_in_use"].endswith("(--lane-clock configured)") and sm["model_source"] == "configured"
    assert sm["figures_use"] == "configured"
    with pytest.raises(ValueError, match="lane clock"):
        LiveLanes(workers=["d0"], slots=8, lane_clock="guessed")
