"""Injected faults, each observed by a client as specified: connection refused (crash, and
recovery), cut streams, 5xx, duplicated and dropped chunks, mid-stream error events, stalls,
slow steps; from the control endpoint, the Python API and the CLI grammar."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fleet_helpers import metric_value, stream_raw, words

from shadow.fleet import FaultSpec, FleetConfig
from shadow.fleet.faults import Target
from tests.harness import FleetThread

pytestmark = pytest.mark.timeout(60)

STREAM = {"prompt": "a b c", "max_tokens": 6, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True}}


def post_fault(url: str, **settings: object) -> dict:
    r = httpx.post(url + "/fleet/faults", json=settings)
    assert r.status_code == 200, r.text
    return r.json()


def token_payloads(events: list[tuple[float, str]]) -> list[dict]:
    return [json.loads(p) for _, p in events if p.startswith("{") and json.loads(p).get("choices")]


def wait_until(pred, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False


def test_crash_refuses_connections_then_recovers(fleet: FleetThread) -> None:
    d0, d1 = fleet.decode_urls
    # an in-flight stream on the crashing rank is cut, not ended cleanly
    with httpx.stream("POST", d1 + "/v1/completions", timeout=10,
                      json={**STREAM, "max_tokens": 1000}) as r:
        it = r.iter_raw()
        next(it)
        assert post_fault(d0, target="decode/1", crash_s=-1)["applied"] == ["decode/1"]
        with pytest.raises(httpx.HTTPError):
            for _ in it:
                pass
    wait_until(lambda: refused(d1))
    with pytest.raises(httpx.ConnectError):
        httpx.post(d1 + "/v1/completions", json={"prompt": "a"})
    assert httpx.get(d0 + "/health").status_code == 200  # the other rank lives on
    post_fault(d0, target="decode/1", recover=True)
    assert httpx.get(d1 + "/health").status_code == 200
    _, events = stream_raw(d1 + "/v1/completions", STREAM)
    assert len(token_payloads(events)) == 6
    # timed crash through the Python API recovers by itself
    fleet.call(fleet.fleet.crash("decode", 1, 0.3))
    assert refused(d1)
    wait_until(lambda: not refused(d1))


def test_cut_stream_after_k_chunks(fleet: FleetThread) -> None:
    url = fleet.decode_urls[0]
    post_fault(url, cut_after=3)
    got = b""
    with (pytest.raises(httpx.RemoteProtocolError),
          httpx.stream("POST", url + "/v1/completions", json=STREAM, timeout=10) as r):
        assert r.status_code == 200
        for chunk in r.iter_raw():
            got += chunk
    assert got.count(b"data: ") == 3 and b"[DONE]" not in got
    post_fault(url, cut_after=0)
    _, events = stream_raw(url + "/v1/completions", STREAM)
    assert events[-1][1] == "[DONE]"


def test_http_5xx_for_k_requests(fleet: FleetThread) -> None:
    url = fleet.decode_urls[1]
    post_fault(url, http_status=503, http_count=2)
    for _ in range(2):
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    fleet.inject("decode/1", http_status=500)
    assert httpx.post(url + "/v1/completions", json={"prompt": "a"}).status_code == 500
    fleet.inject("decode/1", clear=True)
    assert httpx.post(url + "/v1/completions", json={"prompt": "a"}).status_code == 200


def test_duplicated_and_dropped_chunks(fleet: FleetThread) -> None:
    url = fleet.decode_urls[0]
    post_fault(url, dup_every=2)
    _, events = stream_raw(url + "/v1/completions", STREAM)
    toks = token_payloads(events)
    assert len(toks) == 6 + 3
    assert json.loads(events[-2][1])["usage"]["completion_tokens"] == 6
    post_fault(url, dup_every=0, drop_every=3)
    _, events = stream_raw(url + "/v1/completions", STREAM)
    toks = token_payloads(events)
    assert len(toks) == 6 - 2
    assert json.loads(events[-2][1])["usage"]["completion_tokens"] == 6


def test_mid_stream_error_event(fleet: FleetThread) -> None:
    url = fleet.decode_urls[0]
    post_fault(url, error_after=3)
    r, events = stream_raw(url + "/v1/chat/completions",
                           {**STREAM, "prompt": None, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    payloads = [p for _, p in events]
    assert len(payloads) == 5 and payloads[-1] == "[DONE]"
    err = json.loads(payloads[-2])
    assert set(err) == {"error"} and err["error"]["code"] == 500
    assert set(err["error"]) == {"message", "type", "param", "code"}


def test_stall_pauses_every_rank(fleet: FleetThread) -> None:
    """A stall on d1 stops a stream on d0: d0 generates no token for the stall's length.

    Ground truth is d0's own generation counter (this stream is the only request on d0): the
    stall is set at some t_a in [t0, t1] (before and after the POST) and lasts until t_a + 0.5 s;
    at most the step in flight at t_a still ends, so a second token beyond the count read after t1
    needs a step that starts after the stall. Neither the counter nor the stream can show it before
    t0 + 0.5 s, however late this process runs (an observation only comes after the fact). The
    stream starts before the stall and outlasts it; it is closed (aborted) once the pause is shown.
    """
    d0, d1 = fleet.decode_urls
    body = {**STREAM, "max_tokens": 30_000}  # minutes of 5 ms steps: it outlasts the test

    def generated() -> float:
        return metric_value(httpx.get(d0 + "/metrics", timeout=10).text, "vllm:generation_tokens_total")

    with httpx.stream("POST", d0 + "/v1/completions", json=body, timeout=20) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()
        received = 0  # token events the client has read (one per token: no chunk faults here)

        def read_until(n: int) -> float:
            nonlocal received
            while received < n:
                received += next(chunks).count(b"data: {")
            return time.monotonic()

        read_until(5)  # the stream runs
        t0 = time.monotonic()
        assert post_fault(d1, stall_s=0.5)["applied"] == ["decode/1"]
        t1 = time.monotonic()
        g1 = generated()
        while generated() <= g1 + 1:  # until a step after the stall gave d0 a token
            assert time.monotonic() < t1 + 30, "d0 did not resume after the stall"
            time.sleep(0.01)
        t_counter = time.monotonic()
        t_stream = read_until(int(g1) + 2)  # the client's stream carries that token too
    assert t_counter >= t0 + 0.5 and t_stream >= t0 + 0.5, (t0, t1, t_counter, t_stream)


def test_slow_rank_slows_the_barrier(fleet: FleetThread) -> None:
    """slow=8 on d1 makes every step of the shared clock 8× longer for a stream on d0, also while
    d1 is idle (an idle rank still takes part in every step: dummy batch).

    The steps are read from the clock (`/fleet/state`: model seconds per step over each stream;
    its steps never end before that); the client's own check is a lower bound that no delay can
    break: a lone stream on an idle clock cannot end before its tokens' slowed steps did.
    """
    d0, d1 = fleet.decode_urls
    body = {**STREAM, "max_tokens": 15}
    cfg = fleet.fleet.config
    step_b = cfg.b * cfg.time_scale  # an idle-rank step, not slowed

    def clock() -> dict:
        return httpx.get(d0 + "/fleet/state", timeout=10).json()["clock"]

    def per_step() -> tuple[float, float]:
        """(model seconds per step over one 15-token stream on d0, the client's send-to-last-token)."""
        c0 = clock()
        sent = time.monotonic()
        _, ev = stream_raw(d0 + "/v1/completions", body)
        assert len(token_payloads(ev)) == 15
        took = ev[-1][0] - sent
        c1 = clock()
        return (c1["model_s"] - c0["model_s"]) / (c1["steps"] - c0["steps"]), took

    base, _ = per_step()
    assert base == pytest.approx(step_b, rel=0.01)  # d0's few tokens add a·L ≈ 0
    post_fault(d1, slow=8)
    slow_idle, took = per_step()
    assert slow_idle == pytest.approx(8 * step_b, rel=1e-9)
    assert took >= 15 * 8 * step_b  # 15 tokens, 15 slowed steps on a clock that was idle
    with httpx.stream("POST", d1 + "/v1/completions", json={**STREAM, "max_tokens": 2000}, timeout=10) as r:
        it = r.iter_raw()  # keep the iterator: dropping it closes the stream (and aborts)
        next(it)
        slow_busy, _ = per_step()
    assert slow_idle > 4 * base and slow_busy >= slow_idle


def test_fault_spec_cli_grammar() -> None:
    spec = FaultSpec.parse("decode/1:stall_s=2,slow=3@5")
    assert spec.target == Target("decode", 1) and spec.at_s == 5.0
    assert dict(spec.settings) == {"stall_s": 2.0, "slow": 3.0}
    assert FaultSpec.parse("prefill/*:http_status=503,http_count=4").target == Target("prefill", None)
    for bad in ("decode:stall_s=1", "decode/1", "decode/1:nope=1", "decode/1:http_status=200",
                "decode/1:cut_after=-1", "gpu/0:slow=2", "decode/1:slow=0"):
        with pytest.raises(ValueError):
            FaultSpec.parse(bad)


def test_scheduled_fault_from_config() -> None:
    """`decode/0:http_status=502@AT` applies AT seconds (fleet loop time) after the fleet started:
    not before (checked whenever the fleet's clock is short of AT), and then (waited on as a
    condition, not a sleep: under load the fleet's loop can run late)."""
    from shadow.fleet import FleetConfig

    at = 0.5
    cfg = FleetConfig(prefill=0, decode=1, base_port=0, time_scale=0.25,
                      faults=(FaultSpec.parse(f"decode/0:http_status=502@{at}"),))
    with FleetThread(cfg) as ft:
        url = ft.decode_urls[0]
        server = ft.fleet.decode_servers[0]

        async def uptime_and_status() -> tuple[float, int | None]:
            return asyncio.get_running_loop().time() - ft.fleet.started_at, server.faults.http_status

        status = httpx.post(url + "/v1/completions", json={"prompt": words(2)}).status_code
        uptime, fault = ft.call(uptime_and_status())
        if uptime < at:  # the request was answered before AT: the fault was not on yet
            assert status == 200 and not fault, (uptime, status, fault)
        deadline = time.monotonic() + 10
        while not fault:
            assert time.monotonic() < deadline, "the scheduled fault never applied"
            time.sleep(0.01)
            uptime, fault = ft.call(uptime_and_status())
        assert uptime >= at and fault == 502, (uptime, fault)
        assert httpx.post(url + "/v1/completions", json={"prompt": words(2)}).status_code == 502
        assert httpx.get(url + "/fleet/faults").json()["faults"]["http_status"] == 502


def test_fault_injection_is_an_admin_action() -> None:
    # With a control token, POST /fleet/faults needs it; GET stays open (read-only).
    with FleetThread(FleetConfig(prefill=0, decode=1, base_port=0, control_token="s3cret")) as ft:
        url = ft.decode_urls[0] + "/fleet/faults"
        assert httpx.post(url, json={"slow": 2}).status_code == 401
        assert httpx.post(url, json={"slow": 2}, headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = httpx.post(url, json={"slow": 2}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(url).json()["faults"]["slow"] == 2


def test_no_token_means_loopback_only() -> None:
    from shadow.base.security import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
