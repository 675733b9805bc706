"""`/v1/report` as types: the published JSON Schema is derived from `shadow.contracts.report`, every
section is closed, and what the lanes publish holds to it (the serve, sharded, demo and real-engine
reports are checked where those tests fetch them: `tests.reportschema.check_report`)."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from shadow.contracts.report import LaneReport, Report, report_schema
from shadow.live.lanes import LiveLanes
from tests.live.test_serve_api import B, G
from tests.reportschema import check_report


def test_the_schema_is_draft_2020_12_and_every_section_is_closed() -> None:
    schema = report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["additionalProperties"] is False
    assert all(d.get("additionalProperties") is False for d in schema["$defs"].values())
    # the lane section's keys are exactly the types' (figures, last window and state)
    lane = schema["$defs"]["LaneReport"]
    assert set(lane["properties"]) == set(LaneReport.__annotations__) | {
        k for base in LaneReport.__orig_bases__ for k in base.__annotations__}  # type: ignore[attr-defined]
    assert set(schema["required"]) == Report.__required_keys__


def _lanes_report() -> dict:  # type: ignore[type-arg]
    lanes = LiveLanes(workers=[f"d{g}" for g in range(G)], slots=B, policies=["jsq-bytes", "br0", "brh"])
    return dict(lanes.report())


def test_a_fresh_report_holds_to_the_schema_and_a_renamed_key_does_not() -> None:
    doc = _lanes_report()
    check_report(doc)
    renamed = copy.deepcopy(doc)
    lane = renamed["lanes"]["br0"]
    lane["avg_spread"] = lane.pop("avg_spread_tokens")
    with pytest.raises(AssertionError, match="avg_spread"):
        check_report(renamed)
    wrong = copy.deepcopy(doc)
    wrong["comparison"]["trustworthy"] = "yes"
    with pytest.raises(AssertionError, match="comparison/trustworthy"):
        check_report(wrong)
