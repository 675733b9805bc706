"""Grafana dashboards built from code with the Grafana Foundation SDK (extra `shadow[dashboards]`).

`build_all()` returns {file name: dashboard JSON object}; `render(obj)` gives the committed bytes
(sorted keys, two-space indent, trailing newline) so that rebuilding is byte-for-byte stable.
Router, Predictors, Pool and transfer, and Fairness read the active-routing metrics (`shadow serve
--active`).
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from shadow.telemetry.dashboards import (
    fairness,
    fleet,
    mirror,
    overview,
    pool,
    predictors,
    router,
    stepmodel,
)

BOARDS = tuple(m.BOARD for m in (overview, fleet, mirror, stepmodel, router, predictors, pool, fairness))


def build_all() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for board in BOARDS:
        obj = json.loads(JSONEncoder(sort_keys=True).encode(board.build().build()))
        out[f"{board.uid}.json"] = obj
    return out


def render(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
