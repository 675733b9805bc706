"""Which rule the real router is: the lane whose policy agrees most with its placements.

Each compared lane (`LiveLanes`: every lane but BR-H, whose choice needs its own predictor state)
is asked, at every placement the router made, what it would have chosen on the `actual` lane's
fleet at that moment; its agreement rate is the share it chose identically. The lane with the
highest rate is the closest to what the router really does, whatever its documentation says; the
lanes the placements cannot tell from it are tied with it: those whose disagreements are not more
frequent than the closest lane's beyond chance (Fisher's exact test, one-sided, at `TIE_ALPHA`).
Two rules that order the workers alike on the traffic (request bytes and tokens on prompts whose
bytes track their tokens) come out tied, whichever of them a few placements put ahead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shadow.contracts.report import RouterRule
from shadow.core.stats import fisher_greater

TIE_ALPHA = 0.05  # a lane is tied with the closest unless it disagrees more often at this level


def router_rule(lanes: Mapping[str, Mapping[str, Any]]) -> RouterRule:
    """From the report's lanes ({label: {"policy", "agreements", "decisions", "agreement_rate"}}):
    `closest_lane` (the highest agreement rate, the first in report order among equals; None before
    any decision compared), `tied` (the closest and every lane not shown to disagree more often
    than it, see the module docstring, in report order), `agreement_rate` and `decisions` of the
    closest, and `by_lane` {label: rate} of every compared lane, highest first."""
    rated = [(label, v["agreement_rate"], v.get("decisions") or 0, v.get("agreements"))
             for label, v in lanes.items() if v.get("agreement_rate") is not None]
    if not rated:
        return {"closest_lane": None, "tied": [], "agreement_rate": None, "decisions": 0, "by_lane": {}}
    best = max(r[1] for r in rated)
    closest, _, n_best, a_best = next(r for r in rated if r[1] == best)

    def misses(rate: float, n: int, agreements: int | None) -> int:
        return n - (round(rate * n) if agreements is None else agreements)

    best_misses = misses(best, n_best, a_best)
    tied = [label for label, rate, n, a in rated
            if rate == best or fisher_greater(misses(rate, n, a), n, best_misses, n_best) >= TIE_ALPHA]
    ranked = sorted(rated, key=lambda x: -x[1])
    return {
        "closest_lane": closest,
        "tied": tied,
        "agreement_rate": best,
        "decisions": n_best,
        "by_lane": {r[0]: r[1] for r in ranked},
    }
