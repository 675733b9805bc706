"""The cost model in replays and recordings: `--step-c/--step-p` reach the lanes (and their policies'
cost), a recording's lanes header carries c and p (written only where they are not 0, so older
headers read as c = p = 0) and `shadow replay REC` runs with them unless a flag says otherwise."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shadow.cli import main
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.settings import LaneSettings
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
