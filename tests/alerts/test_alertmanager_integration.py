"""Alerts end to end: a real Prometheus (shipped scrape config and rules, every `for:` shortened to
1s for the test) and a real Alertmanager (shipped routing, webhooks pointed at a receiver in the
test) watch a running stack (simulated fleet + `shadow serve`).

- Traffic that bypasses the taps makes the mirrored state drift from a worker's own count: the
  ShadowStateDrift alert for that worker arrives at the webhook (and not before).
- Killing a decode rank stops its /metrics: ShadowWorkerTelemetryStale for that rank arrives (the
  rule's threshold is 30 s without a good scrape, so this waits about half a minute).
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from tests.telemetry.servers import Alertmanager, Prometheus, Webhook, wait_for
from tests.telemetry.stack import running_stack, send_traffic

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
                assert alert["labels"]["severity"] == "ticket" and alert["labels"]["fleet"] == "default"
                assert alert["annotations"]["runbook_url"] == "docs/runbooks/state-drift.md"

                stack.fleet.call(stack.fleet.fleet.crash("decode", 1))
                stale = wait_for(lambda: [a for a in hook.firing("ShadowWorkerTelemetryStale")
                                          if a["labels"]["worker"] == "d1"], 120,
                                 "ShadowWorkerTelemetryStale for d1 at the webhook")
                assert stale[0]["annotations"]["runbook_url"] == "docs/runbooks/worker-telemetry-stale.md"
                assert all(a["labels"]["worker"] == "d1" for a in hook.firing("ShadowWorkerTelemetryStale"))
            finally:
                prom.close()
    finally:
        am.close()
        hook.close()
