"""Step times from SSE gaps when deliveries are held up, and from reported steps with a hiccup.

A stream's chunks that are held up on their way (a stalled host, a fleet catching up on its
timeline, a relay that fell behind) arrive together: one gap long, the next ones near zero. No time
leaves the window, so a window's mean gap is the step; its median is not. The fits (the fleet's, on
`StepEstimator`'s figures, and a worker's in `WorkerClock`) must recover the step model through such
stalls, and a reported step's hiccup must still be one value among its window's.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from shadow.core.stepmodel import SlidingFit, StepTimeModel
from shadow.engine.config import LaneClock
from shadow.live.stepfit import RobustMean, StepEstimator, upper_median
from shadow.live.workerclock import WorkerClock

A, B = 6.0e-7, 0.010
WINDOW = 0.5


def _held_up_windows(seed: int, stalls: bool) -> list[tuple[float, npt.NDArray[np.float64]]]:
    """(load, per-token gaps) per 0.5 s window of one stream whose step follows A·L + B as the load
    ramps from 2k to 90k tokens; with `stalls`, deliveries are held 0.2-0.7 s every 1-3 s and what
    was emitted meanwhile arrives at the stall's end (gaps by arrival, in the window they end in)."""
    rng = np.random.default_rng(seed)
    loads = np.linspace(2_000, 90_000, 120)
    emit: list[float] = []
    t = 0.0
    for w, load in enumerate(loads):
        while t < (w + 1) * WINDOW:
            t += A * load + B
            emit.append(t)
    arrive = np.asarray(emit)
    if stalls:
        s = rng.uniform(1.0, 3.0)
        while s < arrive[-1]:
            e = s + rng.uniform(0.2, 0.7)
            held = (arrive >= s) & (arrive < e)
            arrive[held] = e + 1e-5 * np.arange(int(held.sum()))  # read one after another
            s = e + rng.uniform(1.0, 3.0)
    gaps = np.diff(arrive)
    window = (arrive[1:] // WINDOW).astype(int)
    return [(float(load), gaps[window == w]) for w, load in enumerate(loads) if (window == w).sum()]


def _fleet_fit(windows: list[tuple[float, npt.NDArray[np.float64]]]) -> tuple[float, float]:
    est, fit = StepEstimator(source="sse"), SlidingFit()
    est.due(0.0)
    for w, (load, gaps) in enumerate(windows):
        est.add_gaps(gaps)
        sample = est.close((w + 1) * WINDOW)
        if sample is not None:
            fit.add(load, sample[2])
    r = fit.result()
    assert r.a_s_per_token is not None and r.b_s is not None
    return r.a_s_per_token, r.b_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fleet_fit_recovers_the_step_model_through_held_up_deliveries(seed: int) -> None:
    windows = _held_up_windows(seed, stalls=True)
    # the premise: the held-up windows' medians are well off their steps (what the fit took before)
    off = [upper_median(g) / (A * load + B) for load, g in windows if (g < 1e-3).mean() > 0.2]
    assert off and min(off) < 0.5, off
    a, b = _fleet_fit(windows)
    assert a == pytest.approx(A, rel=0.03) and b == pytest.approx(B, rel=0.05), (a, b)
    # and as well as without the stalls
    a0, b0 = _fleet_fit(_held_up_windows(seed, stalls=False))
    assert a0 == pytest.approx(A, rel=0.01) and b0 == pytest.approx(B, rel=0.02), (a0, b0)


def test_a_workers_linear_fit_recovers_its_step_model_through_held_up_deliveries() -> None:
    clock = WorkerClock(1, StepTimeModel(1e-9, 0.05))
    lanes = LaneClock.barrier(1)
    for load, gaps in _held_up_windows(4, stalls=True):
        clock.add_loads([load])
        clock.add_gaps([gaps])
        clock.close(lanes)
    model = clock.worker_model(0)
    assert model.kind == "linear fit" and model.source == "sse", model
    assert model.model.a == pytest.approx(A, rel=0.03) and model.model.b == pytest.approx(B, rel=0.05), model


def test_a_whole_window_beyond_the_clamp_is_left_out_and_a_lasting_change_is_taken() -> None:
    robust = RobustMean(windows=9, clamp=4.0)
    for _ in range(5):
        assert len(robust.add(np.full(10, 0.01), whole=True)) == 10
    # a window whose mean is beyond 4 × the reference: none of it is kept, the mean does not move
    assert len(robust.add(np.full(10, 0.05), whole=True)) == 0
    assert robust.mean() == pytest.approx(0.01)
    # one long gap in a window whose mean is within the clamp is kept whole (its time is real)
    kept = robust.add(np.array([0.2] + [0.0] * 19 + [0.01] * 20), whole=True)
    assert len(kept) == 40
    # windows of zero gaps only (chunks read together, their gap in an earlier window) are no figure:
    # however many, the reference stays and later windows are kept
    for _ in range(12):
        assert len(robust.add(np.zeros(10), whole=True)) == 0
    assert robust.reference() == pytest.approx(0.01)
    # once most recent windows agree on a new step, it is the reference, and such windows are kept
    for _ in range(6):
        robust.add(np.full(10, 0.05), whole=True)
    assert robust.reference() == pytest.approx(0.05)
    assert len(robust.add(np.full(10, 0.05), whole=True)) == 10


def test_a_reported_steps_hiccup_is_one_value_among_its_windows() -> None:
    est = StepEstimator(source="events")
    est.due(0.0)
    est.add_steps([0.02] * 30)
    _source, mean, figure = est.close(0.5) or ("", 0.0, 0.0)
    assert mean == pytest.approx(0.02) and figure == 0.02
    est.add_steps([0.02] * 29 + [0.06])  # within the clamp: in the mean, not in the figure
    _source, mean, figure = est.close(1.0) or ("", 0.0, 0.0)
    assert mean == pytest.approx(0.64 / 30) and figure == 0.02
