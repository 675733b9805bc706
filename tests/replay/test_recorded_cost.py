"""The cost model in replays and recordings: `--step-c/--step-p` reach the lanes (and their policies'
cost), a recording's lanes header carries c and p (written only where they are not 0, so older
headers read as c = p = 0) and `shadow replay REC` runs with them unless a flag says otherwise;
with the measured lane clock the recording carries the fitted step models as `clock` lines (each
change) and the replay steps and routes on the last one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shadow.app.serve import ServeConfig, ServeService
from shadow.cli import main
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import LaneClock
from shadow.engine.settings import LaneSettings, clock_from_json, clock_to_json
from shadow.mirror.config import MirrorConfig
from shadow.mirror.recording import CompactRecorder
from shadow.replay.experiment import ReplaySetup, as_recorded
from shadow.traces import load_trace
from tests.replay.test_recorded_settings import SETTINGS, _recording

COSTED = replace(SETTINGS, step=StepTimeModel(4e-7, 0.02, c=2e-3, p=1e-5))


def test_a_linear_model_writes_the_header_it_always_wrote() -> None:
    assert set(SETTINGS.to_json()["step"]) == {"a_s_per_token", "b_s", "source"}
    step = COSTED.to_json()["step"]
    assert (step["c_s_per_seq"], step["p_s_per_prefill_token"]) == (2e-3, 1e-5)


def test_the_cost_model_round_trips_through_a_recording(tmp_path: Path) -> None:
    trace = load_trace(_recording(tmp_path / "s.ndjson", COSTED.to_json()))
    assert trace.lane_settings == COSTED
    older = load_trace(_recording(tmp_path / "o.ndjson", SETTINGS.to_json()))
    assert older.lane_settings is not None and older.lane_settings.step.linear


def test_a_bad_cost_term_is_a_one_line_error() -> None:
    bad = {**COSTED.to_json(), "step": {**COSTED.to_json()["step"], "c_s_per_seq": "slow"}}
    with pytest.raises(ValueError, match=r"^lanes: step c must be a number$"):
        LaneSettings.from_json(bad)
    with pytest.raises(ValueError, match=r"c must be a finite number >= 0"):
        LaneSettings.from_json({**bad, "step": {**bad["step"], "c_s_per_seq": -1.0}})


def test_a_replay_takes_c_and_p_from_the_recording_unless_given() -> None:
    setup, what_if = as_recorded(ReplaySetup(), COSTED, set())
    assert setup.step == COSTED.step and what_if == []
    setup, what_if = as_recorded(ReplaySetup(step=StepTimeModel(4e-7, 0.02, c=5e-4)), COSTED, {"step_c"})
    assert setup.step == StepTimeModel(4e-7, 0.02, c=5e-4, p=1e-5)
    assert what_if == ["step model a=4e-07 s/token, b=0.02 s, c=0.0005 s/sequence, p=1e-05 s/prefill token "
                       "(recorded a=4e-07, b=0.02, c=0.002, p=1e-05)"]


def test_replay_runs_the_recorded_cost_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = _recording(tmp_path / "s.ndjson", COSTED.to_json())
    out = tmp_path / "r.json"
    assert main(["replay", str(rec), "--json", str(out)]) == 0
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["step_c_s_per_seq"], cfg["step_p_s_per_prefill_token"]) == (2e-3, 1e-5)
    assert cfg["route_cost"].startswith("KV tokens + 5000 per running sequence")
    assert "c=0.002 s/sequence" in capsys.readouterr().err


def test_step_c_reaches_the_lanes_and_their_policies(tmp_path: Path) -> None:
    docs = {}
    for c in ("0", "0.004"):
        out = tmp_path / f"r{c}.json"
        assert main(["replay", "paper-azure", "--limit", "200", "--policies", "jsq-bytes,br0", "-G", "4",
                     "-B", "16", "--rate-scale", "1", "--step-c", c, "--json", str(out)]) == 0
        docs[c] = json.loads(out.read_text())
    assert docs["0"]["config"]["route_cost"].startswith("KV tokens (kappa = 0")
    assert docs["0.004"]["config"]["route_cost"].startswith("KV tokens + 3.333e+04 per running sequence")
    assert docs["0.004"]["config"]["step_c_s_per_seq"] == 0.004
    assert docs["0"]["results"]["br0"] != docs["0.004"]["results"]["br0"]


# -- the measured clock: the fitted step models the live lanes stepped on ---------------------------

FITTED = LaneClock.barrier(2, [StepTimeModel(2e-6, 0.015, c=1e-3)] * 2)
MEASURED = replace(SETTINGS, clock="measured")


def test_a_clock_round_trips_and_a_bad_one_is_a_one_line_error() -> None:
    assert clock_from_json(clock_to_json(FITTED), 2) == FITTED
    plain = LaneClock.independent(2)
    assert clock_from_json(clock_to_json(plain), 2) == plain
    with pytest.raises(ValueError, match="must partition the 3 workers"):
        clock_from_json(clock_to_json(FITTED), 3)
    with pytest.raises(ValueError, match=r"models must be \[a, b, c, p\]"):
        clock_from_json({"groups": [[0, 1]], "models": [[1e-6, 0.02]] * 2}, 2)
    with pytest.raises(ValueError, match="c must be a finite number >= 0"):
        clock_from_json({"groups": [[0, 1]], "models": [[1e-6, 0.02, -1.0, 0.0]] * 2}, 2)


def _measured_recording(path: Path, clocks: list[LaneClock]) -> Path:
    """A recording of measured-clock lanes: its header, a clock line per clock, then the requests
    `_recording` writes."""
    rec = CompactRecorder(str(path), workers=["d0", "d1"], slots=16, lanes=MEASURED.to_json())
    for i, clock in enumerate(clocks):
        rec.clock(50.0 + i, clock)
    rec.close()
    requests = _recording(path.with_suffix(".requests"), None).read_text().splitlines()[1:]
    with path.open("a") as fh:
        fh.write("\n".join(requests) + "\n")
    return path


def test_a_measured_recording_replays_on_the_lanes_last_clock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = _measured_recording(tmp_path / "m.ndjson", [LaneClock.barrier(2), FITTED])
    trace = load_trace(rec)
    assert [t for t, _ in trace.clocks] == [50.0, 51.0] and trace.clocks[-1][1] == FITTED
    out = tmp_path / "r.json"
    assert main(["replay", str(rec), "--json", str(out)]) == 0
    cfg = json.loads(out.read_text())["config"]
    assert cfg["clock"] == clock_to_json(FITTED)
    assert cfg["route_cost"].startswith("KV tokens + 500 per running sequence")  # c/a of the fit
    err = capsys.readouterr().err
    assert "on the live lanes' last measured clock (recorded at t=51, of 2)" in " ".join(err.split())
    # a step flag asks for the configured model: the fitted clock gives way, and the note says why
    assert main(["replay", str(rec), "--step-c", "0", "--json", str(out)]) == 0
    cfg = json.loads(out.read_text())["config"]
    assert cfg["clock"] is None and cfg["route_cost"].startswith("KV tokens (kappa = 0")
    assert "a --step-* flag asks for" in " ".join(capsys.readouterr().err.split())


def test_serve_records_the_lanes_clock_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "s.ndjson"
    tap = MirrorConfig({"d0": "http://127.0.0.1:1", "d1": "http://127.0.0.1:2"}, slots=8, record=str(path))
    svc = ServeService(ServeConfig(tap))  # constructed, never started: its recorder is open
    svc._note_clock()  # the configured model on one barrier: a replay runs on it without a line
    svc.live.lane_clock = FITTED  # as a refit sets it
    svc._note_clock()
    svc._note_clock()  # unchanged: not written again
    svc.live.lane_clock = LaneClock.barrier(2, [svc.live.step] * 2)  # back to the configured model
    svc._note_clock()
    assert svc.tap.recorder is not None
    svc.tap.recorder.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    clocks = [x for x in lines if x["type"] == "clock"]
    assert [c["models"][0][2] for c in clocks] == [1e-3, 0.0]


def test_sweep_takes_the_cost_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    assert main(["sweep", "paper-azure", "--workers", "2", "--loads", "0.8", "--seeds", "0", "--policies",
                 "jsq-bytes,br0", "--step-c", "0.001", "--max-requests", "300", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["step"] == {"a": 1.2e-7, "b": 0.02, "c": 0.001, "p": 0.0}
    text = " ".join(capsys.readouterr().out.split())
    assert "c=0.001 s/sequence; BalanceRoute balances KV tokens + 8333 per running sequence" in text
