"""The clock's part of the report at fleet scale: a barrier's pair coincidences are listed for a
small fleet, and for a large one only the pairs nearest to splitting a group (G = 256 has 32,640
pairs, which the report rebuilt at every publish)."""

from __future__ import annotations

from typing import Any

from shadow.core.barrier import BarrierChoice
from shadow.core.stepmodel import StepTimeModel
from shadow.live.workerclock import REPORTED_PAIRS, WorkerClock


def _described(n: int) -> dict[str, Any]:
    wc = WorkerClock(n, StepTimeModel(a=0.0, b=0.05))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    # every pair coincides, a little less the further apart their indices
    wc.choice = BarrierChoice((tuple(range(n)),), {(i, j): 1.0 - (j - i) / (10 * n) for i, j in pairs}, (),
                              "synthetic")
    _, per = wc.clock(None)
    return wc.describe([f"d{g}" for g in range(n)], per)


def test_a_small_fleet_lists_every_pair_a_large_one_the_least_coincident() -> None:
    small = _described(16)
    assert len(small["coincidence"]) == small["pairs"] == 120
    large = _described(40)
    listed = large["coincidence"]
    assert large["pairs"] == 780 and len(listed) == REPORTED_PAIRS
    assert "d0~d39" in listed  # the least coincident pair
    floor = max(listed.values())
    assert "d0~d1" not in listed and floor < 1.0 - 1 / 400  # the most coincident ones are left out
