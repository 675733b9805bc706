"""Baselines: each rule picks what its documented metric says, with the documented ties."""

from __future__ import annotations

import random

import pytest

from shadow.core.baselines import BindState
from shadow.core.policies import make_baseline


def view() -> BindState:
    return BindState(
        kv_tokens=[500.0, 100.0, 300.0],
        outstanding=[1, 3, 2],
        outstanding_tokens=[900.0, 200.0, 200.0],
        free_slots=[0, 4, 4],
    )


def test_each_rule_uses_its_own_metric() -> None:
    rng = random.Random(0)
    assert make_baseline("jsq", rng).pick(view(), 10) == 0
    assert make_baseline("jsq", rng).pick(view(), 10, only_free=True) == 2
    assert make_baseline("jsq-bytes", rng).pick(view(), 10) == 1  # tie 200/200 → first registered
    assert make_baseline("least-tokens", rng).pick(view(), 10) == 1


def test_p2c_takes_the_less_loaded_of_two_draws() -> None:
    counts = [0, 0, 0]
    p2c = make_baseline("p2c", random.Random(1))
    for _ in range(600):
        counts[p2c.pick(view(), 1)] += 1
    # Worker 1 (3 outstanding) loses every pair it is drawn in.
    assert counts[1] == 0 and counts[0] > counts[2] > 0


def test_unknown_baseline() -> None:
    with pytest.raises(ValueError, match="unknown baseline"):
        make_baseline("jsq-psychic", random.Random(0))
