"""Rolling live lanes end to end in one process: `LiveLanes(rolling_s=W)` beside a step-level fleet,
seeds written by the compact recorder, the recording loaded as a trace and replayed window by
window (`shadow.replay.rolled`): every complete window's figures are the live report's; the report
and /metrics give per-window figures beside the cumulative ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.settings import LaneSettings
from shadow.live.lanes import LiveLanes
from shadow.live.metrics import LiveCollector
from shadow.mirror.recording import CompactRecorder
from shadow.replay.experiment import ReplaySetup, as_recorded
from shadow.replay.rolled import run_rolled
from shadow.traces import load_trace
from tests.engine.rolling_fleet import STEP, fleet

POLICIES = ("jsq-bytes", "br0", "brh:survival")
W = 5.0


def _session(path: Path) -> LiveLanes:
    real = fleet(3, 4, rate=15.0, out=40, every=4, seed=11, route="jsq-bytes")
    workers = [f"d{g}" for g in range(3)]
    live = LiveLanes(workers=workers, slots=4, policies=POLICIES, step=StepTimeModel(a=1e-9, b=STEP),
                     lag_s=1.0, rolling_s=W, clock=lambda: real.t, lane_clock="configured")
    settings = LaneSettings(policies=POLICIES, step=live.step, slots=4, lag_s=1.0, rolling_s=W)
    rec = CompactRecorder(str(path), workers=workers, slots=4, lanes=settings.to_json())
    live.seed_sink = rec.seed
    end = real.t + 60.0
    while real.t < end or real.busy():
        real.arrivals = real.t < end
        for ev in real.step():
            live.listener(ev)
            rec.write(ev)
        live.process_now()
        live.driver.advance_to(live.live_now())
        rec.flush()
    live.drain(timeout_s=60.0)
    rec.close()
    return live


def test_replayed_windows_are_the_live_ones(tmp_path: Path) -> None:
    path = tmp_path / "rolling.ndjson.gz"
    live = _session(path)
    rep = live.report()
    assert rep["rolling"]["window_s"] == W and rep["rolling"]["reseeds"] >= 4 * 10
    assert rep["windows"]["window_s"] == W
    for label in ("actual", "jsq-bytes", "br0", "brh-survival"):
        lane = rep["lanes"][label]
        assert lane["reseeds"] >= 10
        assert lane["window_index"] == rep["windows"]["lanes"][label][-1]["index"]
        assert lane["window_avg_spread_tokens"] == rep["windows"]["lanes"][label][-1]["avg_spread_tokens"]
    registry = CollectorRegistry(auto_describe=True)
    registry.register(LiveCollector(live))
    page = generate_latest(registry).decode()
    assert 'shadow_lane_window_spread_tokens{lane="br0"}' in page
    assert 'shadow_lane_reseeds_total{lane="actual"}' in page

    trace = load_trace(path)
    assert trace.lane_settings is not None and trace.lane_settings.rolling_s == W
    assert len(trace.seeds) >= 11
    setup, what_if = as_recorded(ReplaySetup(), trace.lane_settings, set())
    assert what_if == []
    report = run_rolled(trace, setup)
    g = len(live.workers)
    compared = 0
    for label in report.lanes:
        mine = {w.index: w for w in live.windows.series(label)}
        for w in report.windows[label]:
            live_w = mine.get(w["index"])
            if live_w is None or live_w.cut:
                continue
            assert w == live_w.figures(live.step, g), (label, w["index"])
            compared += 1
    assert compared >= 4 * 10
    for n in (2, 7):
        alone = run_rolled(trace, setup, only=n)
        for label in ("actual", "jsq-bytes", "br0"):
            (w,) = alone.windows[label]
            live_w = {x.index: x for x in live.windows.series(label)}[n]
            assert live_w.cut or w == live_w.figures(live.step, g), (label, n)


def test_shadow_replay_prints_and_writes_the_windows(tmp_path: Path) -> None:
    """`shadow replay REC` as a user runs it: no flags, the recorded lanes, every window in turn;
    `--rolling-window N` one window alone; both agree with the live windows."""
    path = tmp_path / "rolling.ndjson"
    live = _session(path)
    g = len(live.workers)
    out = tmp_path / "all.json"
    run = subprocess.run([sys.executable, "-m", "shadow", "replay", str(path), "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "replaying as the live lanes ran" in run.stderr and "what-if" not in run.stderr
    assert "average spread per 5 s window" in run.stdout
    doc = json.loads(out.read_text())
    assert doc["rolling"]["window_s"] == W
    for label, lane in doc["lanes"].items():
        mine = {w.index: w for w in live.windows.series(label)}
        agree = [w for w in lane["windows"] if w["index"] in mine and not mine[w["index"]].cut]
        assert len(agree) >= 10
        for w in agree:
            assert w == mine[w["index"]].figures(live.step, g), (label, w["index"])
    one = tmp_path / "one.json"
    run = subprocess.run([sys.executable, "-m", "shadow", "replay", str(path), "--rolling-window", "4",
                          "--json", str(one)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lanes = json.loads(one.read_text())["lanes"]
    (w,) = lanes["br0"]["windows"]
    live_w = {x.index: x for x in live.windows.series("br0")}[4]
    assert live_w.cut or w == live_w.figures(live.step, g)
