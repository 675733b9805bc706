"""The predictors-at-scale table (docs/results/predictors.md) from `shadow sweep --json` files.

    python scripts/predictor_table.py FILE.json [FILE.json ...]

One row per (workload, G, ρ), runs joined over the files: the best baseline by mean spread;
BR-H's spread reduction (×, paired per seed against that baseline) with the Oracle, Survival and
ExactMatch predictors and BRA's; the share of the Oracle's gain each real predictor keeps,
(× − 1) / (×_oracle − 1), paired per seed; and the throughput gain (%) of each. Figures: mean ±
half-width of the 95 % t-interval over seeds (none with one seed).
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
LANES = ("brh-oracle", "brh-survival", "brh-exactmatch", "bra")
REAL = ("brh-survival", "brh-exactmatch", "bra")
BASELINES = ("rr", "p2c", "jsq", "jsq-bytes", "least-tokens")


def mean_ci(xs: list[float]) -> tuple[float, float | None]:
    n = len(xs)
    m = math.fsum(xs) / n
    if n < 2:
        return m, None
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1))
    return m, T95.get(n - 1, 1.96) * sd / math.sqrt(n)


def fmt(xs: list[float], spec: str) -> str:
    if not xs:
        return "–"
    m, h = mean_ci(xs)
    return f"{m:{spec}}" if h is None else f"{m:{spec}} ± {h:{spec.lstrip('+')}}"


def table(docs: list[dict[str, Any]]) -> str:
    cells: dict[tuple[str, int, float], list[dict[str, Any]]] = defaultdict(list)
    for doc in docs:  # runs of one cell may come from several files (e.g. a seed run later)
        for r in doc["runs"]:
            cells[(r["workload"], r["workers"], r["load"])].append(r)
    head = ["workload", "G", "ρ", "seeds", "best baseline", *(f"{lb} ×" for lb in LANES),
            *(f"{lb} share of oracle gain" for lb in REAL), *(f"{lb} thr. %" for lb in LANES)]
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for key in sorted(cells):
        runs = sorted(cells[key], key=lambda r: r["seed"])
        if len({r["seed"] for r in runs}) != len(runs):
            raise ValueError(f"{key}: a seed appears twice")
        # the protocol's best baseline: the baseline lane with the lowest mean spread over seeds
        ref = min((lb for lb in runs[0]["lanes"] if lb in BASELINES),
                  key=lambda lb: sum(r["lanes"][lb]["spread_steps"] for r in runs))
        x: dict[str, list[float]] = {lb: [] for lb in LANES}
        thr: dict[str, list[float]] = {lb: [] for lb in LANES}
        share: dict[str, list[float]] = {lb: [] for lb in REAL}
        for r in runs:
            base = r["lanes"][ref]
            for lb in LANES:
                lane = r["lanes"].get(lb)
                if lane is None:
                    continue
                x[lb].append(base["spread_steps"] / lane["spread_steps"])
                thr[lb].append(100 * (lane["throughput_tps"] / base["throughput_tps"] - 1))
            gain = x["brh-oracle"][-1] - 1 if x["brh-oracle"] else None
            for lb in REAL:
                if gain and x[lb] and len(x[lb]) == len(x["brh-oracle"]):
                    share[lb].append((x[lb][-1] - 1) / gain)
        workload, g, rho = key
        rows.append("| " + " | ".join([
            workload, str(g), f"{rho:g}", str(len(runs)), ref,
            *(fmt(x[lb], ".2f") for lb in LANES),
            *(fmt([100 * s for s in share[lb]], ".0f") + " %" if share[lb] else "–" for lb in REAL),
            *(fmt(thr[lb], "+.1f") for lb in LANES),
        ]) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table([json.loads(Path(p).read_text()) for p in sys.argv[1:]]))
