"""A recording of `shadow serve` says what its live lanes ran with: `shadow replay REC` without flags
runs exactly that, a flag that departs from it is printed as a what-if, and a recording without the
settings (older recorders, `shadow tap`) still replays, with a note."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shadow.cli import main
from shadow.core.params import BRParams
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.settings import LaneSettings
from shadow.mirror.recording import CompactRecorder
from shadow.replay.experiment import ReplaySetup, as_recorded
from shadow.traces import TraceError, load_trace

SETTINGS = LaneSettings(policies=("jsq-bytes", "br0"), step=StepTimeModel(4e-7, 0.02), slots=16, lag_s=2.0,
                        br=BRParams(beta=30.0), seed=3)


def _recording(path: Path, lanes: dict[str, Any] | None) -> Path:
    rec = CompactRecorder(str(path), workers=["d0", "d1"], slots=16, lanes=lanes)
    rec.close()
    with path.open("a") as fh:
        for i in range(60):
            line = {"type": "request", "request_id": f"r{i}", "arrival_t": 100.0 + 0.05 * i,
                    "prompt_tokens": 300 + 37 * (i % 7), "output_tokens": 20 + (i % 5) * 9,
                    "worker": f"d{i % 2}", "end": "stop", "t_end": 110.0 + i}
            fh.write(json.dumps(line) + "\n")
    return path


def test_settings_round_trip_through_the_header(tmp_path: Path) -> None:
    trace = load_trace(_recording(tmp_path / "s.ndjson", SETTINGS.to_json()))
    assert trace.lane_settings == SETTINGS
    assert trace.workers == ("d0", "d1")


def test_a_bad_settings_header_is_a_one_line_error(tmp_path: Path) -> None:
    bad = {**SETTINGS.to_json(), "step": {"a_s_per_token": "fast", "b_s": 0.02}}
    with pytest.raises(TraceError, match=r"s.ndjson:1: invalid record: lanes: step a must be a number"):
        load_trace(_recording(tmp_path / "s.ndjson", bad))


def test_flags_not_given_come_from_the_recording_and_given_ones_are_what_ifs() -> None:
    setup, what_if = as_recorded(ReplaySetup(), SETTINGS, set())
    assert (setup.policies, setup.step, setup.slots, setup.br, setup.seed) == (
        SETTINGS.policies, SETTINGS.step, 16, SETTINGS.br, 3)
    assert what_if == []
    asked = ReplaySetup(step=StepTimeModel(2e-7, 0.5), br=BRParams(beta=50.0, gamma=0.5))
    setup, what_if = as_recorded(asked, SETTINGS, {"step_a", "gamma"})
    assert setup.step == StepTimeModel(2e-7, 0.02)  # b not given: the recording's
    assert setup.br == BRParams(beta=30.0, gamma=0.5)  # beta not given: the recording's
    assert what_if == ["step model a=2e-07 s/token, b=0.02 s (recorded a=4e-07, b=0.02)",
                       "BR parameters gamma=0.5 (recorded 0.86)"]


def test_replay_without_flags_runs_the_recorded_lanes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = _recording(tmp_path / "s.ndjson", SETTINGS.to_json())
    out = tmp_path / "r.json"
    assert main(["replay", str(rec), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    cfg = doc["config"]
    assert cfg["policies"] == ["actual", "jsq-bytes", "br0"]
    assert (cfg["step_a_s_per_token"], cfg["step_b_s"], cfg["slots"], cfg["seed"]) == (4e-7, 0.02, 16, 3)
    assert cfg["br"]["beta"] == 30.0 and cfg["what_if"] == []
    err = capsys.readouterr().err
    assert "replaying as the live lanes ran" in err and "what-if" not in err
    # the same replay with one flag changed says so
    assert main(["replay", str(rec), "--step-a", "1e-6", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["what_if"] == [
        "step model a=1e-06 s/token, b=0.02 s (recorded a=4e-07, b=0.02)"]
    assert "what-if: step model a=1e-06" in capsys.readouterr().err


def test_an_older_recording_replays_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = _recording(tmp_path / "old.ndjson", None)
    head = json.loads(rec.read_text().splitlines()[0])
    assert "lanes" not in head
    out = tmp_path / "r.json"
    assert main(["replay", str(rec), "--policies", "jsq-bytes", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["what_if"] is None
    assert "does not say what its lanes ran with" in capsys.readouterr().err


def test_lanes_on_the_measured_clock_replay_with_a_note_that_they_may_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    measured = LaneSettings(policies=("br0",), step=StepTimeModel(4e-7, 0.02), slots=16, clock="measured")
    rec = _recording(tmp_path / "m.ndjson", measured.to_json())
    assert load_trace(rec).lane_settings == measured
    assert main(["replay", str(rec), "--json", str(tmp_path / "r.json")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "stepped on the measured clock" in err and "may differ" in err
    assert "as the live lanes ran" not in err and "not their measured clock" in err
    # a configured clock (the default) says nothing of it, and its header has no clock field
    assert "clock" not in SETTINGS.to_json()
    with pytest.raises(ValueError, match="clock must be one of"):
        LaneSettings(policies=("br0",), step=StepTimeModel(4e-7, 0.02), slots=16, clock="wall")
