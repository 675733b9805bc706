"""BR-0, BR-H and BRA rounds make exactly the decisions they made before the decision-time work of
#35 (Stage 2's pop from one `margins()` call, the BR-H row rebuilt with fewer array calls, the
subset search scoring through `Scorer.score_of`): on seeded bench-like states (G workers near
saturation, waiting pools of paper-like prompts, BR-H projections of G·B active requests), with
and without aged entries, under the paper's cost and a per-sequence one, the (request, worker)
sequences hash to what the code of commit f6df15e (integ before #35) gave.

The reference was written by running this file on that tree:

    PYTHONPATH=<checkout of f6df15e> python tests/core/test_round_decisions.py --write

(the script imports only `shadow`, so it runs against whichever tree PYTHONPATH names).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from shadow.core.balanceroute import BalanceRoute
from shadow.core.bra import BalanceRouteAdaptive
from shadow.core.cost import RouteCost
from shadow.core.params import BRParams
from shadow.core.pool import Pool
from shadow.core.stepmodel import StepTimeModel

REFERENCE = Path(__file__).with_name("round_decisions.json")
#: (G, slots per worker, waiting, R_max, rounds): the bench's G = 64 / 1,024 cell and smaller ones
CELLS = ((64, 64, 1024, 4, 6), (64, 64, 1024, 16, 2), (16, 64, 256, 4, 10), (8, 16, 32, 4, 20))
HORIZON = 80
COSTS = {"paper": None, "per-seq": StepTimeModel(3e-7, 0.015, c=2e-4)}


def _state(rng: np.random.Generator, workers: int, slots: int, waiting: int) -> dict[str, Any]:
    prompts = rng.lognormal(np.log(4652) - 0.32, 0.8, size=(workers, slots)).clip(16, 32768)
    gen = rng.integers(0, 1000, size=(workers, slots))
    per_req = prompts + gen
    return {
        "loads": per_req.sum(axis=1).tolist(),
        "seqs": [float(slots)] * workers,
        "free": rng.integers(0, 3, size=workers).tolist(),
        "sizes": rng.lognormal(np.log(4652) - 0.32, 0.8, size=waiting).clip(16, 32768).astype(int).tolist(),
        "arrived": rng.uniform(0, 10, size=waiting).tolist(),
        "steps": rng.uniform(0, HORIZON * 1.2, size=waiting).tolist(),
        "idx": np.repeat(np.arange(workers, dtype=np.int64), slots),
        "w": per_req.ravel().astype(np.float64),
        "c": rng.uniform(0, HORIZON * 1.2, size=workers * slots),
    }


def _round(policy: str, st: dict[str, Any], params: BRParams, cost: RouteCost, aged: bool) -> list[Any]:
    pool = Pool()
    for i, s in enumerate(st["sizes"]):
        pool.add(i, s, st["arrived"][i] if aged else 0.0, st["steps"][i] if i % 3 else None)
    now = 10.0 if aged else 0.0
    seqs = None if cost.paper else st["seqs"]
    if policy == "bra":
        bra = BalanceRouteAdaptive(params)
        prompts = [0.8 * x for x in st["loads"]]
        out = bra.round(st["loads"], st["free"], pool, now, (st["idx"], st["w"], st["c"]), prompts,
                        cost=cost, seqs=seqs)
    else:
        router = BalanceRoute(policy, params)  # type: ignore[arg-type]
        act = (st["idx"], st["w"], st["c"]) if policy == "brh" else None
        out = router.round(st["loads"], st["free"], pool, now, act, cost=cost, seqs=seqs)
    return [[int(r), int(g)] for r, g in out]  # type: ignore[call-overload]


def decisions() -> dict[str, dict[str, Any]]:
    """Per (cell, cost, aged, policy): how many decisions, the sha256 of their sequence, the first few."""
    out: dict[str, dict[str, Any]] = {}
    for g, b, waiting, r_max, rounds in CELLS:
        rng = np.random.default_rng(g * 10_000 + waiting + r_max)
        states = [_state(rng, g, b, waiting) for _ in range(rounds)]
        for cname, model in COSTS.items():
            cost = RouteCost.fleet([model]) if model is not None else RouteCost.fleet([StepTimeModel()])
            for aged in (False, True):
                params = BRParams(horizon=HORIZON, r_max=r_max, age_s=5.0 if aged else None)
                for policy in ("br0", "brh", "bra"):
                    seq = [_round(policy, st, params, cost, aged) for st in states]
                    blob = json.dumps(seq).encode()
                    key = f"G={g} B={b} waiting={waiting} R={r_max} {cname} aged={aged} {policy}"
                    out[key] = {"n": sum(map(len, seq)), "sha256": hashlib.sha256(blob).hexdigest(),
                                "first": seq[0][:5]}
    return out


def test_round_decisions_unchanged() -> None:
    want = json.loads(REFERENCE.read_text())
    got = decisions()
    differ = {key: (got.get(key), ref) for key, ref in want.items() if got.get(key) != ref}
    assert not differ and set(got) == set(want), differ


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        REFERENCE.write_text(json.dumps(decisions(), indent=1, sort_keys=True) + "\n")
    else:
        print(json.dumps(decisions(), indent=1))
