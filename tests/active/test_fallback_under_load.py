"""Fallback triggers on a loaded host (issue 22): 4 CPU burners on for the whole test, `shadow serve
--active` in mode active beside its stack (a `shadow fleet` process, the `shadow router` stand-in)
with every trigger, the scrape interval and the mode-check interval at the defaults operators get,
healthy `openai` traffic below capacity. First ≥ 20 s and ≥ 4 scrapes of that traffic must not trip
anything (no false trip); then one real fault must trip with its reason within the bound the
defaults imply, the bound an operator is told:

- a decode rank killed (the fleet's crash fault: its port is gone) → `worker_down` once the first
  scrape that starts after the kill refuses: ≤ I + 2T + C (a round in flight finishes within T, the
  next starts I later and ends within T, the health check reads it within C);
- the fleet hung (SIGSTOP of the `shadow fleet` process: connections are still accepted by the
  kernel, nothing answers, every scrape times out) → `telemetry_stale` once the last good scrape is
  older than S: ≤ S + C after the hang, and never earlier than S − (I + T);
- requests the mirror never sees (sent straight to a decode rank, past shadow's proxy and taps) →
  `drift` once the worker runs more than D requests the mirror lacks: ≤ I + 2T + C after the
  worker has admitted them.

I: --scrape-interval, T: the scrape timeout, C: --mode-check-interval, S: --trip-stale, D:
--trip-drift, all read from the code (defaults 5 s, 2 s, 0.25 s, 15 s, 16). Each fault is
injected just after a scrape ends, so the next round is a whole interval away (near the worst phase
of every bound, the same phase in every run). The measured time may exceed a bound by SLACK_S:
shadow's scrape and check loops are asyncio sleeps on an event loop that also runs the proxy, and
with the host's cores taken by the burners a sleep ends late (tens to a few hundred ms); SLACK_S is
not scaled with the bounds.
"""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.commands.serve import resolve_args
from shadow.mirror.reconcile import Reconciler
from tests.active.burners import cpu_burners
from tests.active.test_fallback_e2e import at, mode, scrapes, wait_for
from tests.active.test_fallback_proxy import Traffic
from tests.telemetry.active_stack import ActiveStack, FleetProcess, active_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BURNERS = 4
SLOTS = 32  # per decode rank; STREAMS concurrent requests over 2 ranks is well below it
STREAMS = 8
HEALTHY_S = 20.0  # healthy traffic watched before the fault ...
HEALTHY_SCRAPES = 4  # ... spanning at least this many scrapes
SLACK_S = 1.0  # see the module docstring

DEFAULTS = resolve_args({}, {})  # what `shadow serve` runs with when no flag is given
I = float(DEFAULTS.scrape_interval)
T = float(inspect.signature(Reconciler).parameters["timeout_s"].default)  # serve passes none
C = float(DEFAULTS.mode_check_interval)
S = float(DEFAULTS.trip_stale)
D = float(DEFAULTS.trip_drift)


@dataclass
class Fault:
    """What a fault did: when it began (wall clock), when it was complete (the bound counts from
    here), and a detail for the messages."""

    began: float
    complete: float
    detail: str = ""


@contextmanager
def loaded_stack(tmp: Path) -> Iterator[tuple[ActiveStack, Traffic]]:
    """Burners, the stack at default triggers in mode active, and traffic through shadow's proxy."""
    # active_stack's test settings put back to the defaults (a later flag wins)
    defaults = ("--scrape-interval", str(I), "--oracle-interval", str(DEFAULTS.oracle_interval))
    with cpu_burners(BURNERS), active_stack(tmp, mode="active", slots=SLOTS, extra=defaults,
                                            processes_env={"OTEL_SDK_DISABLED": "true"}) as stack:
        assert isinstance(stack.fleet, FleetProcess) and stack.fleet.pid is not None
        api = stack.api
        wait_for(lambda: mode(api)["current"] == "active" and scrapes(api) >= 1, "active, scraped", 60)
        with Traffic(stack.front, streams=STREAMS) as traffic:
            wait_for(lambda: traffic.done >= 2 * STREAMS, "traffic flowing", 60)
            yield stack, traffic


def watch_healthy(api: str, traffic: Traffic) -> tuple[float, int]:
    """Watch for HEALTHY_S and HEALTHY_SCRAPES: the mode stays active with no trip and no failed
    request, and the scrapes run at the default interval (not faster); returns (seconds, scrapes)."""
    start, s0, done0 = time.monotonic(), scrapes(api), traffic.done
    while True:
        m = mode(api)
        assert m["current"] == "active" and not m["trips"], ("false trip under load", m["trips"],
                                                             m["transitions"])
        n = scrapes(api) - s0
        if (took := time.monotonic() - start) >= HEALTHY_S and n >= HEALTHY_SCRAPES:
            break
        time.sleep(0.5)
    assert n <= took / I + 1, (n, took)  # one scrape per I at most: the default is in force
    assert traffic.failed == 0 and traffic.done > done0, (traffic.done, traffic.failed)
    return took, n


