"""Alerts end to end: a real Prometheus (shipped scrape config and rules, every `for:` shortened to
1s for the test) and a real Alertmanager (shipped routing, webhooks pointed at a receiver in the
test) watch a running stack (simulated fleet + `shadow serve`).

- Traffic that bypasses the taps makes the mirrored state drift from a worker's own count: the
  ShadowStateDrift alert for that worker arrives at the webhook (and not before).
- Killing a decode rank under load: its streams break and the mirror ends them, but its /metrics
  refuses connections while the mirror still counts its slots, so ShadowStateDrift for that rank
  arrives (drift = its 8 slots), then ShadowWorkerTelemetryStale (30 s without a good scrape).
- The mode controller (`shadow serve` with an admin token, behind the `shadow router` stand-in):
  an operator forcing fallback through the admin API (PUT /v1/mode with the token) makes
  ShadowFallbackActive arrive, and setting the mode back resolves it.
- With active routing (`shadow serve --active` in canary mode): forced fallback routes requests in
  mode fallback, a crashed decode rank trips automatic fallback, and every dashboard and rule
  expression that reads an active-routing metric parses and returns data.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from shadow.app.catalogue import catalogue
from shadow.telemetry.manifests import DEFAULT_RUNBOOK_BASE as RUNBOOKS
from tests.telemetry.active_stack import active_stack, require_active
from tests.telemetry.promql import metric_names, substitute
from tests.telemetry.servers import Alertmanager, Prometheus, Webhook, wait_for
from tests.telemetry.stack import running_stack, send_traffic

CATALOGUE = catalogue()

pytestmark = pytest.mark.integration


class Bypass:
    """Long streams sent straight to a worker, around its tap; closed on stop()."""

    def __init__(self, url: str, n: int) -> None:
        self.stop_event = threading.Event()
        self.started = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._run, args=(url,), daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url: str) -> None:
        body = {"model": "sim-llm", "prompt": "x " * 64, "stream": True, "max_tokens": 3000,
                "ignore_eos": True}
        with httpx.Client(timeout=30) as client, \
                client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            first = True
            for _ in r.iter_lines():
                if first:
                    self.started.release()
                    first = False
                if self.stop_event.is_set():
                    return

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(30)


def test_drift_and_dead_rank_alerts_reach_the_webhook(tmp_path: Path) -> None:
    hook = Webhook()
    (tmp_path / "am").mkdir()
    (tmp_path / "prom").mkdir()
    am = Alertmanager(tmp_path / "am", hook.url)
    try:
        wait_for(am.ready, 60, "alertmanager ready")
        with running_stack(time_scale=1.0, serve=True) as stack:
            send_traffic(list(stack.tap_urls.values()), per_url=2)
            stack.taps.wait_for(lambda: stack.taps.svc.state.live() == 0 and not len(stack.taps.svc.queue))
            prom = Prometheus(tmp_path / "prom", [stack.api.removeprefix("http://")],
                              alertmanager=am.address, rule_for="1s")
            try:
                wait_for(prom.ready, 60, "prometheus ready")
                # healthy first: drift is scraped and evaluated, and nothing fires
                def scraped_thrice() -> bool:
                    q = 'count_over_time(shadow_mirror_drift_requests{worker="d0"}[1m])'
                    res = prom.query(q)["data"]["result"]
                    return bool(res) and float(res[0]["value"][1]) >= 3

                wait_for(scraped_thrice, 60, "three scrapes of drift")
                assert prom.query('ALERTS{alertname="ShadowStateDrift"}')["data"]["result"] == []
                assert hook.firing("ShadowStateDrift") == []

                bypass = Bypass(stack.fleet.decode_urls[0], 4)
                try:
                    for _ in range(4):
                        assert bypass.started.acquire(timeout=30)
                    alerts = wait_for(lambda: hook.firing("ShadowStateDrift"), 60,
                                      "ShadowStateDrift at the webhook")
                finally:
                    bypass.stop()
                assert {a["labels"]["worker"] for a in alerts} == {"d0"}
                (alert,) = alerts[:1]
                assert alert["labels"]["severity"] == "warning" and alert["labels"]["fleet"] == "default"
                assert alert["annotations"]["runbook_url"] == RUNBOOKS + "/state-drift.md"

                # a decode rank is killed under load: its streams break, the mirror ends them, and its
                # scrapes are refused while the mirror still counts its 8 slots: drift on d1
                load = [Traffic(stack.tap_urls[w], 2) for w in ("d0", "d1")]
                try:
                    wait_for(lambda: stack.taps.sync(lambda: stack.taps.svc.state.active("d1")) > 0, 30,
                             "requests running on d1")
                    stack.fleet.call(stack.fleet.fleet.crash("decode", 1))
                    dead = wait_for(lambda: [a for a in hook.firing("ShadowStateDrift")
                                             if a["labels"]["worker"] == "d1"], 90,
                                    "ShadowStateDrift for the killed d1 at the webhook")
                finally:
                    for t in load:
                        t.stop()
                assert dead[0]["annotations"]["runbook_url"] == RUNBOOKS + "/state-drift.md"
                assert " is 8 on d1 " in dead[0]["annotations"]["description"], dead[0]["annotations"]
                stale = wait_for(lambda: [a for a in hook.firing("ShadowWorkerTelemetryStale")
                                          if a["labels"]["worker"] == "d1"], 120,
                                 "ShadowWorkerTelemetryStale for d1 at the webhook")
                assert stale[0]["annotations"]["runbook_url"] == RUNBOOKS + "/worker-telemetry-stale.md"
                assert all(a["labels"]["worker"] == "d1" for a in hook.firing("ShadowWorkerTelemetryStale"))
            finally:
                prom.close()
    finally:
        am.close()
        hook.close()


#: Families with no sample in this layout, each for its reason (the canary's p-values are the figures
#: of its verdicts, which tests/active/test_canary_analysis.py reads in /v1/report).
NO_DATA_HERE = {
    "shadow_canary_p_value": "exported after a canary step's analysis; this stack's canary has no steps",
}


def _active_expressions() -> list[tuple[str, str]]:
    """(where, expr) of every dashboard target and alert rule that reads an active-routing metric."""
    from tests.telemetry.test_prometheus_integration import _expressions

    out = []
    for where, expr in _expressions():
        names = {spec.name for n in metric_names(substitute(expr, {"fleet": ".*", "instance": ".*",
                                                                  "lane": ".*"}))
                 if (spec := CATALOGUE.lookup(n)) is not None}
        if names & CATALOGUE.active_only():
            out.append((where, expr))
    return out


class Traffic:
    """Streams sent to the front, one after another per thread, until stop()."""

    def __init__(self, url: str, n: int, max_tokens: int = 40) -> None:
        self.stop_event = threading.Event()
        self.done = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(url, i, max_tokens), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, i: int, max_tokens: int) -> None:
        # prompts of two length buckets, so the Fairness panels have more than one bucket
        prompt = "x " * (64 if i % 2 else 700)
        with httpx.Client(timeout=30) as client:
            while not self.stop_event.is_set():
                body = {"model": "sim-llm", "prompt": prompt, "stream": True, "max_tokens": max_tokens}
                try:
                    with client.stream("POST", url + "/v1/completions", json=body) as r:
                        for _ in r.iter_lines():
                            pass
                except httpx.HTTPError:
                    pass  # a crashed rank fails some streams: that is what the error panels show
                with self.lock:
                    self.done += 1

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(60)


def test_operator_forced_fallback_alert_reaches_the_webhook_and_resolves(tmp_path: Path) -> None:
    require_active()
    hook = Webhook()
    for d in ("am", "prom", "stack"):
        (tmp_path / d).mkdir()
    am = Alertmanager(tmp_path / "am", hook.url)
    try:
        wait_for(am.ready, 60, "alertmanager ready")
        with active_stack(tmp_path / "stack", mode="shadow") as stack:  # (fallback needs the proxy)
            prom = Prometheus(tmp_path / "prom", [stack.api.removeprefix("http://")],
                              alertmanager=am.address, rule_for="1s", keep_firing_for="5s")
            try:
                wait_for(prom.ready, 60, "prometheus ready")
                wait_for(lambda: prom.query('count_over_time(shadow_mode{mode="shadow"}[1m]) >= 3')
                         ["data"]["result"], 60, "three scrapes of the mode")
                assert prom.query('ALERTS{alertname="ShadowFallbackActive"}')["data"]["result"] == []
                assert hook.firing("ShadowFallbackActive") == []
                # without the token nobody can force it
                unauth = httpx.put(stack.api + "/v1/mode", json={"mode": "fallback"}, timeout=10)
                assert unauth.status_code == 401
                assert stack.set_mode("fallback").status_code == 200
                alerts = wait_for(lambda: hook.firing("ShadowFallbackActive"), 60,
                                  "ShadowFallbackActive at the webhook")
                (alert,) = alerts[:1]
                assert alert["labels"]["severity"] == "critical" and alert["labels"]["fleet"] == "default"
                assert alert["labels"]["instance"] == stack.api.removeprefix("http://")
                assert alert["annotations"]["runbook_url"] == RUNBOOKS + "/fallback-active.md"
                assert httpx.get(stack.api + "/v1/mode", timeout=10).json()["current"] == "fallback"
                # back to shadow: the alert resolves after keep_firing_for (2m shipped, 5s here)
                assert stack.set_mode("shadow").status_code == 200
                wait_for(lambda: [a for body in hook.received for a in body["alerts"]
                                  if a["labels"]["alertname"] == "ShadowFallbackActive"
                                  and a["status"] == "resolved"], 90, "ShadowFallbackActive resolved")
            finally:
                prom.close()
    finally:
        am.close()
        hook.close()


def test_active_fallback_trips_and_active_expressions_return_data(tmp_path: Path) -> None:
    require_active()
    hook = Webhook()
    for d in ("am", "prom", "stack"):
        (tmp_path / d).mkdir()
    am = Alertmanager(tmp_path / "am", hook.url)
    try:
        wait_for(am.ready, 60, "alertmanager ready")
        with active_stack(tmp_path / "stack", policy="br0") as stack:
            prom = Prometheus(tmp_path / "prom", [stack.api.removeprefix("http://")],
                              alertmanager=am.address, rule_for="1s")
            traffic = Traffic(stack.front, 6)
            try:
                wait_for(prom.ready, 60, "prometheus ready")
                # routed both ways (canary), and nothing about fallback fires while healthy
                for mode in ("active", "shadow"):
                    wait_for(lambda m=mode: prom.query(
                        f'sum(rate(shadow_router_requests_total{{mode="{m}",outcome="ok"}}[30s])) > 0'
                    )["data"]["result"], 90, f"ok requests in mode {mode} scraped")
                assert hook.firing("ShadowFallbackActive") == []
                assert prom.query('ALERTS{alertname="ShadowFallbackActive"}')["data"]["result"] == []

                # an operator forces fallback: the alert arrives, with its runbook
                bad = stack.set_mode("fallback")
                assert bad.status_code == 200, bad.text
                alerts = wait_for(lambda: hook.firing("ShadowFallbackActive"), 60,
                                  "ShadowFallbackActive at the webhook")
                assert alerts[0]["labels"]["severity"] == "critical"
                assert alerts[0]["annotations"]["runbook_url"] == RUNBOOKS + "/fallback-active.md"
                assert alerts[0]["labels"]["instance"] == stack.api.removeprefix("http://")
                wait_for(lambda: prom.query(
                    'sum(rate(shadow_router_requests_total{mode="fallback"}[30s])) > 0')["data"]["result"],
                    60, "requests routed in fallback")
                unauth = httpx.put(stack.api + "/v1/mode", json={"mode": "active"}, timeout=10)
                assert unauth.status_code == 401  # and without the token nobody can undo it
                assert stack.set_mode("canary").status_code == 200

                # a decode rank crashes under traffic: upstream errors, and automatic fallback trips
                stack.fleet.call(stack.fleet.fleet.crash("decode", 1))
                wait_for(lambda: prom.query("shadow_fallback_active == 1")["data"]["result"], 90,
                         "automatic fallback after the crash")
                trips = prom.query("sum by (reason) (shadow_fallback_trips_total)")["data"]["result"]
                assert trips and all(float(t["value"][1]) >= 1 for t in trips), trips
                # (increase over 2 minutes: the trip can take longer than 30 s to see on a loaded host)
                wait_for(lambda: prom.query("sum(increase(shadow_router_upstream_errors_total[2m])) > 0")
                         ["data"]["result"], 60, "upstream errors scraped")

                # every expression reading an active-routing metric parses and returns data
                missing = []
                for where, expr in _active_expressions():
                    text = substitute(expr, {"fleet": ".*", "instance": ".*", "lane": ".*"})
                    text = text.replace("[1m]", "[30s]")
                    body = prom.query(text)
                    assert body["status"] == "success", f"{where}: {body.get('error')}"
                    if where.startswith("rule "):
                        # an alert condition is empty when all is well: each metric it reads has data
                        names = metric_names(text)
                        gone = {n for n in names if not prom.query(f"count({n})")["data"]["result"]}
                        if gone:
                            missing.append(f"{where}: no data for {sorted(gone)}")
                    elif not body["data"]["result"] and not set(metric_names(text)) <= set(NO_DATA_HERE):
                        missing.append(f"{where}: no data for {text}")
                assert missing == [], "\n".join(missing)
            finally:
                traffic.stop()
                prom.close()
    finally:
        am.close()
        hook.close()


def test_no_alert_is_pending_or_firing_under_normal_traffic_in_the_shipped_active_layout(
    tmp_path: Path,
) -> None:
    """`shadow serve --active` in canary beside the router (the shipped active layout), a real
    Prometheus with the shipped rules and `for:` durations, steady traffic below capacity: no alert
    fires, and no alert about the layout (caps, drops, drift, phantoms, staleness, fallback, a
    missing target) is even pending in any of 30 looks while requests run both ways.
    ShadowCapsBiting was true here on every request passed to the router. The alerts on measured
    quality — the twin's fidelity and the step model's fit (they need minutes of traffic), and the
    decision p99 against its 20 ms budget (a 2-core machine at load 10+ misses it) — may be pending
    in so short a run, never firing."""
    require_active()
    for d in ("prom", "stack"):
        (tmp_path / d).mkdir()
    with active_stack(tmp_path / "stack", policy="br0") as stack:
        prom = Prometheus(tmp_path / "prom", [stack.api.removeprefix("http://")])
        traffic = Traffic(stack.front, 3)
        try:
            wait_for(prom.ready, 60, "prometheus ready")
            for mode in ("active", "shadow"):
                wait_for(lambda m=mode: prom.query(
                    f'sum(rate(shadow_router_requests_total{{mode="{m}",outcome="ok"}}[30s])) > 0'
                )["data"]["result"], 90, f"ok requests in mode {mode} scraped")
            # the mirror saw the requests passed to the router (the series CapsBiting read)
            wait_for(lambda: prom.query('shadow_mirror_dropped_total{reason="no_routing_decision"} > 0')
                     ["data"]["result"], 60, "front-tap requests without a routing decision scraped")
            seen: dict[str, set[str]] = {}
            evaluated = 0

            def quiet_for_a_while() -> bool:
                nonlocal evaluated
                for a in prom.query("ALERTS")["data"]["result"]:
                    seen.setdefault(a["metric"]["alertname"], set()).add(a["metric"]["alertstate"])
                evaluated += 1
                return evaluated >= 30

            wait_for(quiet_for_a_while, 120, "30 looks at ALERTS", step=0.5)
            done = traffic.done
            # the Fairness comparison has both sides: TPOT and completion of the router's requests too
            for fam in ("shadow_router_tpot_seconds_count", "shadow_router_completion_seconds_count"):
                got = {r["metric"]["mode"] for r in prom.query(f"{fam} > 0")["data"]["result"]}
                assert {"shadow", "active"} <= got, (fam, got)
            # placements per decode worker, and each worker up
            placed = {r["metric"]["worker"] for r in prom.query("shadow_router_placements_total > 0")
                      ["data"]["result"]}
            up = {r["metric"]["worker"]: r["value"][1] for r in prom.query("shadow_router_worker_up")
                  ["data"]["result"]}
            assert placed == {"d0", "d1"} and up == {"d0": "1", "d1": "1"}, (placed, up)
        finally:
            traffic.stop()
            prom.close()
    assert done > 20, done
    firing = {name for name, states in seen.items() if "firing" in states}
    assert firing == set(), f"alerts firing under normal traffic: {seen}"
    measured = {"ShadowTwinFidelityPoor", "ShadowStepModelPoorFit", "ShadowDecisionsSlow"}
    assert set(seen) <= measured, f"alerts pending under normal traffic: {seen}"
