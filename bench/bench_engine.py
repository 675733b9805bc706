"""Offline engine speed: request-steps per second per lane, and a full paper-azure replay.

    python bench/bench_engine.py            # 10,000-request paper-azure at rho=1.1, G=8, B=64

A request-step is one active request advancing one decode step (Σ output tokens per lane).
Each lane runs alone on one core; the figure per lane is total output tokens / lane wall time.
"""

from __future__ import annotations

import argparse
import time

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.driver import LaneDriver
from shadow.engine.jobs import jobs_from
from shadow.engine.lane import Lane
from shadow.traces import at_load, estimate_capacity_rps, resolve

LANES = ["rr", "jsq", "jsq-bytes", "br0", "brh:survival", "brh:oracle"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="paper-azure")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--load", type=float, default=1.1)
    ap.add_argument("--lanes", default=",".join(LANES))
    args = ap.parse_args()
    trace = resolve(args.workload)
    step = StepTimeModel()
    cap = estimate_capacity_rps(trace, workers=args.workers, slots=args.slots, step_a=step.a, step_b=step.b)
    trace = at_load(trace, args.load, cap)
    jobs = jobs_from(trace.requests)
    config = EngineConfig(workers=args.workers, slots=args.slots, step=step)
    tokens = sum(j.output_tokens for j in jobs)
    print(
        f"{trace.name}: {len(jobs)} requests, {tokens:,} request-steps per lane, G={args.workers}, "
        f"B={args.slots}, rho={args.load}"
    )
    total = 0.0
    for name in args.lanes.split(","):
        lane = Lane(LaneSpec.parse(name), config, time.perf_counter)
        t0 = time.perf_counter()
        driver = LaneDriver(lane)
        for job in jobs:  # in arrival order, no prefill stage: each offered at its arrival
            driver.offer(job, job.arrival_s)
        driver.drain()
        dt = time.perf_counter() - t0
        total += dt
        print(
            f"  {name:>14}: {dt:6.2f} s  {tokens / dt / 1e6:6.2f} M request-steps/s  "
            f"({lane.totals.steps:,} steps, {dt / lane.totals.steps * 1e6:5.1f} µs/step)"
        )
    print(f"all {len(args.lanes.split(','))} lanes: {total:.1f} s")


if __name__ == "__main__":
    main()
