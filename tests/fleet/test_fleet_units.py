"""Unit tests of the fleet's pure parts: token rules, output lengths, KV store TTLs, histograms,
config validation, fault state; and the async `Fleet` API."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fleet_helpers import check_stream, sse_events, words
from hypothesis import given
from hypothesis import strategies as st

from shadow.fleet import Fleet, FleetConfig
from shadow.fleet.faults import FaultState
from shadow.fleet.metrics import Hist, buckets_1_2_5
from shadow.fleet.pd import HandleError, KvDirectory, KvStore
from shadow.fleet.tokens import (
    CHAT_MESSAGE_OVERHEAD,
    PromptError,
    chat_tokens,
    output_length,
    prompt_tokens,
)

pytestmark = pytest.mark.timeout(30)


@given(st.integers(min_value=1, max_value=3000))
def test_n_repeated_words_are_n_tokens(n: int) -> None:
    assert prompt_tokens(words(n))[0] == n
    assert prompt_tokens(list(range(n)))[0] == n
    assert chat_tokens([{"role": "user", "content": words(n)}])[0] == n + CHAT_MESSAGE_OVERHEAD


def test_prompt_forms() -> None:
    assert prompt_tokens(["a b  c\n d"])[0] == 4
    parts = [{"type": "text", "text": "a b"}, {"type": "image_url", "image_url": {}},
             {"type": "text", "text": "c"}]
    assert chat_tokens([{"role": "system", "content": None}, {"role": "user", "content": parts}])[0] == 3 + 8
    for bad in (None, 5, [], ["a", "b"], [1.5], {"x": 1}):
        with pytest.raises(PromptError):
            prompt_tokens(bad)
    for bad_msgs in (None, [], [{"role": 1}], ["x"], [{"role": "user", "content": 3}]):
        with pytest.raises(PromptError):
            chat_tokens(bad_msgs)


@given(st.text(max_size=50), st.integers(min_value=1, max_value=5000), st.integers(min_value=0, max_value=50))
def test_output_length_rule(text: str, max_tokens: int, min_tokens: int) -> None:
    min_tokens = min(min_tokens, max_tokens)
    n, reason = output_length(text, max_tokens, ignore_eos=False, min_tokens=min_tokens, mean_tokens=100,
                              seed=None)
    assert (n, reason) == output_length(text, max_tokens, ignore_eos=False, min_tokens=min_tokens,
                                        mean_tokens=100, seed=None)
    assert max(1, min_tokens) <= n <= max_tokens
    assert reason == ("length" if n == max_tokens else "stop")
    assert output_length(text, max_tokens, ignore_eos=True, min_tokens=0, mean_tokens=100, seed=None) == \
        (max_tokens, "length")


def test_output_length_mean_is_roughly_the_configured_mean() -> None:
    lens = [output_length(f"p{i}", 10**6, ignore_eos=False, min_tokens=0, mean_tokens=200, seed=None)[0]
            for i in range(4000)]
    assert 180 < sum(lens) / len(lens) < 220


def test_kv_store_claim_release_ttl() -> None:
    store = KvStore("e1", "127.0.0.1", 9, ttl_s=10.0, block_size=16)
    d = KvDirectory()
    d.register(store)
    h = store.issue("r", 33, now=0.0)
    assert h["remote_block_ids"] == [0, 1, 2] and h["remote_engine_id"] == "e1"
    assert store.held_tokens() == 33
    with pytest.raises(HandleError):
        d.claim({**h, "remote_block_ids": [7]}, now=1.0)
    _, hold = d.claim(h, now=1.0)
    with pytest.raises(HandleError, match="already pulled"):
        d.claim(h, now=2.0)
    store.sweep(100.0)
    assert store.held_tokens() == 33  # claimed holds never expire
    store.release(hold)
    assert store.held_tokens() == 0
    h2 = store.issue("r", 5, now=0.0)
    assert h2["remote_block_ids"] == [3]
    with pytest.raises(HandleError, match="unknown or expired"):
        d.claim(h2, now=10.0)
    with pytest.raises(HandleError, match="unknown or unreachable"):
        d.claim({**h2, "remote_engine_id": "other"}, now=0.0)
    store.up = False
    with pytest.raises(HandleError):
        d.claim(store.issue("r", 5, now=0.0), now=0.0)


def test_hist_and_buckets() -> None:
    h = Hist([0.1, 1.0])
    h.observe(0.1)
    h.observe(0.5, 3)
    h.observe(7.0)
    assert h.cumulative() == [("0.1", 1.0), ("1.0", 4.0), ("+Inf", 5.0)]
    assert h.sum == pytest.approx(0.1 + 1.5 + 7.0) and h.count == 5
    assert buckets_1_2_5(60) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0)


def test_config_validation() -> None:
    for bad in ({"decode": 0}, {"slots": 0}, {"time_scale": 0}, {"a": 0, "b": 0}, {"a": -1},
                {"base_port": 70000}, {"kv_ttl_s": -1}, {"block_size": 0}, {"decode": 150}):
        with pytest.raises(ValueError):
            FleetConfig(**bad)  # type: ignore[arg-type]
    cfg = FleetConfig(base_port=18000, prefill=2, decode=3)
    assert [cfg.prefill_port(i) for i in range(2)] == [18000, 18001]
    assert [cfg.decode_port(g) for g in range(3)] == [18100, 18101, 18102]
    assert FleetConfig(base_port=0).decode_port(5) == 0


def test_fault_state_http_count_and_clear() -> None:
    f = FaultState()
    f.apply({"http_status": 503, "http_count": 1, "cut_after": 4}, now=0.0)
    assert f.take_http_error() == 503 and f.take_http_error() == 0
    assert f.stream.cut_after == 4 and f.stream.any
    f.apply({"stall_s": 2.0}, now=10.0)
    assert f.stalled(11.0) and not f.stalled(12.5)
    f.apply({"clear": True}, now=0.0)
    assert not f.stream.any and f.slow == 1.0


def test_async_fleet_api_and_prefill_stream_with_kv_params() -> None:
    async def main() -> None:
        cfg = FleetConfig(prefill=1, decode=1, base_port=0, time_scale=0.25)
        async with Fleet(cfg) as fleet, httpx.AsyncClient(timeout=10) as client:
            assert len(fleet.prefill_urls) == 1 and len(fleet.decode_urls) == 1
            body = {"prompt": words(40), "max_tokens": 1, "stream": True,
                    "stream_options": {"include_usage": True},
                    "kv_transfer_params": {"do_remote_decode": True}}
            r = await client.post(fleet.prefill_urls[0] + "/v1/completions", json=body)
            payloads = sse_events(r.content)
            assert check_stream(payloads, chat=False, include_usage=True, prompt_tokens=40) == 1
            last = json.loads(payloads[-3])
            kv = last["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True
            assert "kv_transfer_params" not in json.loads(payloads[-2])  # usage chunk
            d = await client.post(fleet.decode_urls[0] + "/v1/completions",
                                  json={"prompt": words(40), "max_tokens": 3, "kv_transfer_params": kv})
            assert d.status_code == 200 and d.json()["usage"]["completion_tokens"] == 3
            await fleet.inject("prefill/0", crash_s=-1)  # the crash is spawned, not awaited
            deadline = asyncio.get_running_loop().time() + 10
            while True:  # until the crash has closed the listener (a condition, bounded)
                try:
                    await client.get(fleet.prefill_urls[0] + "/health")
                except httpx.ConnectError:
                    break
                except httpx.RemoteProtocolError:
                    pass  # a kept-alive connection the crash closed under this request: not refused yet
                assert asyncio.get_running_loop().time() < deadline, "the crashed server still answers"
                await asyncio.sleep(0.005)
            assert not fleet.prefill_servers[0].up
            await fleet.recover("prefill", 0)
            assert (await client.get(fleet.prefill_urls[0] + "/health")).status_code == 200

    asyncio.run(main())
