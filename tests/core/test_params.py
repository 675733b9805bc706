"""BRParams and BRAParams reject every out-of-range knob with a message naming it, and accept the
documented edges (so a sweep at the boundary of a documented range is not refused)."""

from __future__ import annotations

import math

import pytest

from shadow.core.bra import BRAParams
from shadow.core.params import BRParams

ACCEPTED = [
    {"horizon": 0}, {"horizon": 4096}, {"alpha": 0.5, "beta": 0.6}, {"gamma": 1.0}, {"gamma": 1e-9},
    {"s_greedy": 0}, {"s_greedy": None}, {"r_max": 1}, {"r_max": 16}, {"exhaustive_max": 0},
    {"exhaustive_max": 16}, {"age_s": 0.0}, {"age_s": None}, {"age_s": 3}, {"newcomer": "constant"},
    {"newcomer": "grow"}, {"alpha": 2, "beta": 3},
]

REJECTED = [
    ({"horizon": -1}, "horizon H must be an integer in \\[0, 4096\\], got -1"),
    ({"horizon": 4097}, "horizon H must be an integer in \\[0, 4096\\], got 4097"),
    ({"horizon": 8.0}, "horizon H must be an integer"),
    ({"horizon": True}, "horizon H must be an integer"),
    ({"alpha": math.inf}, "alpha must be a finite number, got inf"),
    ({"beta": math.nan}, "beta must be a finite number, got nan"),
    ({"gamma": "0.5"}, "gamma must be a finite number, got '0.5'"),
    ({"alpha": True}, "alpha must be a finite number, got True"),
    ({"alpha": 0.0}, "alpha must be > 0, got 0.0"),
    ({"alpha": -1.0, "beta": 2.0}, "alpha must be > 0"),
    ({"alpha": 2.0, "beta": 2.0}, "beta must be greater than alpha .*the largest sum always wins"),
    ({"gamma": 0.0}, "gamma must be in \\(0, 1\\], got 0.0"),
    ({"gamma": 1.5}, "gamma must be in \\(0, 1\\], got 1.5"),
    ({"gamma": 1.0000001}, "gamma must be in"),
    ({"s_greedy": -1}, "s_greedy must be an integer >= 0 or None"),
    ({"s_greedy": True}, "s_greedy must be an integer"),
    ({"s_greedy": 2.0}, "s_greedy must be an integer"),
    ({"r_max": 0}, "r_max must be an integer in \\[1, 16\\], got 0"),
    ({"r_max": 17}, "r_max must be an integer in \\[1, 16\\], got 17"),
    ({"r_max": True}, "r_max must be an integer"),
    ({"r_max": 4.0}, "r_max must be an integer"),
    ({"exhaustive_max": -1}, "exhaustive_max must be an integer in \\[0, 16\\], got -1"),
    ({"exhaustive_max": 17}, "exhaustive_max must be an integer in \\[0, 16\\], got 17"),
    ({"exhaustive_max": 4.0}, "exhaustive_max must be an integer"),
    ({"age_s": -0.5}, "age_s must be a number >= 0 or None, got -0.5"),
    ({"age_s": math.nan}, "age_s must be a number >= 0 or None, got nan"),
    ({"age_s": "2"}, "age_s must be a number"),
    ({"newcomer": "CONSTANT"}, "newcomer must be 'grow' or 'constant', got 'CONSTANT'"),
]


@pytest.mark.parametrize("values", ACCEPTED)
def test_documented_edges_are_accepted(values: dict) -> None:  # type: ignore[type-arg]
    p = BRParams(**values)
    for k, v in values.items():
        assert getattr(p, k) == v


@pytest.mark.parametrize(("values", "message"), REJECTED)
def test_out_of_range_knobs_fail_with_a_message_naming_them(values: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        BRParams(**values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"thin_ratio": -0.1}, "thin_ratio must be a finite number >= 0, got -0.1"),
        ({"thin_ratio": math.inf}, "thin_ratio must be a finite number >= 0, got inf"),
        ({"thin_ratio": "1"}, "thin_ratio must be a finite number"),
        ({"hold_s": -1.0}, "hold_s must be a finite number >= 0, got -1.0"),
        ({"hold_s": math.nan}, "hold_s must be a finite number >= 0, got nan"),
        ({"hold_s": "0.5"}, "hold_s must be a finite number"),
    ],
)
def test_bra_knobs_fail_with_a_message_naming_them(values: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        BRAParams(**values)


def test_bra_knob_edges_are_accepted() -> None:
    assert BRAParams(thin_ratio=0, hold_s=0).thin_ratio == 0
    assert BRAParams(thin_ratio=3, hold_s=7).hold_s == 7
