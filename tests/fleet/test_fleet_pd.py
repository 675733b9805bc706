"""NIXL-style P/D: prefill legs issue KV handles held until pulled or expired; decode legs
must present a live handle; the prefill's /metrics shows the held KV."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fleet_helpers import check_stream, metric_value, run_virtual, stream_raw, words

from shadow.fleet import FleetConfig
from shadow.fleet.engine import Seq
from shadow.fleet.faults import FaultState
from shadow.fleet.pd import KvStore
from shadow.fleet.prefill import PrefillEngine
from tests.harness import FleetThread

pytestmark = pytest.mark.timeout(60)

PREFILL_BODY = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None},
                "max_tokens": 1, "min_tokens": 1, "stream": False}


def kv_usage(url: str) -> float:
    return metric_value(httpx.get(url + "/metrics").text, "vllm:kv_cache_usage_perc")


@pytest.mark.parametrize("chat", [False, True])
def test_two_phase_request(chat: bool) -> None:
    with FleetThread(FleetConfig(prefill=2, decode=2, base_port=0, time_scale=0.25)) as ft:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        prompt: dict = ({"messages": [{"role": "user", "content": words(200)}]} if chat
                        else {"prompt": words(200)})
        p_url = ft.prefill_urls[1]
        r = httpx.post(p_url + path, json={**prompt, **PREFILL_BODY}, headers={"X-Request-Id": "pd-1"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 1
        kv = body["kv_transfer_params"]
        assert set(kv) == {"do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids",
                           "remote_request_id", "remote_host", "remote_port", "tp_size"}
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_host"] == "127.0.0.1" and f":{kv['remote_port']}" in p_url
        assert len(kv["remote_block_ids"]) == -(-body["usage"]["prompt_tokens"] // 16)
        assert "pd-1" in kv["remote_request_id"]
        assert kv_usage(p_url) > 0  # the prefill holds the KV

        d_url = ft.decode_urls[0]
        decode_body = {**prompt, "max_tokens": 6, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}, "kv_transfer_params": kv}
        r2, events = stream_raw(d_url + path, decode_body, headers={"X-Request-Id": "pd-1"})
        assert r2.status_code == 200
        assert check_stream([p for _, p in events], chat=chat, include_usage=True) == 6
        assert kv_usage(p_url) == 0  # pulled: released
        m = httpx.get(d_url + "/metrics").text
        assert metric_value(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == \
            body["usage"]["prompt_tokens"]
        # a handle is good for one pull only
        r3 = httpx.post(d_url + path, json={**decode_body, "stream": False, "stream_options": None})
        assert r3.status_code == 400 and r3.json()["error"]["param"] == "kv_transfer_params"
        pm = httpx.get(p_url + "/metrics").text
        assert metric_value(pm, "vllm:prompt_tokens_total") == body["usage"]["prompt_tokens"]
        assert metric_value(pm, "vllm:request_success_total", finished_reason="length") == 1


def test_handle_expires_after_ttl() -> None:
    """A handle nobody pulls is held for the TTL (fleet loop time) from the end of its prefill,
    not freed before, and freed after: waited on as a condition, never a fixed sleep."""
    ttl = 0.3
    with FleetThread(FleetConfig(prefill=1, decode=1, base_port=0, time_scale=0.25, kv_ttl_s=ttl)) as ft:
        p_url, d_url = ft.prefill_urls[0], ft.decode_urls[0]
        server = ft.fleet.prefill_servers[0]

        async def now() -> float:
            return asyncio.get_running_loop().time()

        async def expiries() -> list[float]:  # read only: sweeping is /metrics' and /fleet/state's job
            return [h.expires_at for h in server.kv.holds.values()]

        async def sample() -> tuple[float, float, list[float]]:
            """(KV usage as /metrics computes it: expired holds swept; the holds' expiries; the
            loop time just after, so a hold swept in this sample expired by then)."""
            usage = server.engine.kv_usage()
            return usage, [h.expires_at for h in server.kv.holds.values()], asyncio.get_running_loop().time()

        t0 = ft.call(now())
        r = httpx.post(p_url + "/v1/completions", json={"prompt": words(64), **PREFILL_BODY})
        t1 = ft.call(now())
        kv = r.json()["kv_transfer_params"]
        (expires_at,) = ft.call(expiries())
        assert t0 + ttl <= expires_at <= t1 + ttl, (t0, expires_at, t1)  # held for the TTL
        deadline = time.monotonic() + 10
        while True:  # until the TTL frees it (a condition, bounded)
            usage, holds, t = ft.call(sample())
            if not holds:
                break
            assert usage > 0, "KV held, but /metrics shows none"
            assert time.monotonic() < deadline, "the TTL never freed the KV"
            time.sleep(0.01)
        assert t >= expires_at, f"freed by {t:.3f}, before the TTL ended at {expires_at:.3f}"
        assert usage == 0 and kv_usage(p_url) == 0  # the TTL freed it (and /metrics shows so)
        r2 = httpx.post(d_url + "/v1/completions", json={"prompt": words(64), "kv_transfer_params": kv})
        assert r2.status_code == 400
        assert "unknown or expired" in r2.json()["error"]["message"]
        state = httpx.get(p_url + "/fleet/state").json()
        assert state["kv_expired"] == 1 and state["kv_holds"] == 0


def test_prefill_is_fcfs_and_timed() -> None:
    """One prefill at a time, in arrival order, each taking exactly c0 + c1·prompt_tokens (virtual
    time: exact, whatever the machine's load)."""
    c0, c1 = 0.05, 0.001
    cfg = FleetConfig(prefill=1, decode=1, base_port=0, time_scale=1.0, prefill_c0=c0, prefill_c1=c1)
    prompts = [400, 10, 250, 30]  # a short one behind a long one still waits its turn

    async def main() -> list[Seq]:
        loop = asyncio.get_running_loop()
        engine = PrefillEngine(cfg, FaultState(), KvStore("p0", "127.0.0.1", 1, ttl_s=60.0, block_size=16))
        task = asyncio.create_task(engine.run())
        seqs = [Seq(f"r{i}", p, 1, "length", 1, loop.time()) for i, p in enumerate(prompts)]
        for s in seqs:
            engine.submit_prefill(s)
        await asyncio.sleep(0.01)  # virtual time: the first prefill is under way
        assert engine.num_running() == 1 and len(engine.queue) == 3, "prefills run one at a time"
        late = Seq("late", 5, 1, "length", 1, loop.time())
        engine.submit_prefill(late)
        seqs.append(late)
        for s in seqs:
            while not s.finished:
                await s.wait_beyond(s.generated)
        task.cancel()
        return seqs

    seqs = run_virtual(main)
    order = sorted(seqs, key=lambda s: s.scheduled_t)
    assert [s.rid for s in order] == ["r0", "r1", "r2", "r3", "late"], "prefills not first-come first-served"
    t = 0.0
    for s in order:
        assert s.scheduled_t == pytest.approx(t, abs=1e-12), (
            f"{s.rid} started at {s.scheduled_t}, not when the previous prefill ended ({t})")
        want = c0 + c1 * s.prompt_tokens
        assert s.first_t - s.scheduled_t == pytest.approx(want, rel=1e-9), (
            f"{s.rid}: prefill of {s.prompt_tokens} tokens took {s.first_t - s.scheduled_t} s, "
            f"expected c0 + c1·n = {want}")
        assert (s.generated, s.finish_reason) == (1, "length") and s.kv_params is not None
        t = s.first_t


def test_prefill_server_runs_concurrent_requests_one_at_a_time() -> None:
    """Over HTTP: four concurrent prefills of c0 each cannot all be done before 4·c0 (a lower bound,
    so machine load cannot break it); every one gets its KV handle."""
    c0 = 0.05
    cfg = FleetConfig(prefill=1, decode=1, base_port=0, time_scale=1.0, prefill_c0=c0, prefill_c1=0.0)

    async def one(client: httpx.AsyncClient, url: str) -> dict:
        r = await client.post(url, json={"prompt": "a b", **PREFILL_BODY})
        assert r.status_code == 200, r.text
        return r.json()

    async def main(url: str) -> tuple[float, list[dict]]:
        async with httpx.AsyncClient(timeout=60) as client:
            await client.get(url.replace("/v1/completions", "/health"))  # warm the connection pool
            t0 = time.monotonic()
            bodies = await asyncio.gather(*(one(client, url) for _ in range(4)))
            return time.monotonic() - t0, list(bodies)

    with FleetThread(cfg) as ft:
        elapsed, bodies = asyncio.run(main(ft.prefill_urls[0] + "/v1/completions"))
        assert elapsed >= 4 * c0 - 0.01, (
            f"4 prefills of {c0} s each finished in {elapsed:.3f} s: run in parallel?")
        handles = {b["kv_transfer_params"]["remote_request_id"] for b in bodies}
        assert len(handles) == 4
        state = httpx.get(ft.prefill_urls[0] + "/fleet/state").json()
        assert state["kv_holds"] == 4


def test_request_without_handle_is_served_locally(fleet: FleetThread) -> None:
    r = httpx.post(fleet.prefill_urls[0] + "/v1/completions", json={"prompt": "a b c", "max_tokens": 4,
                                                                    "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["kv_transfer_params"] is None