def trip_of(api: str, reason: str) -> dict[str, Any]:
    """Wait for fallback and return its (first) trip; the reason must be `reason`."""
    m = wait_for(lambda: (x := mode(api))["current"] == "fallback" and x, "fallback", 120)
    trips = [t for t in m["transitions"] if t.get("to") == "fallback"]
    assert m["fallback_reason"] == reason and trips[0]["reason"] == reason, (reason, trips, m["signals"])
    assert len(trips) == 1 and m["trips"] == {reason: 1}, m["trips"]
    return {**trips[0], "signals": m["signals"]}


# -- the faults ---------------------------------------------------------------------------------


def kill_decode_rank(stack: ActiveStack) -> Fault:
    fleet = stack.fleet
    began = time.time()
    httpx.post(fleet.decode_urls[0] + "/fleet/faults", json={"target": "decode/1", "crash_s": -1},
               timeout=30).raise_for_status()
    return Fault(began, began, "decode/1 crashed (port closed)")


def hang_fleet(stack: ActiveStack) -> Fault:
    assert isinstance(stack.fleet, FleetProcess) and stack.fleet.pid is not None
    began = time.time()
    os.kill(stack.fleet.pid, signal.SIGSTOP)
    return Fault(began, began, f"shadow fleet pid {stack.fleet.pid} stopped")


class Bypass:
    """`n` long streaming requests sent straight to one decode rank (not through shadow's proxy or
    its taps), held open until closed; `admitted` has the wall time each got its response headers
    (the fleet sends them once the engine holds the request, running or waiting)."""

    def __init__(self, url: str, n: int) -> None:
        self.url = url
        self.stop = threading.Event()
        self.admitted: list[float] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._one, daemon=True) for _ in range(n)]

    def _one(self) -> None:
        body = {"model": "sim-llm", "prompt": "bypass " * 16, "max_tokens": 20000, "stream": True,
                "ignore_eos": True}
        try:
            with httpx.Client(timeout=httpx.Timeout(30, read=None)) as client, \
                    client.stream("POST", self.url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                with self.lock:
                    self.admitted.append(time.time())
                for _ in r.iter_bytes():
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as exc:
            with self.lock:
                self.errors.append(repr(exc))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


@pytest.mark.parametrize("fault", ["worker_down", "telemetry_stale", "drift"])
def test_under_cpu_burners_no_false_trip_then_a_real_fault_trips_within_its_bound(
        fault: str, tmp_path: Path) -> None:
    with loaded_stack(tmp_path) as (stack, traffic):
        api = stack.api
        healthy_s, healthy_scrapes = watch_healthy(api, traffic)
        load = os.getloadavg()[0]
        # the fault right after a scrape ends: the next round is a whole interval away (near the
        # worst phase for the bounds, and the same phase in every run)
        before = scrapes(api)
        s0 = wait_for(lambda: (x := scrapes(api)) > before and x, "a scrape ending")
        if fault == "worker_down":
            f = kill_decode_rank(stack)
            trip = trip_of(api, "worker_down")
            assert "d1" in trip["signals"]["unreachable"], trip
            with pytest.raises(httpx.ConnectError):  # the fault is real: nothing listens there
                httpx.get(stack.fleet.decode_urls[1] + "/metrics", timeout=5)
            bound = I + 2 * T + C
        elif fault == "telemetry_stale":
            assert isinstance(stack.fleet, FleetProcess) and stack.fleet.pid is not None
            try:
                f = hang_fleet(stack)
                trip = trip_of(api, "telemetry_stale")
            finally:
                os.kill(stack.fleet.pid, signal.SIGCONT)
            ages = trip["signals"]["scrape_age_s"]
            assert max(ages.values()) > S, ages  # never before the age the flag states
            assert at(trip) - f.began >= S - (I + T), (at(trip) - f.began, trip)
            bound = S + C
        else:
            bypass = Bypass(stack.fleet.decode_urls[0], int(D) + 8)
            began = time.time()
            bypass.start()
            try:
                wait_for(lambda: len(bypass.admitted) + len(bypass.errors) == len(bypass.threads),
                         "bypass requests admitted by the worker", 60)
                assert not bypass.errors, bypass.errors
                f = Fault(began, max(bypass.admitted), f"{len(bypass.threads)} requests straight to d0")
                trip = trip_of(api, "drift")
            finally:
                bypass.close()
            # the worker reports more than the mirror has: mirrored − reported < −D
            assert trip["signals"]["drift"]["d0"] < -D, trip["signals"]["drift"]
            assert at(trip) >= f.began, (trip, f)  # nothing before the first bypass request
            bound = I + 2 * T + C
        took = at(trip) - f.complete
        print(f"\n{fault}: {f.detail}; fault -> trip {took:.2f} s (bound {bound:.2f} s + slack {SLACK_S} s), "
              f"scrapes {s0} at the fault, {trip['scrapes']} at the trip; load average {load:.1f}; "
              f"healthy before: {healthy_s:.1f} s, {healthy_scrapes} scrapes, no trip; "
              f"trip detail: {trip['detail']}")
        assert took <= bound + SLACK_S, (fault, took, bound, trip)
