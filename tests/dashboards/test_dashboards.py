"""Dashboards: rebuilt from code they equal the committed files; structure, units, datasource,
descriptions, ids and grid; every query parses and names only catalogued metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from shadow.app.catalogue import catalogue
from shadow.commands.dashboards import generated_files
from tests.telemetry.promql import metric_names, substitute

CATALOGUE = catalogue()

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "dashboards").glob("*.json"))
VARS = {"fleet": ".*", "instance": ".*", "lane": ".*"}


def _load() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in FILES]


def _panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in d["panels"] if p["type"] != "row"]


def all_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) for every target."""
    return [(d["uid"], p["title"], t["expr"]) for d in _load() for p in _panels(d) for t in p["targets"]]


def test_generated_files_are_up_to_date() -> None:
    for path, text in generated_files(ROOT).items():
        assert path.is_file(), f"{path} missing: run `shadow dashboards build`"
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: run `shadow dashboards build`"


def test_the_eight_dashboards_exist_with_unique_stable_uids() -> None:
    uids = [d["uid"] for d in _load()]
    assert sorted(uids) == ["shadow-fairness", "shadow-fleet", "shadow-mirror-health", "shadow-overview",
                            "shadow-pool", "shadow-predictors", "shadow-router", "shadow-step-model"]
    for d, path in zip(_load(), FILES, strict=True):
        assert path.name == d["uid"] + ".json"
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", d["uid"])
        assert d.get("id") is None
        assert d["schemaVersion"] <= 41
        assert d["editable"] is False  # the code is the source of truth (dashboard-linter's rule)
        assert d["graphTooltip"] == 1 and "shadow" in d["tags"]


def test_variables_datasource_fleet_instance() -> None:
    for d in _load():
        vs = {v["name"]: v for v in d["templating"]["list"]}
        assert [v["type"] for v in vs.values()].count("datasource") == 1
        assert vs["datasource"]["query"] == "prometheus"
        for name in ("cluster", "namespace", "pod", "fleet", "instance"):
            assert vs[name]["type"] == "query" and vs[name]["refresh"] == 2, name
            assert vs[name]["datasource"]["uid"] == "${datasource}"
            assert vs[name]["includeAll"] and vs[name]["allValue"] == ".*", name
        # every target is scoped by them
        for p in _panels(d):
            for t in p["targets"]:
                for var in ("cluster", "namespace", "pod", "fleet", "instance"):
                    assert f'{var}=~"${var}"' in t["expr"], (d["uid"], p["title"], var)


def test_every_panel_has_datasource_unit_description_and_targets() -> None:
    for d in _load():
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), d["uid"]
        for p in _panels(d):
            where = f"{d['uid']}/{p['title']}"
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert p.get("description", "").strip(), where
            assert p["fieldConfig"]["defaults"].get("unit"), where
            assert p["targets"], where
            refs = [t["refId"] for t in p["targets"]]
            assert all(refs) and len(refs) == len(set(refs)), where
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}", where


def test_grid_positions_fit_and_do_not_overlap() -> None:
    for d in _load():
        cells: set[tuple[int, int]] = set()
        for p in d["panels"]:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{d['uid']}: {p['title']} overlaps"
                    cells.add((x, y))


@pytest.mark.parametrize(("uid", "title", "expr"), all_queries())
def test_query_parses_names_catalogued_metrics_and_rates_counters(uid: str, title: str, expr: str) -> None:
    text = substitute(expr, VARS)
    names = metric_names(text)
    assert names, f"{uid}/{title}: no metric"
    for name in names:
        assert CATALOGUE.lookup(name) is not None, f"{uid}/{title}: {name} is not in the catalogue"
    assert "[1m]" in text or ("_total" not in text and "_bucket" not in text and "_sum" not in text), (
        f"{uid}/{title}: counters must be rated over $__rate_interval"
    )
    for m in re.finditer(r"(\w+_total)\{", expr):
        before = expr[: m.start()].rstrip()
        assert before.endswith(("rate(", "increase(")), f"{uid}/{title}: {m.group(1)} used without rate()"


