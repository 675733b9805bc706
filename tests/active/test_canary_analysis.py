"""Automated canary analysis end to end: a simulated P/D fleet at saturation, the `shadow router`
stand-in (JSQ) pointed at shadow's taps, and `shadow serve --active`, all traffic through shadow's
proxy. Both cohorts are measured at the same listener on the same fleet at the same time.

- A policy made worse (every request to decode rank 0, so canary requests queue behind the router's
  there; `shadow serve` in this process, its decode router injected): the canary ends in shadow,
  the reason naming the metric. (In this process the canary's P/D flow shares the interpreter with
  the test's clients while the router's runs in a process of its own, which alone made a control
  canary of JSQ look 40 % slower to first token at 25 %: the in-process setup only judges a policy
  much worse.)

- A BR-0 canary (`test_a_br0_canary_at_saturation_is_promoted_step_by_step`; fleet in this
  process, router and `shadow serve` as processes, the fleet at time-scale 2, steps 10/25 % — the
  issue's top step — 60 requests a cohort) is promoted to active. Four runs on 2026-12-02 (load
  8–13 from other jobs; the fourth with two `yes` burners more), TTFT / TPOT P50 canary vs router
  and the non-inferiority p at 25 %: 1.32 vs 1.11 s (p = 0.049) / 49 vs 46 ms; 0.78 vs 1.02 s /
  48 vs 45 ms (p = 0.044); 0.44 vs 0.60 s / 43 vs 42 ms; 0.81 vs 1.10 s / 43 vs 44 ms (burners).
  All promoted, two with one metric near the level: the margin of this test is thin.

Why BR-0's promotion had not been a stable outcome (a `shadow serve` process, `--pool-bypass`,
steps 10/25/50 %: promoted in one run, stopped at 25 % on TTFT 1.11 vs 0.78 s in the next):
1. The pool was overtaken. The router binds its requests at arrival, so the ranks hold a queue
   of them, which takes every slot they free; BR-0's pool requests waited for a free slot that
   never came. A BR-0 pool canary lost at 25 % on TTFT 671 vs 450 ms (p = 10⁻⁶). Now a worker
   over its slots with requests shadow did not place shows the pool one free slot a round
   (`Ledger.snapshot`).
2. The test was a strict difference test. A control canary of the router's own rule
   (`--active-policy jsq-bytes`) under two CPU burners failed its first step on TPOT 27 vs 23 ms
   (p = 2·10⁻⁵): the cohorts' paths differ (shadow's proxy relays the canary's legs, the router
   process the control's). Now TTFT and TPOT are judged by a non-inferiority test with stated
   margins (shadow/active/canary.py). All ranks step on one barrier, so every running request
   gets the same time per token: a TPOT difference here is the path, 3–5 %, hence 15 % in this
   test; 40 requests at 10 % did not show TPOT 47 vs 46 ms within 10 % (p = 0.29), hence 60.
3. Time-scale 2 (steps of ~40 ms): at 1.0 (20 ms) the host's scheduling delays are a large part
   of a token's time.
Not solved: beyond 25 % BR-0's cohort lost on TTFT in runs tried — 50 %: 1,302 vs 815 ms (pool
rounds); 35 %: 2,115 vs 1,494 ms (`--pool-bypass`) — and the analysis stops it there. The ratio
also swings from run to run far more than the per-request p-values allow (0.76–1.19 at 25 %,
0.87–1.60 at 50 %): at saturation a request's TTFT is its rank's queue, correlated over seconds,
so the requests of a step are not independent samples; a test on time windows would be sounder.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.active.canary import CanaryConfig
from shadow.active.modes import ModeConfig
from shadow.app.serve import ActiveSettings, ServeConfig
from shadow.base.tools import find_executable
from shadow.core.policies import make_router
from shadow.core.routers import Router
from shadow.core.snapshot import FleetSnapshot
from shadow.fleet import FleetConfig
from shadow.mirror.config import MirrorConfig
from tests.active.test_decision_exception import RaisingRouter
from tests.alerts.test_alertmanager_integration import Traffic
from tests.harness import FleetThread, ServeThread
from tests.telemetry.active_stack import ADMIN_TOKEN, _free_run, _Proc, active_stack
from tests.telemetry.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = (0.1, 0.25, 0.5)
# checks every 0.05 s: spread batches of 100 checks (5 s, longer than a request, so batches are
# nearly independent), the baseline its last 8 batches (40 s of shadow mode before the canary)
TIME_SCALE = 2.0  # fleet steps of ~40 ms: the model's time, not the proxies', sets the latencies
# All ranks step on one barrier, so every running request gets the same time per token whatever
# its rank: a TPOT difference between the cohorts here is the proxies' path (shadow's proxy relays
# the canary's tokens, the router process the control's), 3-5 % on this loaded 2-core host.
TPOT_MARGIN = 0.15
# 60 requests a cohort: 40 at 10 % did not show a canary TPOT of 47 vs 46 ms within 10 % (p = 0.29)
BR0_STEPS, BR0_MIN = (0.1, 0.25), 60
CANARY = CanaryConfig(steps=STEPS, min_requests=40, min_step_s=20.0, max_step_s=240.0, spread_batch=100,
                      min_batches=4, baseline_batches=4)


class AllOnRankZero(RaisingRouter):
    """A pool router that only ever places on decode rank 0 (a made-worse policy)."""

    def decide(self, fleet: FleetSnapshot, now: float) -> list[tuple[Hashable, int]]:
        n = max(0, fleet.free_slots[0])
        picked, self.pool = self.pool[:n], self.pool[n:]
        return [(rid, 0) for rid in picked]


@contextmanager
def canary_stack(tmp: Path, routers: Callable[[str], Router] | None = None) -> Iterator[dict[str, Any]]:
    """Fleet (1 prefill, 2 decode ranks × 8 slots) + `shadow router` + `shadow serve --active` in
    mode shadow with the canary analysis configured; yields serve's ready line.

    (The BR-0 test runs as a process, with `--pool-bypass`: BR-0 places each request when its
    prefill is done and the rank queues it, as the router's JSQ does. In this process, BR-0 in pool
    rounds was judged slower to first token at 10 % (1.90 vs 1.43 s, p = 0.044) and with
    `--dispatch-ahead 4` at 50 % (0.97 vs 0.66 s, p = 0.006), but a JSQ control canary was too: not
    a finding about the pool.)"""
    shadow = find_executable("shadow")
    assert shadow, "the shadow console script is missing"
    with FleetThread(FleetConfig(prefill=1, decode=2, slots=8, base_port=0, time_scale=1.0)) as fleet:
        base = _free_run(4)
        dtaps = [f"http://127.0.0.1:{base + 1 + g}" for g in range(2)]
        router = _Proc([shadow, "router", "--port", "0", *[x for t in dtaps for x in ("--decode", t)],
                        "--prefill", f"http://127.0.0.1:{base + 3}"], tmp / "router.log")
        try:
            tap = MirrorConfig({f"d{g}": u for g, u in enumerate(fleet.decode_urls)},
                            prefill={"p0": fleet.prefill_urls[0]}, front={"router": router.ready["url"]},
                            slots=8, port=base, scrape_interval_s=0.5)
            mode = ModeConfig(mode="shadow", admin_token=ADMIN_TOKEN, check_interval_s=0.05, canary=CANARY,
                              oracle_interval_s=0)
            config = ServeConfig(tap=tap, policies=("br0",), mode_config=mode,
                                 active=ActiveSettings(router_factory=routers))
            with ServeThread(config) as serve:
                assert serve.ready["taps"]["d0"] == dtaps[0], serve.ready
                yield serve.ready
        finally:
            router.close()


def mode_doc(api: str) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(api + "/v1/mode", timeout=10).json()
    return doc


def run_canary(api: str, front: str, first: float = STEPS[0]) -> dict[str, Any]:
    """Saturating traffic through shadow's proxy; a shadow-mode baseline, then the canary until it
    ends; the report's mode section at the end."""
    traffic = Traffic(front, 24, max_tokens=40)  # 24 streams on 16 slots: saturated
    try:
        wait_for(lambda: (mode_doc(api)["canary"] or {}).get("baseline_samples", 0) >= 400, 240,
                 "a shadow-mode baseline of 20 s (the ramp-up left behind)")
        r = httpx.put(api + "/v1/mode", json={"mode": "canary"}, timeout=10,
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert r.status_code == 200, r.text
        assert r.json()["canary_fraction"] == first
        wait_for(lambda: mode_doc(api)["canary"]["outcome"] is not None, 420, "the canary's end")
    finally:
        traffic.stop()
    report = httpx.get(api + "/v1/report", timeout=30).json()["mode"]
    assert isinstance(report, dict)
    return report


def test_a_made_worse_policy_is_stopped_with_the_reason(tmp_path: Path) -> None:
    def routers(policy: str) -> Router:
        return AllOnRankZero() if policy == "br0" else make_router(policy)

    with canary_stack(tmp_path, routers) as ready:
        report = run_canary(ready["api"], ready["active"])
        metrics = httpx.get(ready["api"] + "/metrics", timeout=10).text
    canary = report["canary"]
    assert canary["outcome"] == "failed", canary["verdicts"]
    last = canary["verdicts"][-1]
    assert last["verdict"] == "fail" and last["fraction"] in STEPS
    assert report["configured"] == "shadow"
    end = report["transitions"][-1]
    assert end["reason"] == "canary_failed" and end["to"] == "shadow"
    # everything on one rank gives itself away by that rank's queue (time to first token) or by its
    # fuller batches (each of its steps carries more sequences: time per output token); on a loaded
    # host either can be the first shown, and the one named is measured worse than the router's
    named = [k for k in ("TTFT", "TPOT") if f"{k} not shown" in end["detail"]]
    assert named or "fallback tripped" in end["detail"], end["detail"]
    if named:
        figs = [last["figures"][k.lower()] for k in named]
        assert any(f["canary"] > f["router"] for f in figs), figs
    for v in canary["verdicts"]:  # every verdict with its figures
        if v["reason"].startswith("fallback tripped"):
            continue
        f = v["figures"]
        assert f["requests"]["canary"] >= 40 and f["requests"]["router"] >= 40, f
        assert {"error_rate", "ttft", "tpot", "spread"} <= set(f) and f["ttft"]["p"] is not None
    assert 'shadow_canary_verdicts_total{verdict="fail"} 1.0' in metrics
    assert 'shadow_mode{mode="shadow"} 1.0' in metrics


def test_a_br0_canary_at_saturation_is_promoted_step_by_step(tmp_path: Path) -> None:
    """BR-0 (its pool rounds, as it runs in active) against the router's JSQ at the issue's top
    step, 25 %: each step shows it within the margins (TTFT 25 %, TPOT 15 %) and promotes it, the
    last to active."""
    extra = ("--canary-steps", ",".join(map(str, BR0_STEPS)), "--canary-min-requests", str(BR0_MIN),
             "--canary-tpot-margin", str(TPOT_MARGIN),
             "--canary-min-step", "20", "--canary-max-step", "240", "--mode-check-interval", "0.05",
             "--oracle-interval", "0")
    with active_stack(tmp_path, mode="shadow", policy="br0", extra=extra, time_scale=TIME_SCALE) as stack:
        report = run_canary(stack.api, stack.front, BR0_STEPS[0])
        metrics = httpx.get(stack.api + "/metrics", timeout=10).text
    canary = report["canary"]
    verdicts = canary["verdicts"]
    assert [(v["fraction"], v["verdict"]) for v in verdicts] == [(BR0_STEPS[0], "pass"),
                                                                 (BR0_STEPS[1], "promoted")], verdicts
    assert canary["outcome"] == "promoted" and canary["margins"] == {"error_rate": 0.01, "ttft": 0.25,
                                                                     "tpot": TPOT_MARGIN}
    for v in verdicts:  # shown no worse, on enough requests of both cohorts
        f = v["figures"]
        assert f["requests"]["canary"] >= BR0_MIN and f["requests"]["router"] >= BR0_MIN, f
        for m in ("ttft", "tpot"):
            assert f[m]["test"] == "mann_whitney_u_noninferiority" and f[m]["p"] < 0.05, f[m]
        assert f["error_rate"]["canary"] == 0.0 and f["spread"]["canary"] is not None, f
    assert report["configured"] == "active" and report["trips"] == {}
    assert [t["reason"] for t in report["transitions"][-2:]] == ["canary_step", "canary_promoted"]
    assert report["transitions"][-1]["to"] == "active"
    assert 'shadow_canary_verdicts_total{verdict="promoted"} 1.0' in metrics
    assert 'shadow_canary_verdicts_total{verdict="pass"} 1.0' in metrics
    assert 'shadow_mode{mode="active"} 1.0' in metrics
    print("".join(f"\n{t['detail']}" for t in report["transitions"][-2:]))
