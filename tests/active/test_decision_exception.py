"""A decision exception, end to end (issue 10, fallback trigger 1): `shadow serve --active` in this
process (its decode router per policy is injectable) in front of the simulated fleet, a BR-0 router
injected whose rounds raise. The first round that raises trips automatic fallback with reason
`decision_error` (counted once); the requests that round held are placed round-robin and every
stream — those caught in the failing round and those sent after the trip — completes with exactly
its `max_tokens` tokens; later requests are routed and counted as `fallback`/`rr` and never reach
the broken policy again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

import httpx
import openai
import pytest

from shadow.active.modes import ModeConfig
from shadow.app.serve import ActiveSettings, ServeConfig
from shadow.core.policies import make_router
from shadow.core.routers import Router
from shadow.core.snapshot import FleetSnapshot
from shadow.fleet import FleetConfig
from shadow.mirror.config import MirrorConfig
from tests.active.test_fallback_e2e import metric, wait_for
from tests.active.test_mode_flips import metric_sum
from tests.harness import FleetThread, ServeThread

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class RaisingRouter:
    """A pool router whose every round raises (a broken policy)."""

    name = "br0"
    binds_at_arrival = False
    predictor = None

    def __init__(self) -> None:
        self.pool: list[Hashable] = []
        self.rounds = 0

    def on_arrive(self, request_id: Hashable, prompt_tokens: int, now: float,
                  predicted_steps: float | None = None) -> None:
        self.pool.append(request_id)

    def on_finish(self, request_id: Hashable, output_tokens: int, key: Hashable | None = None) -> None:
        return None

    def decide(self, fleet: FleetSnapshot, now: float) -> list[tuple[Hashable, int]]:
        self.rounds += 1
        raise RuntimeError("injected: this policy is broken")

    def waiting(self) -> int:
        return len(self.pool)

    def forget(self, request_id: Hashable) -> bool:
        if request_id in self.pool:
            self.pool.remove(request_id)
            return True
        return False


def test_a_raising_policy_trips_decision_error_and_every_stream_completes() -> None:
    broken: list[RaisingRouter] = []

    def routers(policy: str) -> Router:
        if policy == "br0":
            broken.append(RaisingRouter())
            return broken[-1]
        return make_router(policy)

    with FleetThread(FleetConfig(prefill=1, decode=2, slots=8, base_port=0, time_scale=0.25)) as fleet:
        tap = MirrorConfig(
            {f"d{g}": u for g, u in enumerate(fleet.decode_urls)},
            prefill={"p0": fleet.prefill_urls[0]},
            slots=8,
            scrape_interval_s=0.2,
        )
        config = ServeConfig(
            tap=tap,
            mode_config=ModeConfig(mode="active", policy="br0", check_interval_s=0.05),
            active=ActiveSettings(router_factory=routers),
        )
        with ServeThread(config) as serve:
            api, proxy = serve.ready["api"], serve.ready["active"]
            assert httpx.get(api + "/v1/mode", timeout=5).json()["current"] == "active"
            first = asyncio.run(_streams(proxy, 6, 12))
            m = httpx.get(api + "/v1/mode", timeout=5).json()
            assert m["current"] == "fallback" and m["fallback_reason"] == "decision_error"
            assert m["policy"] == "rr" and m["trips"] == {"decision_error": 1}  # tripped once
            # every raising round was reported (requests that started in active mode before the
            # trip stay br0 requests: each such round raises again, is reported, goes round-robin)
            assert m["observed"]["decision_errors"] == sum(b.rounds for b in broken) >= 1
            assert metric(api, 'shadow_fallback_trips_total{reason="decision_error"}') == 1
            assert metric(api, "shadow_fallback_active") == 1.0
            rounds = sum(b.rounds for b in broken)
            later = asyncio.run(_streams(proxy, 4, 7))
            assert sum(b.rounds for b in broken) == rounds  # fallback requests never reach br0
            assert first == [12] * 6 and later == [7] * 4  # every token of every stream

            def counted() -> bool:
                text = httpx.get(api + "/metrics", timeout=5).text
                req = "shadow_router_requests_total"
                return (metric_sum(text, req, mode="active", policy="br0", outcome="ok") == 6
                        and metric_sum(text, req, mode="fallback", policy="rr", outcome="ok") == 4
                        and metric_sum(text, req) == 10)

            wait_for(counted, "6 active/br0 and 4 fallback/rr requests counted ok")
            svc = serve.serve
            assert svc.proxy is not None and not svc.proxy.dispatcher.waiting


async def _streams(url: str, n: int, max_tokens: int) -> list[int]:
    """`n` concurrent streamed completions; the tokens each received."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

    async def one(i: int) -> int:
        stream = await client.completions.create(
            model="sim-llm", prompt="w " * (10 + i), max_tokens=max_tokens, stream=True,
            extra_body={"ignore_eos": True})
        return len([1 async for ch in stream if ch.choices and ch.choices[0].text])

    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await client.close()
