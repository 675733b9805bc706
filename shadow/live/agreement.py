"""Agreement between the real router and each policy: at every placement the `actual` lane is
offered, each compared policy is asked where it would have placed the request, on the router's
own view of the fleet at that moment (its ledger and the mirror's running requests,
`RouterViews`), and the answers that match the router's are counted.

`AgreementLedger.offer(lane, job)` is the `actual` lane's offer; `figures(label)` gives the
report's agreement fields of a lane. BR-H is not compared (its choice needs its own predictor
state)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from shadow.core.params import BRParams
from shadow.core.policies import RouterOptions, make_router
from shadow.core.pool import Pool
from shadow.core.routers import PoolRouter, Router
from shadow.engine.config import LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.routerview import RouterViews


class AgreementLedger:
    """See module docstring. `assignment(id)`: the worker the real router chose; `watch_router()`:
    starts keeping the router's views (called only when some policy is compared)."""

    def __init__(self, specs: Sequence[LaneSpec], br: BRParams, seed: int, slots: int,
                 assignment: Callable[[Hashable], int | None],
                 watch_router: Callable[[], RouterViews]) -> None:
        self.routers: dict[str, Router] = {}
        for spec in specs:
            if spec.policy != "brh":  # BR-H's choice needs its own predictor state: not compared
                options = RouterOptions(br=br, seed=seed, view_age_s=spec.view_age_s)
                self.routers[spec.label] = make_router(spec.policy, options)
        self.agreements: dict[str, int] = dict.fromkeys(self.routers, 0)
        self.decisions: dict[str, int] = dict.fromkeys(self.routers, 0)
        self.slots = slots
        self._assignment = assignment
        # each rule is asked on the router's own view at the placement (its ledger and the mirror's
        # running requests), not on the actual lane's modelled fleet
        self._views = watch_router() if self.routers else None

    def offer(self, lane: Lane, job: Job) -> None:
        """`job` is offered to the `actual` lane: ask each policy, count the matches."""
        if not self.routers:
            return
        actual = self._assignment(job.request_id)
        view = None if self._views is None else self._views.take(job.request_id)
        fleet = lane.snapshot()
        if view is not None:  # else a request the lanes know only from a seed: the lane's model
            fleet = view.snapshot(self.slots, fleet.cost, fleet.extras)
        for label, router in self.routers.items():
            router.on_arrive(job.request_id, job.prompt_tokens, lane.now)
            picks = router.decide(fleet, lane.now)
            if isinstance(router, PoolRouter):
                router.pool = Pool()  # one question per request: nothing waits in this copy
            if picks:
                self.decisions[label] += 1
                if picks[0][1] == actual:
                    self.agreements[label] += 1

    def figures(self, label: str) -> tuple[int | None, int | None, float | None]:
        """(agreements, decisions, agreement rate) of lane `label` (None: not compared / none yet)."""
        return (self.agreements.get(label), self.decisions.get(label),
                self.agreements[label] / self.decisions[label] if self.decisions.get(label) else None)
