"""One step clock for all ranks: with one rank loaded far above the others, every rank's
inter-token interval follows the loaded rank's step time."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time

import httpx
import pytest
from fleet_helpers import metric_value

from shadow.fleet import FleetConfig, FleetThread

pytestmark = pytest.mark.timeout(60)


async def stream_times(client: httpx.AsyncClient, url: str, body: dict) -> list[float]:
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    return times


def median_itl(times: list[float]) -> float:
    return statistics.median(b - a for a, b in itertools.pairwise(times[1:]))  # skip the TTFT gap


def test_every_rank_follows_the_loaded_rank() -> None:
    a, b = 2.0e-6, 0.004
    cfg = FleetConfig(prefill=0, decode=3, slots=64, base_port=0, time_scale=1.0, a=a, b=b, prefill_c1=0.0)
    load_prompt = list(range(1000))  # 1000 prompt tokens each, as token ids
    n_load = 20

    async def main(ft: FleetThread) -> tuple[float, float, float, int]:
        async with httpx.AsyncClient(timeout=30) as client:
            probe = {"prompt": "x", "max_tokens": 25, "ignore_eos": True, "stream": True}
            idle = median_itl(await stream_times(client, ft.decode_urls[1], probe))
            load = {"prompt": load_prompt, "max_tokens": 400, "ignore_eos": True}
            loaders = [asyncio.create_task(client.post(ft.decode_urls[0] + "/v1/completions", json=load))
                       for _ in range(n_load)]
            await asyncio.sleep(0.3)
            r1, r2 = await asyncio.gather(stream_times(client, ft.decode_urls[1], probe),
                                          stream_times(client, ft.decode_urls[2], probe))
            state = (await client.get(ft.decode_urls[1] + "/fleet/state")).json()
            m = (await client.get(ft.decode_urls[0] + "/metrics")).text
            assert metric_value(m, "shadow_fleet_steps_total") > 25
            assert metric_value(m, "shadow_fleet_load_tokens", engine="0") > n_load * 1000
            assert metric_value(m, "shadow_fleet_step_duration_seconds_count") > 25
            for t in loaders:
                t.cancel()
            await asyncio.gather(*loaders, return_exceptions=True)
            return idle, median_itl(r1), median_itl(r2), state["clock"]["last_max_load"]

    with FleetThread(cfg) as ft:
        idle, itl1, itl2, max_load = asyncio.run(main(ft))
    expected = a * max_load + b  # ≈ 2e-6 × 20 × ~1.1 k + 4 ms ≈ 48 ms
    assert max_load > n_load * 1000
    assert idle < 0.02
    for itl in (itl1, itl2):
        assert itl == pytest.approx(expected, rel=0.25), (itl, expected)
