"""Metric names, types, label names and help texts of the running exporters stay as recorded."""

from __future__ import annotations

import pytest

from tests.telemetry.families import differences, families, recorded, scrape


def test_differences_name_what_moved() -> None:
    text = recorded()["tap"]
    name = "shadow_mirror_kv_tokens"
    assert text[name]["type"] == "gauge"
    moved = (f"# HELP {name} Another help.\n# TYPE {name} gauge\n{name}{{worker=\"a\",extra=\"x\"}} 1\n"
             "# HELP shadow_made_up_total x\n# TYPE shadow_made_up_total counter\nshadow_made_up_total 1\n")
    found = differences("tap", moved)
    assert f"{name}: help 'Another help.', recorded {text[name]['help']!r}" in found
    assert f"{name}: labels ['extra', 'worker'], recorded ['worker']" in found
    assert "shadow_made_up_total: exported, not recorded" in found
    assert "shadow_mirror_events_total: recorded, not exported" in found
    assert families(moved)["shadow_made_up_total"] == {"type": "counter", "help": "x", "labels": []}


@pytest.mark.integration
def test_running_exporters_declare_the_recorded_families() -> None:
    """`shadow tap`, `shadow serve`, `shadow serve --active`, the fleet and `shadow router`, each
    after traffic: the same families with the same type, help and label names as recorded."""
    got = scrape()
    assert set(got) == set(recorded())
    problems = {scenario: differences(scenario, text) for scenario, text in got.items()}
    assert problems == {scenario: [] for scenario in got}, problems

