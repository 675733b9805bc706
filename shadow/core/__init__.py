"""Pure routing core: fleet math, BR-0/BR-H F-scores, the two-stage assigner, baselines, predictors.

No I/O, no clock, no randomness of its own: time and RNGs are passed in.
"""

from shadow.core.cost import RouteCost
from shadow.core.params import BRParams, br0_equivalent
from shadow.core.policies import POLICIES
from shadow.core.schedule import schedule_round

__all__ = ["POLICIES", "BRParams", "RouteCost", "br0_equivalent", "schedule_round"]
