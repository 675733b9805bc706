"""Decision latency of one routing round, per policy, on one core.

State per round (fresh each time, seeded): G workers with B=64 slots, loads of ≈ 64 requests of
paper-like size (prompt ≈ 4.6 k, 0–1 k generated), free slots 0–2 per worker (near saturation,
so a round admits ≈ G requests), `waiting` pool entries, and for BR-H the active requests with
predicted remaining steps in [0, H].

"round" times what a live router does per round: BR-0/BR-H over its persistent pool (the BR-H
projection of all active requests is rebuilt inside the timing), baselines binding the same
number of requests. "e2e" times `schedule_round`, which also validates input and builds the pool.
"bra-thin" times BRA's thin-pool round (waiting = the free slots, so its placement path runs)
with its default "life" basis computed inside the timing, as the engine's lanes do: a survival
predictor with 20,000 finished lengths, G/2 new ones settled per round, conditioned on the ages
of all G·B running requests.

    python bench/bench_decision.py [--rounds 200] [--quick] [--clock wall|cpu]

Prints P50/P99 per round in ms and each policy's ratio to JSQ (jsq-bytes) and to BR-H at P50.
`--clock cpu` times with the process's CPU clock instead of the wall clock: on a shared machine
wall-clock tails are mostly the scheduler preempting the process, CPU time is the code's cost.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import numpy as np

from shadow.core import POLICIES, BRParams, schedule_round
from shadow.core.balanceroute import BalanceRoute
from shadow.core.baselines import BindState, bind_all
from shadow.core.bra import BalanceRouteAdaptive
from shadow.core.policies import make_baseline
from shadow.core.pool import Pool
from shadow.core.predictors import SurvivalPredictor
from shadow.core.stay import predicted_basis

SLOTS = 64
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
now = time.perf_counter  # the clock every timing below reads (set by --clock)


def make_state(rng: np.random.Generator, workers: int, waiting: int, horizon: int):  # type: ignore[no-untyped-def]
    prompts = rng.lognormal(np.log(4652) - 0.32, 0.8, size=(workers, SLOTS)).clip(16, 32768)
    gen = rng.integers(0, 1000, size=(workers, SLOTS))
    per_req = prompts + gen
    loads = per_req.sum(axis=1).tolist()
    free = rng.integers(0, 3, size=workers).tolist()
    sizes = rng.lognormal(np.log(4652) - 0.32, 0.8, size=waiting).clip(16, 32768).astype(int)
    pool = [(i, int(s)) for i, s in enumerate(sizes)]
    c_hat = rng.uniform(0, horizon, size=(workers, SLOTS))
    active = [(g, float(per_req[g, j]), float(c_hat[g, j])) for g in range(workers) for j in range(SLOTS)]
    return loads, free, pool, active, gen.ravel()


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def time_round(policy: str, state, params: BRParams) -> float:  # type: ignore[no-untyped-def]
    """Milliseconds for one routing round over a pre-built pool (what a live router pays)."""
    loads, free, waiting, active, _ages = state
    if policy == "bra-thin":
        return time_thin(state, params)
    if policy in ("br0", "brh", "bra"):
        pool = Pool()
        for rid, s in waiting:
            pool.add(rid, s)
        arr = np.asarray(active, dtype=np.float64)
        idx, w, c = arr[:, 0].astype(np.int64), arr[:, 1], arr[:, 2]
        if policy == "bra":  # BR-H projections, prompt loads ≈ loads minus generated tokens
            bra = BalanceRouteAdaptive(params)
            prompts = [0.8 * x for x in loads]
            t0 = now()
            bra.round(loads, free, pool, 0.0, (idx, w, c), prompts)
            return (now() - t0) * 1e3
        router = BalanceRoute(policy, params)  # type: ignore[arg-type]
        t0 = now()
        router.round(loads, free, pool, 0.0, (idx, w, c))
        return (now() - t0) * 1e3
    n = min(len(waiting), sum(free))
    view = BindState(list(loads), [0] * len(loads), list(loads), list(free))
    baseline = make_baseline(policy, random.Random(0))
    t0 = now()
    bind_all(baseline, view, [s for _, s in waiting[:n]], True)
    return (now() - t0) * 1e3


def time_thin(state, params: BRParams) -> float:  # type: ignore[no-untyped-def]
    """BRA's thin round (as many waiting as free slots) over the life basis, built inside the timing."""
    loads, free, waiting, active, ages = state
    workers = len(loads)
    predictor = PREDICTOR[workers]
    for x in RNG.lognormal(6.8, 0.9, size=max(1, workers // 2)):
        predictor.observe(int(min(x, 16_384)))
    pool = Pool()
    for rid, s in waiting[: sum(free)]:
        pool.add(rid, s)
    arr = np.asarray(active, dtype=np.float64)
    idx, w = arr[:, 0].astype(np.int64), arr[:, 1]
    age = np.asarray(ages, dtype=np.int64)
    bra = BalanceRouteAdaptive(params)
    t0 = now()
    bra.round(
        loads,
        free,
        pool,
        0.0,
        None,
        [0.8 * x for x in loads],
        lambda kind: predicted_basis(kind, predictor, workers, idx, w, age, params.horizon),
    )
    return (now() - t0) * 1e3


PREDICTOR: dict[int, SurvivalPredictor] = {}  # per G: a persistent predictor, as a live router's
RNG = np.random.default_rng(7)


def time_e2e(policy: str, state, params: BRParams) -> float:  # type: ignore[no-untyped-def]
    loads, free, waiting, active, _ages = state
    if policy == "bra-thin":
        return math.nan
    t0 = now()
    act = active if policy in ("brh", "bra") else None
    schedule_round(policy, loads, free, waiting, params=params, active=act)
    return (now() - t0) * 1e3


def run(rounds: int, grid_g: list[int], grid_w: list[int], grid_r: list[int]) -> None:
    horizon = 80
    print(f"one core, {rounds} rounds per cell, H={horizon}, B={SLOTS}, free slots 0-2 per worker")
    print(
        f"{'G':>3} {'waiting':>7} {'R_max':>5} {'policy':>13} {'P50 ms':>8} {'P99 ms':>8} "
        f"{'P50/JSQ':>8} {'P50/BR-H':>8} {'e2e P50':>8} {'e2e P99':>8}"
    )
    for workers in grid_g:
        for waiting in grid_w:
            rng = np.random.default_rng(workers * 10_000 + waiting)
            states = [make_state(rng, workers, waiting, horizon) for _ in range(rounds)]
            PREDICTOR[workers] = SurvivalPredictor(
                [int(x) for x in np.random.default_rng(workers).lognormal(6.8, 0.9, 20_000).clip(1, 16_384)]
            )
            PREDICTOR[workers].predict(np.zeros(1, dtype=np.int64), horizon)  # settled before timing
            jsq_p50 = None
            brh_p50: float | None = None
            for r_max in grid_r:
                params = BRParams(horizon=horizon, r_max=r_max)
                for policy in (*POLICIES, "bra-thin"):
                    if r_max != grid_r[0] and policy not in ("br0", "brh", "bra"):
                        continue
                    times = [time_round(policy, st, params) for st in states]
                    e2e = [time_e2e(policy, st, params) for st in states]
                    p50, p99 = statistics.median(times), percentile(times, 99)
                    if policy == "jsq-bytes":
                        jsq_p50 = p50
                    if policy == "brh":
                        brh_p50 = p50
                    ratio = f"{p50 / jsq_p50:8.1f}" if jsq_p50 else "       -"
                    to_brh = f"{p50 / brh_p50:8.2f}" if brh_p50 else "       -"
                    thin = policy == "bra-thin"  # no schedule_round path: e2e not timed
                    e2e_txt = (
                        f"{'-':>8} {'-':>8}"
                        if thin
                        else (f"{statistics.median(e2e):8.3f} {percentile(e2e, 99):8.3f}")
                    )
                    print(
                        f"{workers:>3} {waiting:>7} {r_max:>5} {policy:>13} {p50:8.3f} {p99:8.3f} "
                        f"{ratio} {to_brh} {e2e_txt}",
                        flush=True,
                    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="G=8 and 64 only, 256/1024 waiting")
    ap.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall (perf_counter, default) or cpu (process CPU time)",
    )
    args = ap.parse_args()
    global now
    now = CLOCKS[args.clock]
    print(f"clock: {args.clock}")
    if args.quick:
        run(args.rounds, [8, 64], [256, 1024], [4])
    else:
        run(args.rounds, [8, 16, 64], [32, 256, 1024], [4, 16])


if __name__ == "__main__":
    main()
