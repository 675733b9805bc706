"""Alert rules: promtool check/test, runbooks, catalogue names, firing and not-firing tests per alert."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from shadow.app.catalogue import catalogue
from shadow.telemetry.manifests import DEFAULT_RUNBOOK_BASE
from tests.telemetry.promql import metric_names

CATALOGUE = catalogue()

ROOT = Path(__file__).resolve().parents[2]
RULE_FILES = sorted((ROOT / "alerts" / "rules").glob("*.yaml"))
TEST_FILES = sorted((ROOT / "alerts" / "tests").glob("*_test.yaml"))
EXTERNAL = {"up"}  # Prometheus' own series


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is missing: apt-get install -y prometheus (scripts/test.sh does)")
    return exe


def _alerts() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            out += [r for r in group["rules"] if "alert" in r]
    return out


def test_there_are_rule_files_and_tests() -> None:
    assert RULE_FILES and TEST_FILES
    assert len(_alerts()) >= 10


def test_promtool_check_rules() -> None:
    res = subprocess.run([_promtool(), "check", "rules", *map(str, RULE_FILES)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_test_rules() -> None:
    res = subprocess.run([_promtool(), "test", "rules", *map(str, TEST_FILES)],
                         capture_output=True, text=True,
                         cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("SUCCESS") == len(TEST_FILES), res.stdout


def test_promtool_test_rules_catches_a_wrong_expectation(tmp_path: Path) -> None:
    """The unit tests can fail: flip one expectation and promtool must say so."""
    src = TEST_FILES[0]
    text = src.read_text().replace("- eval_time: 5m\n        alertname: ShadowSidecarDown\n",
                                   "- eval_time: 1m\n        alertname: ShadowSidecarDown\n", 1)
    assert text != src.read_text()
    bad = tmp_path / src.name
    bad.write_text(text.replace("../rules/", str(ROOT / "alerts" / "rules") + "/"))
    res = subprocess.run([_promtool(), "test", "rules", str(bad)], capture_output=True, text=True)
    assert res.returncode != 0 and "FAILED" in res.stdout + res.stderr


def test_every_alert_has_a_runbook_severity_and_text() -> None:
    """Severities are the ones common routing trees match; every runbook URL is an absolute URL
    under the one runbook base, naming a page of docs/runbooks that names the alert."""
    for rule in _alerts():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"], name
        page = ann["runbook_url"].removeprefix(DEFAULT_RUNBOOK_BASE + "/")
        assert page != ann["runbook_url"] and "/" not in page, f"{name}: {ann['runbook_url']}"
        runbook = ROOT / "docs" / "runbooks" / page
        assert runbook.is_file(), f"{name}: runbook {ann['runbook_url']} missing"
        assert name in runbook.read_text(), f"{name}: its runbook does not name it"


def test_the_runbook_base_is_one_build_variable(tmp_path: Path) -> None:
    """`shadow dashboards build --runbook-base URL` puts every runbook under URL, in the rule file
    and the PrometheusRule alike; a relative base is refused."""
    from shadow.commands.dashboards import generated_files

    files = generated_files(ROOT, "https://wiki.example.org/sre/shadow/")
    rules = files[ROOT / "alerts" / "rules" / "shadow.yaml"]
    manifest = files[ROOT / "deploy" / "kubernetes" / "base" / "generated" / "prometheusrule.yaml"]
    for text in (rules, manifest):
        urls = [line.split("runbook_url: ", 1)[1] for line in text.splitlines() if "runbook_url: " in line]
        assert len(urls) == len(_alerts())
        assert all(u.startswith("https://wiki.example.org/sre/shadow/") and u.endswith(".md") for u in urls)
        assert "//" not in urls[0].removeprefix("https://")
    with pytest.raises(SystemExit, match="absolute"):
        generated_files(ROOT, "docs/runbooks")


def test_every_alert_names_only_catalogued_metrics() -> None:
    for rule in _alerts():
        for name in metric_names(rule["expr"]):
            assert name in EXTERNAL or CATALOGUE.lookup(name) is not None, (
                f"{rule['alert']}: {name} not in the catalogue"
            )


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {r["alert"] for r in _alerts()}
    assert names - firing == set(), "alerts without a firing test"
    assert names - silent == set(), "alerts without a not-firing test"
