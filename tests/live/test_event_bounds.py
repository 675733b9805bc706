"""Event lines whose time or token counts no live producer could send are dropped, not run.

One `shadow serve` process fed only through its event API: four lines claiming time 9e15 and
2^53 generated tokens must not take the lanes (which step simulated time up to the newest event
and run a request for as many steps as its tokens), and a normal request afterwards must still
be run out by the lanes.
"""

from __future__ import annotations

import json
import time

import httpx

from tests.active.procs import shadow_process


def _post(api: str, lines: list[dict[str, object]]) -> dict[str, object]:
    body = "\n".join(json.dumps(x) for x in lines).encode()
    r = httpx.post(api + "/v1/events", content=body, timeout=30)
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
