"""A real Prometheus (Debian package) loads the shipped scrape config (targets templated to loopback)
and the shipped alert rules, scrapes a running stack (simulated fleet + taps), and evaluates every
PromQL expression of every dashboard and alert rule: each parses, and each whose metrics the running
exporters provide returns data.

Live-lane metrics (`shadow serve`, exporter `serve` in the catalogue) are exported once `shadow
serve` exists; until then expressions that need them are checked for parsing by Prometheus only,
and the test lists them (it fails if a serve metric is exported and its expression returns nothing).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from shadow.telemetry.catalogue import lookup
from tests.telemetry.promql import metric_names, substitute
from tests.telemetry.stack import Stack, running_stack, send_traffic

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VARS = {"fleet": ".*", "instance": ".*", "lane": ".*"}
RATE = "30s"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Prometheus:
    """Debian's prometheus on loopback with the shipped config, templated to the given targets."""

    def __init__(self, tmp: Path, targets: list[str], interval: str = "1s") -> None:
        exe = shutil.which("prometheus")
        if exe is None:
            pytest.fail("prometheus is not installed (apt-get install -y prometheus; scripts/test.sh does)")
        conf = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
        rules = tmp / "rules"
        rules.mkdir()
        for p in (ROOT / "alerts" / "rules").glob("*.yaml"):
            shutil.copy(p, rules / p.name)
        conf["global"].update(scrape_interval=interval, evaluation_interval=interval)
        conf["rule_files"] = [str(rules / "*.yaml")]
        conf.pop("alerting", None)
        (job,) = [j for j in conf["scrape_configs"] if j["job_name"] == "shadow"]
        job["static_configs"][0]["targets"] = targets
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(conf))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (tmp / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}")
        try:
            return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> dict[str, Any]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body: dict[str, Any] = r.json()
        return body

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


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
    with running_stack() as stack:
        send_traffic(list(stack.tap_urls.values()))
        # one rejected line (bad JSON) and one ignored event (an end for an unknown request), so the
        # error panels have series
        r = httpx.post(stack.api + "/v1/events", timeout=5,
                       content=b'not json\n{"type": "finish", "request_id": "nobody", "t": 1.0}\n')
        assert r.status_code == 200 and r.json()["rejected"] == {"invalid_json": 1}
        stack.taps.wait_for(lambda: stack.taps.svc.state.live() == 0 and not len(stack.taps.svc.queue))
        prom = Prometheus(tmp_path_factory.mktemp("prom"), [stack.api.removeprefix("http://")])
        try:
            _wait(prom.ready, 60, "prometheus ready")
            # enough samples for rate() over the substituted window: the counter seen in 3 scrapes
            def three_scrapes() -> bool:
                res = prom.query("count_over_time(shadow_mirror_events_total[1m])")["data"]["result"]
                return bool(res) and min(float(x["value"][1]) for x in res) >= 3

            _wait(three_scrapes, 60, "three scrapes")
            # keep traffic in the window so rates are positive
            send_traffic(list(stack.tap_urls.values()), per_url=1)
            yield prom, stack
        finally:
            prom.close()


def test_prometheus_scrapes_the_shipped_job_with_the_fleet_label(scraped: tuple[Prometheus, Stack]) -> None:
    prom, _ = scraped
    res = prom.query('up{job="shadow"}')["data"]["result"]
    assert res and res[0]["value"][1] == "1" and res[0]["metric"]["fleet"] == "default"


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
    needs_serve = {n for n in names if (s := lookup(n)) is not None and s.exporter == "serve"}
    exported = {n for n in names if prom.query(f"count({n})")["data"]["result"]}
    if needs_serve - exported:
        pytest.skip(f"needs live-lane metrics from `shadow serve` not exported by this stack: "
                    f"{sorted(needs_serve - exported)}")
    if where.startswith("rule "):
        # an alert condition is empty when all is well: each metric it reads must have data
        missing = {n for n in names if n != "up"} - exported
        assert not missing, f"{where}: no data for {sorted(missing)}"
    else:
        assert body["data"]["result"], f"{where}: no data for {text}"
