"""With c = 0 (the paper's step model, or a configured linear one) every policy's decisions are the
ones it made before the step cost entered routing: decision by decision, on a seeded workload, for
one barrier and for independent workers, the lanes' (request, worker) sequences hash to what the
routing code before the cost model (commit e444228, integ before #33's routing) gave.

The reference was written by running this file on that tree:

    PYTHONPATH=<worktree at e444228> python tests/replay/test_kappa0_decisions.py --write

(the script imports only `shadow`, so it runs against whichever tree PYTHONPATH names).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneClock, LaneSpec
from shadow.engine.jobs import Job, jobs_from
from shadow.engine.lane import Lane
from shadow.engine.offline import run_lanes
from shadow.traces import at_load, estimate_capacity_rps, synthetic_workload

REFERENCE = Path(__file__).with_name("kappa0_decisions.json")
POLICIES = ("rr", "random", "p2c", "jsq", "jsq-bytes", "least-tokens", "br0", "brh:survival",
            "brh:exactmatch", "brh:oracle", "bra:survival", "bra:exactmatch")
G, B, N = 6, 12, 500
#: c = 0 in every form a lane meets it: the default model, a configured linear one, and one with a
#: prefill term only (p is no per-step load: routing does not weigh it; but since the twin prices
#: a step's prefill tokens (#33 item 3: the lane engine's steps take p·P longer where they hold a
#: prefill) the timeline moves, so there only the lanes whose rule reads no load decide as before).
MODELS = {
    "default": StepTimeModel(),
    "linear": StepTimeModel(3e-7, 0.015),
    "prefill": StepTimeModel(3e-7, 0.015, p=1e-5),
}


def _jobs(model: StepTimeModel) -> list[Job]:
    trace = synthetic_workload("paper-azure", seed=7, n=N)
    cap = estimate_capacity_rps(trace, workers=G, slots=B, step_a=model.a, step_b=model.b)
    return jobs_from(at_load(trace, 1.05, cap).requests)


def decisions(model: StepTimeModel, clock: LaneClock | None) -> dict[str, dict[str, Any]]:
    """Per lane: how many decisions, the sha256 of their (request id, worker) sequence, the first few."""
    config = EngineConfig(workers=G, slots=B, step=model, seed=3, clock=clock)
    lanes = [Lane(LaneSpec.parse(p), config, time.perf_counter) for p in POLICIES]
    logs: dict[str, list[tuple[Hashable, int]]] = {}
    for lane in lanes:
        log = logs[lane.spec.label] = []
        decide = lane.router.decide

        def spy(fleet: Any, now: float, decide: Any = decide, log: list[tuple[Hashable, int]] = log) -> Any:
            got = decide(fleet, now)
            log.extend((rid.request_id if isinstance(rid, Job) else rid, g) for rid, g in got)
            return got

        lane.router.decide = spy  # type: ignore[method-assign]
    jobs = _jobs(model)
    run_lanes(jobs, lanes, None, None, len(jobs))
    out: dict[str, dict[str, Any]] = {}
    for label, log in logs.items():
        text = json.dumps([[str(r), g] for r, g in log])
        out[label] = {"decisions": len(log), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                      "first": " ".join(f"{r}:{g}" for r, g in log[:6])}
    return out


def cases() -> dict[str, dict[str, dict[str, Any]]]:
    out = {f"{name}/barrier": decisions(m, None) for name, m in MODELS.items()}
    out["linear/independent"] = decisions(MODELS["linear"], LaneClock.independent(G))
    return out


TIMING_FREE = ("rr", "random")  # rules that read no load: the same decisions whatever the timeline
PRICED = "prefill/barrier"  # the case whose steps are priced differently since the reference


def test_every_policy_decides_as_before_the_cost_model_at_c_zero() -> None:
    want = json.loads(REFERENCE.read_text())
    got = cases()
    assert set(got) == set(want)
    for case, lanes in want.items():
        for label, ref in lanes.items():
            assert got[case][label]["decisions"] == ref["decisions"] == N, (case, label)
            if case == PRICED and label not in TIMING_FREE:
                # the prefill term lengthens the steps that hold one: a different timeline
                assert got[case][label] != ref, f"{case}: lane {label}'s steps ignore the prefill term"
                continue
            assert got[case][label] == ref, f"{case}: lane {label} decides differently at c = 0"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=<tree> python tests/replay/test_kappa0_decisions.py --write")
    REFERENCE.write_text(json.dumps(cases(), indent=1) + "\n")
    print(f"wrote {REFERENCE}")
