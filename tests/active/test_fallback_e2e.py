"""Fallback triggers injected end to end: a real `shadow fleet` and a real `shadow serve` in mode
`active`; each trigger moves the mode to fallback (round-robin) within its bound, counted with its
reason on /metrics, and recovery waits for the hold-down (which doubles on a repeated trip).

Bounds are stated in the sidecar's own reconciliation rounds (`scrapes`), not in wall time: a rank
killed or a drift injected is seen by the first scrape that starts after it, so the trip is
recorded at most 3 scrapes after the injection (one in flight, one failing, one of slack for the
health check's own period).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import httpx
import pytest

from shadow.contracts.events import Arrive, Finish, Route, to_dict
from tests.active.procs import shadow_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HOLD = 1.0
SERVE_FLAGS = ["--slots", "8", "--scrape-interval", "0.2", "--active", "--mode", "active",
               "--mode-check-interval", "0.05", "--holddown", str(HOLD), "--holddown-max", "8",
               "--trip-drift", "4", "--trip-stale", "1.0"]


def wait_for(pred: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll a condition (no fixed sleeps); fail naming it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def mode(api: str) -> dict[str, Any]:
    return httpx.get(api + "/v1/mode", timeout=5).json()  # type: ignore[no-any-return]


def scrapes(api: str) -> int:
    return int(httpx.get(api + "/v1/state", timeout=5).json()["watermark"]["scrapes"])


def at(entry: dict[str, Any]) -> float:
    return datetime.fromisoformat(entry["at"].replace("Z", "+00:00")).timestamp()


def metric(api: str, line_prefix: str) -> float:
    for line in httpx.get(api + "/metrics", timeout=5).text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def last(api: str, reason: str) -> dict[str, Any] | None:
    hist = [t for t in mode(api)["transitions"] if t.get("reason") == reason]
    return hist[-1] if hist else None


@contextmanager
def fleet_and_serve(extra: list[str] | None = None,
                    metrics_of: Callable[[list[str]], dict[str, str]] | None = None
                    ) -> Iterator[tuple[list[str], str]]:
    with shadow_process(["fleet", "--decode", "2", "--slots", "8", "--port", "0"]) as (_, fleet):
        decode = fleet["decode"]
        args = ["serve", *SERVE_FLAGS, *(extra or [])]
        for i, u in enumerate(decode):
            args += ["--upstream", f"d{i}={u}"]
        for name, url in (metrics_of(decode) if metrics_of else {}).items():
            args += ["--metrics-of", f"{name}={url}"]
        with shadow_process(args) as (_, ready):
            api = ready["api"]
            wait_for(lambda: mode(api)["current"] == "active" and scrapes(api) >= 2, "first scrapes, active")
            yield decode, api


def recover_and_check_holddown(api: str, reason: str, hold: float) -> None:
    tripped = last(api, reason)
    assert tripped is not None
    back = wait_for(lambda: mode(api)["current"] == "active" and last(api, "recovered"), "recovery")
    assert back["from"] == "fallback" and back["to"] == "active"
    assert at(back) - at(tripped) >= hold - 0.002  # never before the hold-down (ms stamps)


def test_a_killed_decode_rank_trips_worker_down_and_recovery_honours_a_doubling_hold_down() -> None:
    with fleet_and_serve() as (decode, api):
        for round_, hold in enumerate((HOLD, 2 * HOLD), start=1):
            httpx.post(decode[0] + "/fleet/faults", json={"target": "decode/1", "crash_s": -1},
                       timeout=5).raise_for_status()
            s0 = scrapes(api)
            wait_for(lambda: mode(api)["current"] == "fallback", "fallback")
            m = mode(api)
            assert m["fallback_reason"] == "worker_down" and m["policy"] == "rr"
            assert "d1" in m["signals"]["unreachable"]
            trip = last(api, "worker_down")
            assert trip is not None and trip["scrapes"] <= s0 + 3, (trip, s0)
            assert m["holddown_s"] == hold
            assert metric(api, 'shadow_fallback_trips_total{reason="worker_down"}') == round_
            assert metric(api, "shadow_fallback_active") == 1.0
            # while the rank stays down, no recovery whatever the hold-down
            past = scrapes(api) + int(hold / 0.2) + 3
            wait_for(lambda past=past: scrapes(api) >= past, "scrapes past the hold-down")
            assert mode(api)["current"] == "fallback"
            httpx.post(decode[0] + "/fleet/faults", json={"target": "decode/1", "recover": True},
                       timeout=5).raise_for_status()
            recover_and_check_holddown(api, "worker_down", hold)
            assert metric(api, "shadow_fallback_active") == 0.0


def _events(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def test_injected_mirror_drift_trips_drift_and_recovers_when_it_is_gone() -> None:
    with fleet_and_serve() as (_, api):
        t = time.monotonic()
        ghosts = [f"ghost-{i}" for i in range(10)]  # mirrored as running on d0; the worker never saw them
        body = _events([to_dict(ev) for rid in ghosts
                        for ev in (Arrive(rid, t, 10, None, 50), Route(rid, t, "d0", 10))])
        r = httpx.post(api + "/v1/events", content=body, timeout=5)
        assert r.status_code == 200 and r.json()["accepted"] == 20, r.text
        s0 = scrapes(api)
        wait_for(lambda: mode(api)["current"] == "fallback", "fallback on drift")
        m = mode(api)
        assert m["fallback_reason"] == "drift" and m["signals"]["drift"]["d0"] >= 10
        trip = last(api, "drift")
        assert trip is not None and trip["scrapes"] <= s0 + 3
        assert metric(api, 'shadow_fallback_trips_total{reason="drift"}') == 1.0
        assert metric(api, 'shadow_mode_transitions_total{mode="fallback",reason="drift"}') == 1.0
        body = _events([to_dict(Finish(rid, time.monotonic(), "stop", 1)) for rid in ghosts])
        assert httpx.post(api + "/v1/events", content=body, timeout=5).status_code == 200
        recover_and_check_holddown(api, "drift", HOLD)


class _Metrics(http.server.BaseHTTPRequestHandler):
    """A worker's /metrics as an exporter that can start failing (HTTP 503): telemetry goes stale
    while the worker itself still answers."""

    upstream = ""
    failing = threading.Event()

    def do_GET(self) -> None:
        if self.failing.is_set():
            self.send_response(503)
            self.end_headers()
            return
        body = httpx.get(self.upstream, timeout=2).content
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return None


def test_stale_worker_telemetry_trips_telemetry_stale_never_before_its_age() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"

        def metrics_of(decode: list[str]) -> dict[str, str]:
            _Metrics.upstream = decode[1] + "/metrics"
            return {"d1": url}

        with fleet_and_serve(metrics_of=metrics_of) as (_, api):
            _Metrics.failing.set()
            wait_for(lambda: mode(api)["current"] == "fallback", "fallback on stale telemetry")
            m = mode(api)
            assert m["fallback_reason"] == "telemetry_stale"
            trip = last(api, "telemetry_stale")
            assert trip is not None and "d1" in trip["detail"]
            # tripped only once older than --trip-stale (the mode's signals are rounded to the ms: an
            # age of 1.0004 s, past the bound, reads 1.0; the strict bound is the guard's unit test's)
            assert m["signals"]["scrape_age_s"]["d1"] >= 1.0
            assert metric(api, 'shadow_fallback_trips_total{reason="telemetry_stale"}') == 1.0
            _Metrics.failing.clear()
            recover_and_check_holddown(api, "telemetry_stale", HOLD)
    finally:
        _Metrics.failing.clear()
        server.shutdown()
