"""Which rule is which: replay a workload under one lane's rule and, at every placement it makes,
ask other rules (fresh: view age 0) what they would place on the same fleet; print the share of
placements each agrees with. The live report does the same against the real router (`router_rule`).

    PYTHONPATH=. python scripts/rule_agreement.py jsq vllm-dp-legacy@0,vllm-dp@0,sglang-requests@0 \
        --workload paper-azure --workers 8 --load 1.0 --n 4000 --seed 0
"""

from __future__ import annotations

import argparse
import time

from shadow.core.policies import RouterOptions, make_router
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.driver import LaneDriver, Observer
from shadow.engine.jobs import Job, jobs_from
from shadow.engine.lane import Lane
from shadow.traces import at_load, estimate_capacity_rps, synthetic_workload


class _Ask(Observer):
    def __init__(self, others: list[LaneSpec], seed: int) -> None:
        self.routers = {s.label: make_router(s.policy, RouterOptions(seed=seed, view_age_s=s.view_age_s))
                        for s in others}
        self.agree = dict.fromkeys(self.routers, 0)
        self.asked = 0
        self.choices: dict[str, int] = {}

    def offering(self, lane: Lane, job: Job) -> None:
        fleet = lane.snapshot()
        self.choices = {}
        for label, r in self.routers.items():
            r.on_arrive(job.request_id, job.prompt_tokens, lane.now)
            ((_, g),) = r.decide(fleet, lane.now)
            self.choices[label] = g

    def placed(self, g: int) -> None:
        self.asked += 1
        for label, choice in self.choices.items():
            self.agree[label] += choice == g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lane")
    ap.add_argument("others")
    ap.add_argument("--workload", default="paper-azure")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--load", type=float, default=1.0)
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    config = EngineConfig(workers=a.workers, slots=a.slots, seed=a.seed)
    trace = synthetic_workload(a.workload, seed=a.seed, n=a.n)
    cap = estimate_capacity_rps(trace, workers=a.workers, slots=a.slots, step_a=config.step.a,
                                step_b=config.step.b)
    jobs = jobs_from(at_load(trace, a.load, cap).requests)
    lane = Lane(LaneSpec.parse(a.lane), config, time.perf_counter)
    ask = _Ask([LaneSpec.parse(x) for x in a.others.split(",")], a.seed)
    driver = LaneDriver(lane, observers=(ask,))
    for job in jobs:
        driver.offer(job, job.arrival_s)
        ask.placed(_last(lane, job))
    driver.drain()
    print(f"{a.lane} on {a.workload} G={a.workers} B={a.slots} ρ={a.load} n={a.n} seed={a.seed}: "
          f"{ask.asked} placements")
    for label, n in sorted(ask.agree.items(), key=lambda x: -x[1]):
        print(f"  {label:>22}: {n / ask.asked:6.1%}")


def _last(lane: Lane, job: Job) -> int:
    """The worker `job` was placed on (a binding lane queues it there at its offer)."""
    for g, q in enumerate(lane.queues):
        if any(j.request_id == job.request_id for j, _ in q):
            return g
    raise RuntimeError(f"request {job.request_id} is in no queue")


if __name__ == "__main__":
    main()
