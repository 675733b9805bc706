"""A real Prometheus (Debian package) loads the shipped scrape config (targets templated to loopback)
and the shipped alert rules, scrapes a running stack (simulated fleet + `shadow serve`: taps and live
lanes), and evaluates every PromQL expression of every dashboard and alert rule: each parses and
returns data (for an alert, each metric its condition reads has data: a healthy condition is empty).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from shadow.app.catalogue import catalogue
from shadow.base.procs import shadow_argv
from tests.live.stack import Procs
from tests.telemetry.promql import metric_names, substitute
from tests.telemetry.servers import Prometheus
from tests.telemetry.servers import wait_for as _wait
from tests.telemetry.stack import Stack, post_probe_steps, running_stack, send_traffic, until_step_model

CATALOGUE = catalogue()

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VARS = {"fleet": ".*", "instance": ".*", "lane": ".*"}
RATE = "30s"


def _expressions() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        d = json.loads(path.read_text())
        for p in d["panels"]:
            for t in p.get("targets", []):
                out.append((f"{d['uid']}/{p['title']}/{t['refId']}", t["expr"]))
    for path in sorted((ROOT / "alerts" / "rules").glob("*.yaml")):
        for g in yaml.safe_load(path.read_text())["groups"]:
            for r in g["rules"]:
                out.append((f"rule {r.get('alert') or r.get('record')}", r["expr"]))
    return out


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, Stack]]:
    tmp = tmp_path_factory.mktemp("dataplane")
    procs = Procs(tmp)
    with contextlib.ExitStack() as stack_of, running_stack(serve=True, time_scale=1.0) as stack:
        stack_of.callback(procs.close)
        # a data plane of its own (`shadow tap`) in front of d0, for the `shadow-tap` job's families
        _, tap = procs.start("tap", shadow_argv("tap", "--upstream", f"d0={stack.fleet.decode_urls[0]}",
                                                "--state-dir", str(tmp), "--name", "d0"))
        tap_target = str(tap["metrics"]).removeprefix("http://").rstrip("/").removesuffix("/metrics")
        send_traffic(list(stack.tap_urls.values()), per_url=8, max_tokens=60)
        # one rejected line (bad JSON) and one ignored event (an end for an unknown request), so the
        # error panels have series
        end = json.dumps({"type": "finish", "request_id": "nobody", "t": time.monotonic()})
        r = httpx.post(stack.api + "/v1/events", timeout=5, content=b"not json\n" + end.encode() + b"\n")
        assert r.status_code == 200 and r.json()["rejected"] == {"invalid_json": 1}
        # and one request a tap refuses (a path it does not relay)
        d0 = stack.tap_urls["d0"]
        assert httpx.get(d0 + "/not-relayed", timeout=5).status_code >= 400
        stack.taps.wait_for(lambda: stack.taps.svc.state.live() == 0 and not len(stack.taps.svc.queue))
        prom = Prometheus(tmp_path_factory.mktemp("prom"), [stack.api.removeprefix("http://")],
                          tap_targets=[tap_target])
        try:
            _wait(prom.ready, 60, "prometheus ready")
            # enough samples for rate() over the substituted window: the counter seen in 3 scrapes
            def three_scrapes() -> bool:
                res = prom.query("count_over_time(shadow_mirror_events_total[1m])")["data"]["result"]
                return bool(res) and min(float(x["value"][1]) for x in res) >= 3

            _wait(three_scrapes, 60, "three scrapes")
            # traffic inside the rate window, and a step model fitted from it
            until_step_model(stack)
            _wait(lambda: prom.query("shadow_step_model_r2")["data"]["result"], 60, "a scraped step model")
            # an engine probe's steps (the simulated fleet has none), for the step-cost families
            post_probe_steps(stack)
            _wait(lambda: prom.query("shadow_step_cost_r2")["data"]["result"], 60, "a scraped step-cost fit")
            yield prom, stack
        finally:
            prom.close()


def test_prometheus_scrapes_the_shipped_job_with_the_fleet_label(scraped: tuple[Prometheus, Stack]) -> None:
    prom, _ = scraped
    res = prom.query('up{job="shadow"}')["data"]["result"]
    assert res and res[0]["value"][1] == "1" and res[0]["metric"]["fleet"] == "default"
    # and the data plane's own job (ShadowTapDown pages on its absence)
    _wait(lambda: prom.query('up{job="shadow-tap"} == 1')["data"]["result"], 30, "the data plane scraped")


def test_rules_loaded_and_healthy(scraped: tuple[Prometheus, Stack]) -> None:
    prom, _ = scraped
    groups = httpx.get(prom.url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
    names = {r["name"] for g in groups for r in g["rules"]}
    expected = {r["alert"] for path in (ROOT / "alerts" / "rules").glob("*.yaml")
                for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]}
    assert names == expected
    _wait(lambda: all(r.get("lastEvaluation", "").startswith("2") and r["health"] == "ok"
                      for g in httpx.get(prom.url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
                      for r in g["rules"]), 30, "every rule evaluated healthy")


@pytest.mark.parametrize(("where", "expr"), _expressions())
def test_expression_parses_and_returns_data(scraped: tuple[Prometheus, Stack], where: str, expr: str) -> None:
    prom, _ = scraped
    text = substitute(expr, VARS).replace("[1m]", f"[{RATE}]")
    body = prom.query(text)
    assert body["status"] == "success", f"{where}: {body.get('error')}"
    names = metric_names(substitute(expr, VARS))
    assert all(CATALOGUE.lookup(n) is not None or n == "up" for n in names), where
    if any((spec := CATALOGUE.lookup(n)) is not None and spec.name in CATALOGUE.active_only() for n in names):
        # active-routing metrics: a shadow-only `shadow serve` does not export them, so here the
        # expression only has to parse and run; tests/alerts/test_alertmanager_integration.py runs
        # it against `shadow serve --active` and requires data
        return
    exported = {n for n in names if prom.query(f"count({n})")["data"]["result"]}
    if where.startswith("rule "):
        # an alert condition is empty when all is well: each metric it reads must have data
        missing = {n for n in names if n != "up"} - exported
        assert not missing, f"{where}: no data for {sorted(missing)}"
    else:
        assert body["data"]["result"], f"{where}: no data for {text}"
