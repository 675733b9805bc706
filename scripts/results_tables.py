"""Markdown tables from `shadow sweep --json` files (steady-state protocol) for docs/results/.

    python scripts/results_tables.py grid FILE.json [LANE ...]      # one row per (G, ρ)
    python scripts/results_tables.py lanes FILE.json                # every lane of every cell
    python scripts/results_tables.py targets FILE.json [LANE]       # the issue's targets, per cell
    python scripts/results_tables.py balance FILE.json [LANE ...]   # balance ratio per (G, ρ) and lane
    python scripts/results_tables.py merge OUT.json A.json B.json ...  # lanes of separate runs, one file
    python scripts/results_tables.py relabel OUT.json IN.json OLD=NEW ...  # rename lanes (e.g. an old
                                                                           # default kept beside the new)

`merge` joins sweeps with the same protocol: cells (workload, G, ρ, seed) are united, and lanes of
the same cell that ran in separate sweeps are joined. Each lane of a cell is measured on its own
over the same requests, so a lane's figures do not depend on which other lanes ran beside it
(tests/replay/test_results_merge.py checks this against a joint run); the summary (best baseline,
paired ratios) is recomputed over all lanes.

Figures are means over seeds ± the half-width of the 95 % t-interval; "×" is the paired spread
reduction against the cell's best baseline by spread (> 1 = lower spread than it), and "%" a paired
change: the geometric mean over seeds with its 95 % interval on the log scale in brackets (files
written before that hold mean ± half-width there, and print so).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any


def ci(entry: list[float], fmt: str) -> str:
    from shadow.replay.protocol import interval_text

    return interval_text([math.nan if v is None else v for v in entry], fmt)


def grid(doc: dict[str, Any], lanes: list[str]) -> str:
    head = ["G", "ρ", "best baseline (spread/step)"]
    for lb in lanes:
        head += [f"{lb} ×"]
    last = lanes[-1]
    head += [f"{last} × (seconds)", f"{last} throughput %", f"{last} TPOT P95 %", f"shed % ({last} / best)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for c in doc["summary"]:
        best = c["best_baseline_spread"]
        b = c["lanes"][best]
        cells = [str(c["workers"]), f"{c['load']:g}", f"{best} {b['spread_steps'][0]:,.0f}"]
        for lb in lanes:
            cells.append(ci(c["lanes"][lb]["spread_x"], ".2f") if lb in c["lanes"] else "–")
        r = c["lanes"][last]
        cells += [
            ci(r["spread_seconds_x"], ".2f"),
            ci(r["throughput_pct"], "+.1f"),
            ci(r["tpot_p95_pct"], "+.1f"),
            f"{100 * r['shed_fraction'][0]:.1f} / {100 * b['shed_fraction'][0]:.1f}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def lanes_table(doc: dict[str, Any]) -> str:
    head = ["G", "ρ", "lane", "spread/step", "× best", "× best (s)", "throughput %", "TPOT P95 %", "shed %"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for c in doc["summary"]:
        for lb, r in c["lanes"].items():
            rows.append(
                "| "
                + " | ".join(
                    [
                        str(c["workers"]),
                        f"{c['load']:g}",
                        lb,
                        ci(r["spread_steps"], ",.0f"),
                        ci(r["spread_x"], ".2f"),
                        ci(r["spread_seconds_x"], ".2f"),
                        ci(r["throughput_pct"], "+.1f"),
                        ci(r["tpot_p95_pct"], "+.1f"),
                        ci([100 * r["shed_fraction"][0], 100 * r["shed_fraction"][1]], ".1f"),
                    ]
                )
                + " |"
            )
    return "\n".join(rows)


def balance(doc: dict[str, Any], lanes: list[str]) -> str:
    """Per (G, ρ): each lane's balance ratio (NVIDIA's mean/max KV load, step-time-weighted over the
    window), mean over seeds ± the 95 % half-width; every lane when none is named."""
    names = lanes or list(doc["summary"][0]["lanes"])
    head = ["G", "ρ", *names]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for c in doc["summary"]:
        cells = [str(c["workers"]), f"{c['load']:g}"]
        for lb in names:
            r = c["lanes"].get(lb)
            cells.append(ci([100 * x for x in r["balance_ratio"]], ".1f") + " %" if r else "–")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def targets(doc: dict[str, Any], lane: str) -> str:
    """Per (G, ρ): does `lane` meet the issue's targets? "ok" = its 95 % CI reaches the bar."""
    from shadow.replay.protocol import bounds

    head = ["G", "ρ", "spread ≤ best baseline", "× best", "throughput ≥ best", "TPOT P95 ≤ best"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    misses = 0
    for c in doc["summary"]:
        r = c["lanes"][lane]
        sx, tp, tt = r["spread_x"], r["throughput_pct"], r["tpot_p95_pct"]
        ok_s = bounds(sx)[2] >= 1.0
        ok_t = bounds(tp)[2] >= 0.0
        ok_p = bounds(tt)[1] <= 0.0
        misses += (not ok_s) + (not ok_t) + (not ok_p)
        rows.append(
            f"| {c['workers']} | {c['load']:g} | {'ok' if ok_s else '**no**'} | {ci(sx, '.2f')} | "
            f"{'ok' if ok_t else '**no**'} ({ci(tp, '+.1f')}) | "
            f"{'ok' if ok_p else '**no**'} ({ci(tt, '+.1f')}) |"
        )
    rows.append(f"\n{misses} misses over {len(doc['summary'])} cells × 3 targets")
    return "\n".join(rows)


FACTS = ("workload", "workers", "load", "seed", "requests", "capacity_rps", "lifetime_s", "window_s")


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One sweep document from several with the same protocol: cells are united, and the lanes of a
    cell found in several files are joined (in file order); every cell must end with the same lanes."""
    from shadow.replay.protocol import summarise

    first = docs[0]
    for d in docs[1:]:
        for key in ("protocol", "step", "slots"):
            if d[key] != first[key]:
                raise ValueError(f"cannot merge: {key} differs ({d[key]!r} vs {first[key]!r})")
    cells: dict[tuple[Any, ...], dict[str, Any]] = {}
    for d in docs:
        for r in d["runs"]:
            key = (r["workload"], r["workers"], r["load"], r["seed"])
            base = cells.setdefault(key, r | {"lanes": {}})
            if any(r[f] != base[f] for f in FACTS):
                raise ValueError(f"cannot merge: cell {key} differs in its facts (not the same requests)")
            for label, fig in r["lanes"].items():
                if label in base["lanes"]:
                    raise ValueError(f"cannot merge: lane {label} of cell {key} is in two files")
                base["lanes"][label] = fig
    lane_sets = {tuple(r["lanes"]) for r in cells.values()}
    if len(lane_sets) != 1:
        raise ValueError(f"cannot merge: the cells do not end with the same lanes ({sorted(lane_sets)})")
    runs = sorted(cells.values(), key=lambda r: (r["workload"], r["workers"], r["load"], r["seed"]))
    return {
        "command": " + ".join(d["command"] for d in docs),
        "parts": [part for d in docs for part in _parts(d)],
        "protocol": first["protocol"],
        "step": first["step"],
        "slots": first["slots"],
        "summary": summarise(runs),
        "runs": runs,
    }


def _parts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweeps a document was made of: its own `parts` if it is a merge, else itself; a
    relabelling is noted on each."""
    note = {"relabelled": doc["relabelled"]} if "relabelled" in doc else {}
    if "parts" in doc:
        return [
            p | ({"relabelled": [*p.get("relabelled", []), *note["relabelled"]]} if note else {})
            for p in doc["parts"]
        ]
    return [
        {k: doc.get(k) for k in ("command", "commit", "runner")}
        | note
        | {"lanes": list(doc["runs"][0]["lanes"]), "cells": len(doc["runs"])}
    ]


def relabel(doc: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The same document with lanes renamed (OLD → NEW), e.g. `bra` of an older commit kept as the
    ablation that reproduces it; the summary is recomputed and the renaming recorded."""
    from shadow.replay.protocol import summarise

    runs = []
    for r in doc["runs"]:
        missing = set(names) - set(r["lanes"])
        if missing:
            raise ValueError(f"cannot relabel: no lane {sorted(missing)} in a cell")
        lanes = {names.get(k, k): v for k, v in r["lanes"].items()}
        if len(lanes) != len(r["lanes"]):
            raise ValueError("cannot relabel: two lanes would share a name")
        runs.append(r | {"lanes": lanes})
    note = ", ".join(f"{k} → {v}" for k, v in names.items())
    return doc | {
        "relabelled": [*doc.get("relabelled", []), note],
        "summary": summarise(runs),
        "runs": runs,
    }


def main() -> None:
    if sys.argv[1:2] == ["relabel"]:
        out, path, *pairs = sys.argv[2:]
        with open(path) as f:
            doc = json.load(f)
        names = dict(p.split("=", 1) for p in pairs)
        with open(out, "w") as f:
            f.write(json.dumps(relabel(doc, names), indent=1) + "\n")
        print(f"wrote {out}")
        return
    if sys.argv[1:2] == ["merge"]:
        out, *paths = sys.argv[2:]
        docs = []
        for p in paths:
            with open(p) as f:
                docs.append(json.load(f))
        with open(out, "w") as f:
            f.write(json.dumps(merge(docs), indent=1) + "\n")
        print(f"wrote {out}")
        return
    kind, path, *lanes = sys.argv[1:]
    with open(path) as f:
        doc = json.load(f)
    print(f"`{doc['command']}`\n")
    if kind == "grid":
        print(grid(doc, lanes or ["br0", "brh-survival", "bra"]))
    elif kind == "balance":
        print(balance(doc, lanes))
    elif kind == "targets":
        print(targets(doc, lanes[0] if lanes else "bra"))
    else:
        print(lanes_table(doc))


if __name__ == "__main__":
    main()
