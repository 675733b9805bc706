"""NIXL-style P/D: prefill legs issue KV handles held until pulled or expired; decode legs
must present a live handle; the prefill's /metrics shows the held KV."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fleet_helpers import check_stream, metric_value, stream_raw, words

from shadow.fleet import FleetConfig, FleetThread

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
    with FleetThread(FleetConfig(prefill=1, decode=1, base_port=0, time_scale=0.25, kv_ttl_s=0.3)) as ft:
        p_url, d_url = ft.prefill_urls[0], ft.decode_urls[0]
        r = httpx.post(p_url + "/v1/completions", json={"prompt": words(64), **PREFILL_BODY})
        kv = r.json()["kv_transfer_params"]
        assert kv_usage(p_url) > 0
        time.sleep(0.5)
        assert kv_usage(p_url) == 0  # the TTL freed it
        r2 = httpx.post(d_url + "/v1/completions", json={"prompt": words(64), "kv_transfer_params": kv})
        assert r2.status_code == 400
        assert "unknown or expired" in r2.json()["error"]["message"]
        state = httpx.get(p_url + "/fleet/state").json()
        assert state["kv_expired"] == 1 and state["kv_holds"] == 0


def test_prefill_is_fcfs_and_timed() -> None:
    cfg = FleetConfig(prefill=1, decode=1, base_port=0, time_scale=1.0, prefill_c0=0.05, prefill_c1=0.0)
    async def one(client: httpx.AsyncClient, url: str, t0: float) -> float:
        r = await client.post(url, json={"prompt": "a b", **PREFILL_BODY})
        assert r.status_code == 200
        return time.monotonic() - t0

    async def main(url: str) -> list[float]:
        async with httpx.AsyncClient(timeout=10) as client:
            await client.get(url.replace("/v1/completions", "/health"))  # warm the connection pool
            t0 = time.monotonic()
            return sorted(await asyncio.gather(*(one(client, url, t0) for _ in range(4))))

    with FleetThread(cfg) as ft:
        done = asyncio.run(main(ft.prefill_urls[0] + "/v1/completions"))
        # one at a time: the 4th finishes after ~4 × 50 ms
        assert done[-1] >= 0.19
        assert done[0] < 0.15


def test_request_without_handle_is_served_locally(fleet: FleetThread) -> None:
    r = httpx.post(fleet.prefill_urls[0] + "/v1/completions", json={"prompt": "a b c", "max_tokens": 4,
                                                                    "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["kv_transfer_params"] is None
