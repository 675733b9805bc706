"""Fallback guards and the BR-H degrade as pure logic (time passed in): each trigger trips at once,
recovery waits for the hold-down and for every check to pass, the hold-down doubles on repeated
trips up to its cap (hypothesis)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from shadow.active.fallback import TRIP_ORDER, Degrade, GuardConfig, Guards, HoldDown, Signals
from shadow.contracts.modes import TRANSITION_REASONS

CFG = GuardConfig(holddown_s=10.0, holddown_max_s=80.0, reset_after_s=600.0)


def test_trip_reasons_are_transition_reasons() -> None:
    assert set(TRIP_ORDER) <= set(TRANSITION_REASONS)


def test_a_decision_error_trips_at_once() -> None:
    g = Guards(CFG)
    assert g.decision(1.0, 0.001, error=False) is None
    assert g.decision(1.5, 0.001, error=True) == "decision_error"
    assert g.tripped == "decision_error" and g.trips == {"decision_error": 1}


def test_slow_decisions_trip_on_the_nth_within_the_window_only() -> None:
    c = GuardConfig(decision_budget_s=0.02, slow_count=3, slow_window_s=5.0)
    g = Guards(c)
    # two slow ones, then the window passes: the count starts again
    assert g.decision(0.0, 0.05, False) is None
    assert g.decision(1.0, 0.05, False) is None
    assert g.decision(6.5, 0.05, False) is None
    assert g.decision(7.0, 0.019, False) is None  # within budget: not counted
    assert g.decision(7.5, 0.05, False) is None
    assert g.decision(8.0, 0.05, False) == "decision_slow"


def test_upstream_failure_rate_of_one_upstream_trips_given_enough_calls() -> None:
    c = GuardConfig(upstream_error_rate=0.5, upstream_min_calls=10, upstream_window_s=10.0)
    g = Guards(c)
    t = 100.0
    for _ in range(20):  # healthy d0 traffic does not hide p0's failures
        assert g.upstream(t, "decode:d0", True) is None
    reasons = [g.upstream(t + 0.1 * i, "prefill:p0", False) for i in range(10)]
    assert reasons[:9] == [None] * 9 and reasons[9] == "upstream_errors"


@pytest.mark.parametrize(
    ("signals", "reason"),
    [
        (Signals(unreachable=frozenset({"d1"})), "worker_down"),
        (Signals(scrape_age_s={"d0": 1.0, "d1": 15.1}), "telemetry_stale"),
        (Signals(drift={"d0": 0.0, "d1": -16.5}), "drift"),
    ],
)
def test_health_signals_trip_with_their_reason(signals: Signals, reason: str) -> None:
    g = Guards(CFG)
    assert g.evaluate(0.0, Signals(drift={"d1": 16.0}, scrape_age_s={"d1": 15.0})) is None  # at threshold
    assert g.evaluate(1.0, signals) == ("trip", reason)
    assert g.tripped == reason


def test_recovery_needs_the_hold_down_and_every_check_passing() -> None:
    g = Guards(CFG)
    bad, good = Signals(drift={"d0": 40.0}), Signals()
    assert g.evaluate(0.0, bad) == ("trip", "drift")
    assert g.evaluate(5.0, good) is None  # hold-down (10 s) not over
    assert g.evaluate(11.0, bad) is None  # over, but drift still there
    assert g.holddown_left(11.0) == 0.0
    assert g.evaluate(12.0, good) == ("recover", "recovered")
    assert g.tripped is None


def test_the_hold_down_doubles_on_repeated_trips_and_resets_after_a_healthy_spell() -> None:
    g = Guards(CFG)
    bad, good = Signals(drift={"d0": 40.0}), Signals()
    t, holds = 0.0, []
    for _ in range(5):
        assert g.evaluate(t, bad) == ("trip", "drift")
        holds.append(g.hold.current_s)
        t += g.hold.current_s
        assert g.evaluate(t, good) == ("recover", "recovered")
        t += 1.0
    assert holds == [10.0, 20.0, 40.0, 80.0, 80.0]  # doubled, capped at 80
    t += 600.0  # healthy for reset_after_s
    assert g.evaluate(t, bad) == ("trip", "drift")
    assert g.hold.current_s == 10.0


step = st.tuples(
    st.floats(min_value=0.0, max_value=50.0),  # time advance
    st.sampled_from(["ok", "slow", "error", "drift", "down", "stale", "upstream_fail"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(step, min_size=1, max_size=80))
def test_never_recovers_before_the_hold_down_and_hold_down_stays_within_bounds(steps: list) -> None:  # type: ignore[type-arg]
    g = Guards(CFG)
    t = 0.0
    for dt, what in steps:
        t += dt
        sig = Signals(
            drift={"d0": 100.0} if what == "drift" else {},
            unreachable=frozenset({"d0"}) if what == "down" else frozenset(),
            scrape_age_s={"d0": 99.0} if what == "stale" else {},
        )
        was, at, hold = g.tripped, g.tripped_at, g.hold.current_s
        if what in ("slow", "error"):
            g.decision(t, 1.0 if what == "slow" else 0.0, what == "error")
        elif what == "upstream_fail":
            g.upstream(t, "decode:d0", False)
        verdict = g.evaluate(t, sig)
        if verdict is not None and verdict[0] == "recover":
            assert was is not None and t - at >= hold  # never before the hold-down
            assert g.failing(t, sig) is None  # and only with every check passing
        if g.tripped is not None:
            assert CFG.holddown_s <= g.hold.current_s <= CFG.holddown_max_s
        if was is None and g.tripped is not None:
            assert g.tripped in TRIP_ORDER


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1000.0), min_size=1, max_size=30))
@example([914.6101370232237, 100.0, 0.0])  # a CI run's: the float gap falls just short of the reset time
def test_hold_down_doubles_while_trips_follow_recoveries_closely(gaps: list[float]) -> None:
    h = HoldDown(5.0, 160.0, reset_after_s=100.0)
    t = 0.0
    prev: float | None = None
    recovered_at = 0.0
    for gap in gaps:
        hold = h.trip(t)
        # the gap as the clock gives it (t - recovered_at, not `gap`: 919.61 + 100.0 - 919.61 is
        # 99.99999999999994 in floats, a trip within the reset time)
        if prev is None:
            assert hold == 5.0
        elif t - recovered_at < 100.0:
            assert hold == min(prev * 2, 160.0)
        else:
            assert hold == 5.0
        t += hold
        h.recovered(t)
        recovered_at = t
        prev = hold
        t += gap


def test_degrade_reasons_and_its_own_hold_down() -> None:
    c = GuardConfig(calibration_max=0.1, calibration_min_samples=100, oracle_gap_max=0.5,
                    net_gain_min=0.0, net_gain_min_steps=100, holddown_s=10.0)
    d = Degrade(c)
    assert d.evaluate(0.0, Signals(calibration_error=0.3, calibration_samples=99)) is None  # too few
    assert d.evaluate(0.0, Signals(net_gain=-0.2, net_gain_steps=99)) is None
    bad = Signals(calibration_error=0.3, calibration_samples=500)
    assert d.evaluate(1.0, bad) == ("degrade", "calibration")
    assert d.evaluate(5.0, Signals()) is None  # hold-down
    assert d.evaluate(11.0, Signals()) == ("restore", "recovered")
    assert d.evaluate(12.0, Signals(oracle_gap=0.8)) == ("degrade", "oracle_gap")
    assert d.hold.current_s == 20.0  # doubled: the second degrade follows the restore closely
    assert d.evaluate(40.0, Signals()) == ("restore", "recovered")
    assert d.evaluate(41.0, Signals(net_gain=-0.01, net_gain_steps=1000)) == ("degrade", "net_gain")
    assert d.counts == {"calibration": 1, "oracle_gap": 1, "net_gain": 1}


def test_bad_config_is_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="hold-down cap"):
        GuardConfig(holddown_s=10, holddown_max_s=5).validate()
    with pytest.raises(ValueError, match=r"^--decision-budget must be > 0 s, got 0$"):  # named by its flag
        GuardConfig(decision_budget_s=0).validate()
    with pytest.raises(ValueError, match=r"^--trip-upstream-error-rate must be a fraction in \(0, 1\]"):
        GuardConfig(upstream_error_rate=0).validate()
