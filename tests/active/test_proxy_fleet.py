"""The active proxy against the simulated fleet (in-process fleet, real HTTP): plain fleets are
routed; the pool TTL reaper answers 503 and releases the abandoned prefill KV on the prefiller;
prefill KV back-pressure pauses a prefiller over its budget and resumes it below the low mark."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import httpx
import openai
import pytest

from shadow.active.metrics import ActiveMetrics
from shadow.active.prefill import PrefillChooser
from shadow.fleet import FleetConfig
from tests.active.stubs import metric, proxy_on, until
from tests.harness import FleetThread

pytestmark = pytest.mark.integration


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_plain_fleet_is_routed_streamed_and_not() -> None:
    with FleetThread(FleetConfig(prefill=0, decode=2, slots=4, base_port=0, time_scale=0.1)) as ft:

        async def scenario() -> None:
            decode = {f"d{i}": u for i, u in enumerate(ft.decode_urls)}
            async with proxy_on(decode, slots=4) as (proxy, url):
                client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

                async def one(i: int) -> int:
                    stream = await client.completions.create(
                        model="sim-llm",
                        prompt="w " * (10 + 30 * i),
                        max_tokens=5 + i,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    return len([1 async for ch in stream if ch.choices and ch.choices[0].text])

                got = await asyncio.gather(*(one(i) for i in range(12)))  # 12 > 2 × 4 slots: the pool fills
                assert got == [5 + i for i in range(12)]
                whole = await client.completions.create(
                    model="sim-llm", prompt="a b", max_tokens=3, extra_body={"ignore_eos": True}
                )
                assert whole.usage is not None and whole.usage.completion_tokens == 3
                chat = await client.chat.completions.create(
                    model="sim-llm",
                    messages=[{"role": "user", "content": "hi there"}],
                    max_tokens=4,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                assert len([1 async for ch in chat if ch.choices and ch.choices[0].delta.content]) == 4
                await client.close()
                assert (
                    metric(proxy, "shadow_router_requests_total", mode="active", policy="br0", outcome="ok")
                    == 14
                )
                assert metric(proxy, "shadow_pool_wait_seconds_count") == 14
                assert not proxy.ledger.legs and not proxy.dispatcher.waiting
                for u in ft.decode_urls:  # the fleet's own view: nothing left running
                    assert httpx.get(u + "/load", timeout=5).json()["server_load"] == 0

        run(scenario)


def _prefill_state(url: str) -> dict[str, int]:
    return httpx.get(url + "/fleet/state", timeout=5).json()  # type: ignore[no-any-return]


def test_pool_ttl_reaper_answers_503_and_releases_prefill_kv() -> None:
    with FleetThread(FleetConfig(prefill=1, decode=1, slots=1, base_port=0, time_scale=0.2)) as ft:

        async def scenario() -> None:
            pre = ft.prefill_urls[0]
            async with (
                proxy_on(
                    {"d0": ft.decode_urls[0]}, prefill={"p0": pre}, slots=1, pool_ttl_s=0.5, tick_s=0.02
                ) as (proxy, url),
                httpx.AsyncClient(timeout=60) as c,
            ):
                long = {
                    "model": "sim-llm",
                    "prompt": "a b c",
                    "max_tokens": 20000,
                    "stream": True,
                    "ignore_eos": True,
                }
                started = asyncio.Event()

                async def occupy() -> None:
                    async with c.stream("POST", url + "/v1/completions", json=long) as r:
                        async for _ in r.aiter_raw():
                            started.set()

                holder = asyncio.create_task(occupy())
                await started.wait()
                late = await c.post(url + "/v1/completions", json={**long, "max_tokens": 3})
                assert late.status_code == 503 and late.json()["error"]["type"] == "pool_timeout"
                assert metric(proxy, "shadow_pool_reaped_total") == 1
                assert (
                    metric(
                        proxy, "shadow_router_requests_total", mode="active", policy="br0", outcome="rejected"
                    )
                    == 1
                )
                assert _prefill_state(pre)["kv_held_tokens"] > 0  # nobody will pull it ...
                holder.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await holder
                await until(lambda: not proxy.ledger.legs, what="the slot freed")
                ok = await c.post(url + "/v1/completions", json={**long, "max_tokens": 3, "stream": False})
                assert ok.status_code == 200
                st = _prefill_state(pre)  # ... so the next prefill leg told the prefiller to drop it
                assert st["kv_aborted"] == 1 and st["kv_held_tokens"] == 0

        run(scenario)


def test_prefill_kv_back_pressure_pauses_and_resumes_with_hysteresis() -> None:
    from prometheus_client import CollectorRegistry

    async def scenario() -> None:
        m = ActiveMetrics(CollectorRegistry())
        ch = PrefillChooser({"p0": "http://a", "p1": "http://b"}, m, pause_at=0.9, resume_at=0.8)
        ch.update_kv("p0", 0.95)
        assert ch.pick() is not None and ch.pick().name == "p1"  # type: ignore[union-attr]
        ch.update_kv("p1", 0.91)
        assert ch.pick() is None
        waiter = asyncio.create_task(ch.acquire(100.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        ch.update_kv("p1", 0.85)  # between the marks: still paused
        await asyncio.sleep(0)
        assert not waiter.done()
        ch.update_kv("p0", 0.5)  # below the low mark: resumes
        p = await asyncio.wait_for(waiter, 5)
        assert p.name == "p0" and p.requests == 1
        assert m.backpressure.labels("prefill_kv")._value.get() == 1

    run(scenario)
