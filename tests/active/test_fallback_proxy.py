"""Fallback triggers through the real active proxy (issue 10 acceptance 3): `shadow fleet` and
`shadow serve --active` processes, traffic from the official `openai` client while a fault is
injected. Each moves routing to round-robin within its bound — stated in what the controller saw
(decision rounds, upstream calls, scrapes) — is counted with its reason, and requests sent after
the trip are routed (and counted) as `fallback`; recovery waits for the hold-down.

- decisions made slow: a decision budget no round can meet; the 5th slow round trips
  `decision_slow` (exactly: `observed.slow_decisions == 5` at the trip), the next requests are
  round-robin, and after the hold-down the policy is tried again and trips again with the
  hold-down doubled;
- a prefiller failing (HTTP 500 from the fleet's fault API, the only prefill server): `upstream_errors`
  once ≥ 10 calls to it in the window failed at ≥ 50% (the failed call that makes it so); recovery
  after the fault is cleared, the window has no failures and the hold-down passed;
- a decode rank killed (fleet fault API): `worker_down` within 3 scrapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.active.procs import shadow_process
from tests.active.test_fallback_e2e import at, last, metric, mode, scrapes, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HOLD = 1.0


def requests_by_mode(api: str, m: str) -> float:
    total = 0.0
    for line in httpx.get(api + "/metrics", timeout=5).text.splitlines():
        if line.startswith("shadow_router_requests_total{") and f'mode="{m}"' in line:
            assert m != "fallback" or 'policy="rr"' in line, line  # fallback routes round-robin
            total += float(line.rsplit(" ", 1)[1])
    return total


class Traffic:
    """A closed loop of `streams` concurrent openai streams on a background thread until stopped;
    counts completions and failed requests (a killed rank cuts the streams it holds)."""

    def __init__(self, url: str, streams: int = 8) -> None:
        self.url = url
        self.streams = streams
        self.done = 0
        self.failed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def loop(i: int) -> None:
            while not self.stop.is_set():
                try:
                    s = await client.completions.create(model="sim-llm", prompt="w " * (20 + i), max_tokens=8,
                                                        stream=True, extra_body={"ignore_eos": True})
                    n = len([1 async for ch in s if ch.choices and ch.choices[0].text])
                    self.done += n == 8
                    self.failed += n != 8
                except openai.OpenAIError:
                    self.failed += 1

        await asyncio.gather(*(loop(i) for i in range(self.streams)))
        await client.close()

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


@contextmanager
def active_serve(extra: list[str], prefill: int = 2) -> Iterator[tuple[dict[str, Any], str, str]]:
    fleet_args = ["fleet", "--prefill", str(prefill), "--decode", "2", "--slots", "8", "--port", "0",
                  "--time-scale", "0.2"]
    with shadow_process(fleet_args) as (_, fleet):
        args = ["serve", "--active", "--active-policy", "br0", "--slots", "8", "--scrape-interval", "0.2",
                "--mode-check-interval", "0.05", "--holddown", str(HOLD), "--holddown-max", "8", *extra]
        for i, u in enumerate(fleet["decode"]):
            args += ["--upstream", f"d{i}={u}"]
        for i, u in enumerate(fleet["prefill"]):
            args += ["--prefill", f"p{i}={u}"]
        with shadow_process(args) as (_, ready):
            api = ready["api"]
            wait_for(lambda: mode(api)["current"] == "active" and scrapes(api) >= 2, "active, scraped")
            yield fleet, api, ready["active"]


def test_slow_decisions_trip_on_the_nth_round_and_recovery_doubles_the_hold_down() -> None:
    # Every assertion reads one /v1/mode snapshot (or a counter read between two snapshots that
    # agree): the fallback lasts only ~the 2 s trip window, so under CPU load separate reads taken
    # at wall-clock moments the test does not control can straddle the recovery and the next trip.
    with active_serve(["--decision-budget", "1e-9", "--trip-slow-count", "5", "--trip-window", "2"]) as (
            _, api, proxy), Traffic(proxy) as traffic:
        first = wait_for(lambda: slow_trips(mode(api)), "fallback on slow decisions")
        trip = first[0]
        assert trip["to"] == "fallback" and trip["observed"]["slow_decisions"] == 5, trip
        assert trip["holddown_s"] == HOLD, trip
        before = requests_by_mode(api, "fallback")
        wait_for(lambda: requests_by_mode(api, "fallback") >= before + 8, "requests routed in fallback")
        # the exported counter counts trips, not slow rounds: it equals the controller's count
        count, exported = wait_for(lambda: steady_trips(api), "a trip count read between two equal snapshots")
        assert exported == count >= 1
        # after the hold-down the policy is tried again: its decisions are still slow, so it trips
        # again at once, and the hold-down doubles
        snap = wait_for(lambda: (s := mode(api))["trips"].get("decision_slow", 0) >= 2 and s, "trip 2")
        moves = [t for t in snap["transitions"] if "to" in t]
        i = next(k for k, t in enumerate(moves) if t["reason"] == "decision_slow")
        trip, back, trip2 = moves[i:i + 3]
        assert (back["reason"], back["to"]) == ("recovered", "active"), moves  # one trip per spell
        assert (trip2["reason"], trip2["to"]) == ("decision_slow", "fallback"), moves
        assert at(back) - at(trip) >= HOLD - 0.002
        assert trip2["holddown_s"] == 2 * HOLD, trip2
        assert snap["trips"]["decision_slow"] == len(slow_trips(snap))
        assert traffic.failed == 0  # nobody noticed


def slow_trips(snap: dict[str, Any]) -> list[dict[str, Any]]:
    """The decision_slow trips in one /v1/mode snapshot's history, oldest first."""
    return [t for t in snap["transitions"]
            if t.get("reason") == "decision_slow" and t.get("to") == "fallback"]


