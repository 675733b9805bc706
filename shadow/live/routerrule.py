"""Which rule the real router is: the lane whose policy agrees most with its placements.

Each compared lane (`LiveLanes`: every lane but BR-H, whose choice needs its own predictor state)
is asked, at every placement the router made, what it would have chosen on the `actual` lane's
fleet at that moment; its agreement rate is the share it chose identically. The lane with the
highest rate is the closest to what the router really does, whatever its documentation says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shadow.contracts.report import RouterRule


def router_rule(lanes: Mapping[str, Mapping[str, Any]]) -> RouterRule:
    """From the report's lanes ({label: {"policy", "agreements", "decisions", "agreement_rate"}}):
    `closest_lane` (the highest agreement rate; None before any decision compared), `tied` (every
    lane at that rate, in report order), `agreement_rate` and `decisions` of the closest, and
    `by_lane` {label: rate} of every compared lane, highest first."""
    rated = [(label, v["agreement_rate"], v.get("decisions") or 0) for label, v in lanes.items()
             if v.get("agreement_rate") is not None]
    if not rated:
        return {"closest_lane": None, "tied": [], "agreement_rate": None, "decisions": 0, "by_lane": {}}
    best = max(rate for _, rate, _ in rated)
    tied = [label for label, rate, _ in rated if rate == best]
    ranked = sorted(rated, key=lambda x: -x[1])
    return {
        "closest_lane": tied[0],
        "tied": tied,
        "agreement_rate": best,
        "decisions": next(n for label, _, n in rated if label == tied[0]),
        "by_lane": {label: rate for label, rate, _ in ranked},
    }