def test_variable_queries_name_catalogued_metrics() -> None:
    for d in _load():
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                m = re.fullmatch(r"label_values\((\w+)(\{.*\})?, (\w+)\)", v["query"])
                assert m and CATALOGUE.lookup(m.group(1)) is not None, v["query"]


def test_every_active_routing_metric_is_on_a_dashboard() -> None:
    """The Router, Predictors, Pool and Fairness dashboards cover the whole active-routing table."""
    shown = set()
    for _, _, expr in all_queries():
        shown |= {spec.name for n in metric_names(substitute(expr, VARS)) if (spec := CATALOGUE.lookup(n))}
    assert sorted(CATALOGUE.active_only() - shown) == []


def test_active_dashboards_read_active_metrics_or_the_lanes() -> None:
    for d in _load():
        if d["uid"] not in ("shadow-router", "shadow-predictors", "shadow-pool", "shadow-fairness"):
            continue
        for p in _panels(d):
            for t in p["targets"]:
                names = {spec.name for n in metric_names(substitute(t["expr"], VARS))
                         if (spec := CATALOGUE.lookup(n))}
                assert names & CATALOGUE.active_only() or all(n.startswith("shadow_lane_") for n in names), (
                    f"{d['uid']}/{p['title']}: {sorted(names)}")


def _alert_exprs() -> list[str]:
    import yaml

    return [r["expr"] for p in sorted((ROOT / "alerts" / "src").glob("*.yaml"))
            for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_threshold_lines_are_the_alerts_constants_and_are_drawn() -> None:
    """Each ALERT_LINES entry is a constant an alert compares its metric with (same direction), and
    some time series showing the metric draws it as a dashed threshold line."""
    from shadow.telemetry.dashboards._kit import ALERT_LINES

    exprs = " ".join(" ".join(e.split()) for e in _alert_exprs())
    drawn: set[tuple[str, float]] = set()
    for d in _load():
        for p in _panels(d):
            defaults = p.get("fieldConfig", {}).get("defaults", {})
            style = defaults.get("custom", {}).get("thresholdsStyle", {}).get("mode")
            if p["type"] != "timeseries" or style is None:
                continue
            assert style == "dashed", p["title"]
            values = {s["value"] for s in defaults["thresholds"]["steps"]}
            for t in p["targets"]:
                for name in metric_names(substitute(t["expr"], VARS)):
                    base = name.removesuffix("_bucket")
                    if base in ALERT_LINES and ALERT_LINES[base][0] in values:
                        drawn.add((base, ALERT_LINES[base][0]))
    for name, (value, above) in ALERT_LINES.items():
        op = ">" if above else "<"
        pattern = rf"{name}(_bucket)?\b[^<>]*?\)*\s*{op}\s*{re.escape(repr(value).removesuffix('.0'))}\b"
        assert re.search(pattern, exprs), f"no alert compares {name} {op} {value}"
        assert (name, value) in drawn, f"no panel draws the {name} line at {value}"


def test_counter_rate_panels_show_zero_and_every_dashboard_marks_mode_changes_and_trips() -> None:
    for d in _load():
        names = [a["name"] for a in d["annotations"]["list"]]
        assert names[:2] == ["Mode changes", "Fallback trips"], (d["uid"], names)
        for a in d["annotations"]["list"][:2]:
            assert a["datasource"]["uid"] == "${datasource}" and a["enable"] is True
            assert set(metric_names(substitute(a["expr"], VARS))) <= {
                "shadow_mode_transitions_total", "shadow_fallback_trips_total"}
        for p in _panels(d):
            exprs = [t["expr"] for t in p["targets"]]
            rates = all(re.match(r"^\s*sum\b.*\b(rate|increase)\(", e) for e in exprs)
            if rates and p["type"] in ("timeseries", "stat"):
                assert p["fieldConfig"]["defaults"].get("noValue") == "0", (d["uid"], p["title"])