def steady_trips(api: str) -> tuple[int, float] | None:
    """(controller's decision_slow trips, the exported counter) when no trip fell between the reads."""
    a = mode(api)["trips"].get("decision_slow", 0)
    exported = metric(api, 'shadow_fallback_trips_total{reason="decision_slow"}')
    return (a, exported) if mode(api)["trips"].get("decision_slow", 0) == a else None


def test_a_failing_prefiller_trips_upstream_errors_and_recovers_when_it_is_fixed() -> None:
    # one prefill server: with two, the proxy routes around a failing one after its first failed
    # call (retried on the other before any byte reached the client), and nothing needs to trip
    with active_serve(["--trip-window", "2"], prefill=1) as (fleet, api, proxy), Traffic(proxy) as traffic:
        wait_for(lambda: traffic.done >= 16, "traffic flowing")
        fault = fleet["prefill"][0] + "/fleet/faults"
        failures_before = mode(api)["observed"]["upstream_failures"]
        httpx.post(fault, json={"http_status": 500}, timeout=5).raise_for_status()
        try:
            wait_for(lambda: mode(api)["current"] == "fallback", "fallback on a failing prefiller")
            trip = last(api, "upstream_errors")
            assert trip is not None and "p0" in trip["detail"], trip
            # never before the rule holds: ≥ 10 calls in the window, at least half of them failed
            assert trip["observed"]["upstream_failures"] - failures_before >= 5, trip
            assert metric(api, 'shadow_fallback_trips_total{reason="upstream_errors"}') == 1.0
            assert mode(api)["holddown_s"] == HOLD
        finally:
            httpx.post(fault, json={"clear": True}, timeout=5).raise_for_status()
        back = wait_for(lambda: mode(api)["current"] == "active" and last(api, "recovered"), "recovery")
        assert at(back) - at(trip) >= HOLD - 0.002


def test_a_killed_decode_rank_under_traffic_trips_worker_down_within_three_scrapes() -> None:
    isolate = ["--trip-upstream-min-calls", "100000"]  # the cut streams' failures must not trip first
    with active_serve(isolate) as (fleet, api, proxy), Traffic(proxy) as traffic:
        wait_for(lambda: traffic.done >= 16, "traffic flowing")
        d0 = fleet["decode"][0]
        crash = {"target": "decode/1", "crash_s": -1}
        httpx.post(d0 + "/fleet/faults", json=crash, timeout=5).raise_for_status()
        s0 = scrapes(api)
        wait_for(lambda: mode(api)["current"] == "fallback", "fallback on a killed rank")
        trip = last(api, "worker_down")
        assert trip is not None and trip["scrapes"] <= s0 + 3, (trip, s0)
        assert metric(api, 'shadow_fallback_trips_total{reason="worker_down"}') == 1.0
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(d0 + "/fleet/faults", json={"target": "decode/1", "recover": True}, timeout=5)
        back = wait_for(lambda: mode(api)["current"] == "active" and last(api, "recovered"), "recovery")
        assert at(back) - at(trip) >= HOLD - 0.002
