"""The steady-state protocol: admission-timeout shedding in lanes, window figures, tiling, t-intervals,
and `shadow sweep` / `shadow replay --steady` output."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from shadow.cli import main
from shadow.core.intervals import mean_interval, ratio_interval
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.replay.protocol import Cell, Protocol, bounds, interval_text, lane_spec, run_cell, summarise, tile
from shadow.traces import synthetic_workload


@pytest.mark.parametrize("policy", ["jsq-bytes", "br0", "bra"])
def test_shed_waiting_drops_only_requests_that_waited_too_long(policy: str) -> None:
    config = EngineConfig(workers=2, slots=1, step=StepTimeModel(a=0.0, b=1.0))
    lane = Lane(LaneSpec.parse(policy), config, time.perf_counter)
    for i in range(6):  # two run, four wait
        lane.offer(Job(i, float(i), 100, 50), float(i))
    lane.now = 10.0
    lane.step()
    assert lane.active == 2 and lane.waiting == 4
    shed = lane.shed_waiting(3.5)  # requests that reached the router before t=3.5 and still wait
    waiting_ready = sorted(i for i in range(6))[2:]
    expected = sum(1 for i in waiting_ready if i < 3.5) if policy != "jsq-bytes" else None
    if expected is not None:
        assert shed == expected
    assert lane.totals.shed == shed and shed >= 1
    assert lane.waiting == 4 - shed
    assert lane.shed_waiting(3.5) == 0  # idempotent
    if lane.binds_at_arrival:
        assert sum(lane.queued_tokens) == 100 * lane.waiting


def _cell(
    timeout: float | None, lanes: tuple[str, ...] = ("jsq-bytes", "br0", "bra"), queue: int | None = None
) -> Cell:
    proto = Protocol(
        queue_per_worker=queue,
        warmup_lifetimes=1.0,
        window_lifetimes=2.0,
        timeout_s=timeout,
        seeds=(0,),
        max_requests=400,
    )
    return Cell("paper-azure", 2, 1.2, 0, lanes, slots=4, protocol=proto)


def test_overloaded_cell_sheds_with_a_timeout_and_not_without() -> None:
    with_timeout = run_cell(_cell(5.0), time.perf_counter)
    without = run_cell(_cell(None), time.perf_counter)
    for label in ("jsq-bytes", "br0", "bra"):
        w, o = with_timeout["lanes"][label], without["lanes"][label]
        assert w["steps"] > 0 and o["steps"] > 0
        assert w["shed"] > 0 and 0 < w["shed_fraction"] < 1
        assert o["shed"] == 0
        assert w["spread_steps"] >= 0 and w["throughput_tps"] > 0
    assert with_timeout["window_s"] == pytest.approx(2.0 * with_timeout["lifetime_s"], rel=0.2)


def test_bounded_queue_rejects_arrivals_and_never_holds_more_than_its_bound() -> None:
    from shadow.engine.config import EngineConfig
    from shadow.replay.protocol import drive

    for policy in ("jsq-bytes", "br0", "bra"):
        lane = Lane(LaneSpec.parse(policy), EngineConfig(workers=2, slots=2), time.perf_counter)
        jobs = [Job(i, 0.001 * i, 1000, 400) for i in range(100)]  # a burst far beyond 4 slots
        seen: list[int] = []
        step = lane.step

        def watch(until=math.inf, step=step, lane=lane, seen=seen) -> bool:  # type: ignore[no-untyped-def]
            seen.append(lane.waiting)
            return step(until)

        lane.step = watch  # type: ignore[method-assign]
        fig = drive(lane, jobs, 0.0, 5.0, None, queue_cap=6)
        assert max(seen) <= 6
        assert lane.totals.shed == 100 - 6 - 4  # four run, six wait, the rest are rejected
        assert fig["shed"] == 90  # rejections inside the window are the window's shed count


def test_default_protocol_is_the_bounded_queue() -> None:
    p = Protocol()
    assert p.queue_per_worker == 6 and p.timeout_s is None
    assert "queue bound 6×G" in p.describe()
    with pytest.raises(ValueError, match="queue bound"):
        Protocol(queue_per_worker=0)


def test_summary_pairs_ratios_per_seed() -> None:
    runs = []
    for seed, (a, b) in enumerate([(100.0, 50.0), (120.0, 40.0), (90.0, 45.0)]):
        lanes = {
            "jsq": _fig("jsq", a),
            "br0": _fig("br0", b),
        }
        runs.append(
            {
                "workload": "w",
                "workers": 8,
                "load": 1.0,
                "seed": seed,
                "requests": 1,
                "window_s": 1.0,
                "lifetime_s": 1.0,
                "lanes": lanes,
            }
        )
    (cell,) = summarise(runs)
    assert cell["best_baseline_spread"] == "jsq"
    ratio, low, high = cell["lanes"]["br0"]["spread_x"]
    expected = ratio_interval([2.0, 3.0, 2.0])
    assert ratio == pytest.approx((2.0 * 3.0 * 2.0) ** (1 / 3))
    assert (ratio, low, high) == pytest.approx((expected.ratio, expected.low, expected.high))
    assert 0 < low < ratio < high
    # a paired change is the same estimate in percent: throughput is equal in every seed here
    assert cell["lanes"]["br0"]["throughput_pct"] == pytest.approx((0.0, 0.0, 0.0))


def _fig(policy: str, spread: float) -> dict[str, object]:
    return {
        "policy": policy,
        "spread_steps": spread,
        "spread_seconds": spread,
        "imbalance": spread,
        "idle_fraction": 0.0,
        "throughput_tps": 100.0,
        "tpot_p95_ms": 50.0,
        "ttft_p99_ms": 1.0,
        "shed_fraction": 0.0,
        "decision_p99_ms": 0.1,
    }


def test_mean_interval_matches_the_t_table() -> None:
    mean, half = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.302653 * 1.0 / math.sqrt(3))
    assert mean_interval([5.0]) == (5.0, 0.0)


def test_summary_entries_print_and_bound_both_shapes() -> None:
    assert interval_text((12.0, 0.5), ".1f") == "12.0 ± 0.5"
    assert interval_text((1.1, 0.95, 1.27), ".2f") == "1.10 (0.95–1.27)"
    assert interval_text((1.1, math.nan, math.nan), ".2f") == "1.10"
    assert interval_text((math.nan, 0.0), ".2f") == "–"
    assert bounds((2.0, 0.5)) == (2.0, 1.5, 2.5)
    assert bounds((2.0, 1.5, 3.0)) == (2.0, 1.5, 3.0)


def test_tile_keeps_gaps_and_rotates_by_seed() -> None:
    base = synthetic_workload("paper-azure", seed=0, n=50)
    same = tile(base, 50, 0)
    assert [r.prompt_tokens for r in same.requests] == [r.prompt_tokens for r in base.requests]
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(base.requests, base.requests[1:], strict=False)]
    got = [b.arrival_s - a.arrival_s for a, b in zip(same.requests, same.requests[1:], strict=False)]
    assert got == pytest.approx(gaps)
    longer = tile(base, 120, 3)
    start = next(i for i in range(50) if base.requests[i].prompt_tokens == longer.requests[0].prompt_tokens)
    assert [r.prompt_tokens for r in longer.requests] == [
        base.requests[(start + k) % 50].prompt_tokens for k in range(120)
    ]
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(longer.requests, longer.requests[1:], strict=False))


def test_ablation_names_and_unknown_ones() -> None:
    spec, params = lane_spec("bra{pick}")
    assert spec.policy == "bra" and spec.label == "bra{pick}" and params is not None and not params.hold
    with pytest.raises(ValueError, match="unknown BRA ablation"):
        lane_spec("bra{nope}")


def test_sweep_prints_the_protocol_and_writes_cis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    args = [
        "sweep",
        "paper-azure",
        "--workers",
        "2",
        "-B",
        "4",
        "--loads",
        "1.2",
        "--seeds",
        "0,1",
        "--warmup",
        "1",
        "--window",
        "1",
        "--max-requests",
        "200",
        "--policies",
        "jsq,br0,bra",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "queue bound 6×G" in text and "× best (steps)" in text
    doc = json.loads(out.read_text())
    (cell,) = doc["summary"]
    assert cell["seeds"] == [0, 1] and set(cell["lanes"]) == {"jsq", "br0", "bra"}
    assert len(doc["runs"]) == 2 and doc["protocol"]["queue_per_worker"] == 6
    assert (
        main(
            [
                "replay",
                "paper-azure",
                "-G",
                "2",
                "-B",
                "4",
                "--load",
                "1.2",
                "--steady",
                "--seeds",
                "0",
                "--warmup",
                "1",
                "--window",
                "1",
                "--policies",
                "jsq,bra",
            ]
        )
        == 0
    )
    assert "bra" in capsys.readouterr().out
    assert main(["sweep", "paper-azure", "--limit", "10"]) == 2
    assert "--max-requests" in capsys.readouterr().err
