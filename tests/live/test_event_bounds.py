"""Event lines whose time or token counts no live producer could send are dropped, not run.

One `shadow serve` process fed only through its event API: four lines claiming time 9e15 and
2^53 generated tokens must not take the lanes (which step simulated time up to the newest event
and run a request for as many steps as its tokens), and a normal request afterwards must still
be run out by the lanes. Steps far longer than the streams show are left out and counted, and the
probe's token admits nothing but steps.
"""

from __future__ import annotations

import json
import time

import httpx

from tests.active.procs import shadow_process
from tests.live.stack import wait


def _post(api: str, lines: list[dict[str, object]], token: str | None = None) -> dict[str, object]:
    body = "\n".join(json.dumps(x) for x in lines).encode()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.post(api + "/v1/events", content=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


def test_far_future_times_and_huge_counts_are_dropped_and_the_lanes_keep_running() -> None:
    argv = ["serve", "--worker", "d0=http://127.0.0.1:9", "--worker", "d1=http://127.0.0.1:9",
            "--slots", "4", "--scrape-interval", "0", "--lag", "0.1", "--policies", "br0"]
    with shadow_process(argv) as (_, ready):
        api = ready["api"]
        now = time.monotonic()  # the host's clock, which the serve process shares
        attack = _post(api, [
            {"type": "arrive", "request_id": "x", "t": now, "prompt_tokens": 10},
            {"type": "route", "request_id": "x", "t": now, "worker": "d0", "prompt_tokens": 10},
            {"type": "token", "request_id": "x", "t": 9e15, "generated": 2**53},
            {"type": "finish", "request_id": "x", "t": now + 0.01, "generated": 2**53},
            # x's real end (it never streamed), in the same post: a later post could come after the
            # lanes (0.1 s behind) have started x, on a loaded host
            {"type": "cancel", "request_id": "x", "t": now + 0.02},
        ])
        assert attack["outcomes"] == {"ok": 3, "time_skew": 1, "token_bound": 1}, attack
        now = time.monotonic()
        normal = _post(api, [
            {"type": "arrive", "request_id": "y", "t": now, "prompt_tokens": 50},
            {"type": "route", "request_id": "y", "t": now, "worker": "d1", "prompt_tokens": 50},
            {"type": "token", "request_id": "y", "t": now + 0.02, "generated": 1},
            {"type": "finish", "request_id": "y", "t": now + 0.04, "generated": 3},
        ])
        assert normal["outcomes"] == {"ok": 4}, normal
        # the drain runs every known request out; the old code held the lanes in a step loop
        # towards t=9e15 (and 2^53 steps), so the drain could never take them
        report = httpx.get(api + "/v1/report", params={"drain": 1}, timeout=120)
        assert report.status_code == 200, report.text
        lanes = report.json()["lanes"]
        assert lanes["actual"]["requests_finished"] == 1  # y (x never streamed: no request)
        assert lanes["br0"]["requests_finished"] == 1
        assert lanes["actual"]["steps"] < 1000
        state = httpx.get(api + "/v1/state", timeout=10).json()
        assert state["dropped"] == {"time_skew": 1, "token_bound": 1}


def test_the_probe_token_moves_only_the_lanes_clock_and_implausible_steps_are_counted() -> None:
    """`shadow serve --events-token E --probe-token P`: P admits `step` lines and nothing else;
    steps of 3000 s on a worker whose stream the mirror saw stepping every 20 ms are left out,
    counted by reason in the report and on /metrics, and the lanes' clock stays on 20 ms."""
    events, probe = "e" * 24, "p" * 24
    argv = ["serve", "--worker", "d0=http://127.0.0.1:9", "--slots", "4", "--scrape-interval", "0",
            "--lag", "0.1", "--policies", "br0", "--events-token", events, "--probe-token", probe]
    with shadow_process(argv) as (_, ready):
        api = ready["api"]
        now = time.monotonic()
        stream = [{"type": "arrive", "request_id": "x", "t": now, "prompt_tokens": 10},
                  {"type": "route", "request_id": "x", "t": now, "worker": "d0", "prompt_tokens": 10}]
        stream += [{"type": "token", "request_id": "x", "t": now + 0.02 * i, "generated": i}
                   for i in range(1, 201)]
        assert _post(api, stream, probe)["rejected"] == {"unauthorized_kind": 202}
        assert _post(api, stream, events)["outcomes"] == {"ok": 202}
        steps = [{"type": "step", "t": now + 0.01 * i, "duration_s": 3000.0, "worker": "d0"}
                 for i in range(400)]
        assert _post(api, steps, probe)["accepted"] == 400
        assert httpx.post(api + "/v1/events", content=b"{}", timeout=10).status_code == 401

        def rejected() -> dict[str, int]:
            got: dict[str, int] = httpx.get(api + "/v1/report", timeout=10).json()["step_model"][
                "step_events_rejected"]
            return got

        wait(lambda: rejected()["longer_than_streams"] == 400, "the steps judged")
        report = httpx.get(api + "/v1/report", timeout=10).json()
        assert report["step_model"]["clock"]["lane_models"]["d0"]["b_s"] < 1.0
        page = httpx.get(api + "/metrics", timeout=10).text
        assert 'shadow_live_step_events_rejected_total{reason="longer_than_streams"} 400.0' in page
        assert 'shadow_mirror_events_rejected_total{reason="unauthorized_kind"} 202.0' in page
