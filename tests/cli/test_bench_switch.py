"""bench/bench_switch.py's own arithmetic, without an engine: the seeded workloads are what its
docstring says (the misplacing one's heavy-byte requests carry the bytes, its light ones the
output), every figure is read as B over A (the report's spread ratio, lane-better > 1, inverted),
and the engines' spreads are taken at each busy step against the other rank's latest state."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_switch as bench


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_the_misplacing_workload_separates_bytes_from_outputs(tmp_path: Path) -> None:
    shape = bench.write_trace(tmp_path / "m.csv", "misplacing", 60, 7, 400)
    rows = _rows(tmp_path / "m.csv")
    heavy = [r for r in rows if int(r["prompt_tokens"]) >= 360]
    light = [r for r in rows if int(r["prompt_tokens"]) <= 12]
    assert len(heavy) == len(light) == 30 and shape["requests"] == 60
    assert max(int(r["output_tokens"]) for r in heavy) < min(int(r["output_tokens"]) for r in light)
    assert shape["output_tokens"] == sum(int(r["output_tokens"]) for r in rows)
    assert {r["arrival_s"] for r in rows} == {"0.0"}
    again = tmp_path / "again.csv"
    bench.write_trace(again, "misplacing", 60, 7, 400)
    assert again.read_text() == (tmp_path / "m.csv").read_text()  # seeded: every run the same trace


def test_the_neutral_workload_is_alike(tmp_path: Path) -> None:
    bench.write_trace(tmp_path / "n.csv", "neutral", 40, 7, 400)
    rows = _rows(tmp_path / "n.csv")
    assert all(20 <= int(r["prompt_tokens"]) <= 40 and 100 <= int(r["output_tokens"]) <= 200 for r in rows)


def _report(spread: tuple[float, float, float], tput: tuple[float, float, float]) -> dict[str, Any]:
    iv = lambda t: {"ratio": t[1], "low": t[0], "high": t[2]}  # noqa: E731
    return {"lanes": {"br0": {"tpot_s": 0.018}, "actual": {"tpot_s": 0.020}},
            "comparison": {"lanes": {"br0": {"spread": iv(spread), "throughput": iv(tput)}}}}


def test_predictions_are_b_over_a() -> None:
    run = bench.Run("A", 1.0, report=_report((1.6, 2.0, 2.5), (1.05, 1.1, 1.2)))
    p = run.predicted()
    assert p["step"] == (pytest.approx(0.9), None, None)  # br0's mean step over actual's
    assert p["throughput"] == (1.1, 1.05, 1.2)  # lane over actual already
    assert p["spread"] == (pytest.approx(0.5), pytest.approx(0.4), pytest.approx(1 / 1.6))


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 8), st.integers(0, 3)), min_size=1, max_size=40))
def test_spreads_are_taken_at_busy_steps_against_the_other_ranks_latest(
        steps: list[tuple[int, int, int]]) -> None:
    events = [{"t": float(i), "engine": e, "running": n, "kv_usage": n / 100, "tokens": tok,
               "duration_s": 0.01} for i, (e, n, tok) in enumerate(steps)]
    run = bench.Run("A", 0.0, steps=events)
    last = {0: 0, 1: 0}
    gaps = []
    for e, n, tok in steps:
        last[e] = n
        if tok > 0:
            gaps.append(abs(last[0] - last[1]))
    if gaps:
        assert run.running_spread() == pytest.approx(sum(gaps) / len(gaps))
        assert run.kv_spread() == pytest.approx(sum(gaps) / len(gaps) / 100)
    else:
        assert run.running_spread() != run.running_spread()  # nan: no busy step
