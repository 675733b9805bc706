"""`scripts/results_tables.py merge`: sweeps of different lanes over the same cells join into what
one sweep of all the lanes gives (a lane's figures do not depend on the lanes beside it)."""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shadow.replay.protocol import Cell, Protocol, run_cell, summarise

ROOT = Path(__file__).resolve().parents[2]
TIMED = {"decision_p99_ms"}  # wall-clock measurements: differ between any two runs


def _tables() -> Any:
    spec = importlib.util.spec_from_file_location("results_tables", ROOT / "scripts" / "results_tables.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _untimed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in TIMED}
    if isinstance(value, (list, tuple)):
        return [_untimed(v) for v in value]
    return value


PROTO = Protocol(warmup_lifetimes=1.0, window_lifetimes=2.0, seeds=(0, 1), max_requests=300)


def _doc(
    lanes: tuple[str, ...], protocol: Protocol = PROTO, workers: tuple[int, ...] = (2, 3)
) -> dict[str, Any]:
    runs = [
        run_cell(Cell("paper-azure", g, rho, seed, lanes, slots=6, protocol=protocol), time.perf_counter)
        for g in workers
        for rho in (0.8, 1.2)
        for seed in protocol.seeds
    ]
    # through JSON, as the files are
    return json.loads(
        json.dumps(
            {
                "command": "shadow sweep " + ",".join(lanes),
                "commit": "c0ffee",
                "runner": "local (1 process)",
                "protocol": protocol.__dict__ | {"seeds": list(protocol.seeds)},
                "step": {"a": 1.2e-7, "b": 0.02},
                "slots": 6,
                "summary": summarise(runs),
                "runs": runs,
            }
        )
    )


def test_merged_lanes_and_cells_equal_one_joint_sweep() -> None:
    tables = _tables()
    joint = _doc(("jsq-bytes", "least-tokens", "br0", "bra"))
    base = ("jsq-bytes", "least-tokens", "br0")
    parts = [_doc(base, workers=(3,)), _doc(base, workers=(2,)), _doc(("bra",))]  # G=3 first
    merged = json.loads(json.dumps(tables.merge(parts)))
    assert _untimed(merged["runs"]) == _untimed(joint["runs"])
    assert _untimed(merged["summary"]) == _untimed(joint["summary"])
    cmd = "shadow sweep jsq-bytes,least-tokens,br0"
    assert merged["command"] == f"{cmd} + {cmd} + shadow sweep bra"
    assert [(p["lanes"], p["cells"]) for p in merged["parts"]] == [
        (list(base), 4),
        (list(base), 4),
        (["bra"], 8),
    ]
    # not vacuous: bra's ratio against the best baseline needs the other file's baselines
    assert all(not _nan(c["lanes"]["bra"]["spread_x"][0]) for c in merged["summary"])


def _nan(x: float) -> bool:
    return x != x


def test_merge_refuses_files_that_are_not_the_same_cells() -> None:
    tables = _tables()
    a = _doc(("jsq-bytes",))
    with pytest.raises(ValueError, match="protocol differs"):
        tables.merge([a, _doc(("bra",), replace(PROTO, window_lifetimes=3.0))])
    with pytest.raises(ValueError, match="lane jsq-bytes"):
        tables.merge([a, a])
    fewer = dict(b := _doc(("bra",)), runs=b["runs"][:-1])
    with pytest.raises(ValueError, match="same lanes"):
        tables.merge([a, fewer])  # one cell would lack bra
    other = json.loads(json.dumps(a))
    other["runs"][0]["requests"] += 1
    with pytest.raises(ValueError, match="facts"):
        tables.merge([other, _doc(("bra",))])


def test_relabel_keeps_an_old_lane_beside_a_new_one_of_the_same_name() -> None:
    tables = _tables()
    old = _doc(("jsq-bytes", "bra"))
    renamed = json.loads(json.dumps(tables.relabel(old, {"bra": "bra{prompt}"})))
    assert renamed["relabelled"] == ["bra → bra{prompt}"]
    for a, b in zip(old["runs"], renamed["runs"], strict=True):
        assert list(b["lanes"]) == ["jsq-bytes", "bra{prompt}"]
        assert b["lanes"]["bra{prompt}"] == a["lanes"]["bra"]
    for a, b in zip(old["summary"], renamed["summary"], strict=True):
        assert _untimed(b["lanes"]["bra{prompt}"]) == _untimed(a["lanes"]["bra"])
    merged = tables.merge([renamed, _doc(("bra",))])
    assert [p.get("relabelled") for p in merged["parts"]] == [["bra → bra{prompt}"], None]
    assert all(set(r["lanes"]) == {"jsq-bytes", "bra{prompt}", "bra"} for r in merged["runs"])
    # a merged file merged again keeps every original sweep among its parts
    again = tables.merge([tables.relabel(merged, {"bra": "bra{new}"}), _doc(("bra",))])
    assert [p["command"] for p in again["parts"]] == [
        "shadow sweep jsq-bytes,bra", "shadow sweep bra", "shadow sweep bra"
    ]
    assert [p.get("relabelled") for p in again["parts"]] == [
        ["bra → bra{prompt}", "bra → bra{new}"], ["bra → bra{new}"], None
    ]
    with pytest.raises(ValueError, match="no lane"):
        tables.relabel(old, {"br0": "x"})
    with pytest.raises(ValueError, match="share a name"):
        tables.relabel(old, {"bra": "jsq-bytes"})
