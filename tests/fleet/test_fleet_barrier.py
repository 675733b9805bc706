"""One step clock for all ranks: with one rank loaded far above the others, every rank's
inter-token interval follows the loaded rank's step time.

Measured where machine load cannot bend it: the step times are the clock's model time
(`/fleet/state`: model seconds per step over each probe stream), and the client's own check is
a lower bound no delay can break (a probe's tokens cannot arrive before the loaded steps that
carry them ended). The probes start once every loader runs (a condition, not a sleep)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fleet_helpers import metric_value

from shadow.fleet import FleetConfig
from tests.harness import FleetThread

pytestmark = pytest.mark.timeout(60)

PROBE_TOKENS = 25


async def stream_times(client: httpx.AsyncClient, url: str, body: dict) -> list[float]:
    """Send time, then one arrival time per token event."""
    times = [time.monotonic()]
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    return times


async def clock(client: httpx.AsyncClient, url: str) -> dict:
    return (await client.get(url + "/fleet/state")).json()["clock"]  # type: ignore[no-any-return]


def per_step(c0: dict, c1: dict) -> float:
    """Model seconds per step of the shared clock between two readings."""
    return float((c1["model_s"] - c0["model_s"]) / (c1["steps"] - c0["steps"]))


def test_every_rank_follows_the_loaded_rank() -> None:
    a, b = 2.0e-6, 0.004
    cfg = FleetConfig(prefill=0, decode=3, slots=64, base_port=0, time_scale=1.0, a=a, b=b, prefill_c1=0.0)
    load_prompt = list(range(1000))  # 1000 prompt tokens each, as token ids
    n_load, load_tokens = 20, 400

    async def main(ft: FleetThread) -> None:
        d0, d1, d2 = ft.decode_urls
        async with httpx.AsyncClient(timeout=30) as client:
            probe = {"prompt": "x", "max_tokens": PROBE_TOKENS, "ignore_eos": True, "stream": True}
            c0 = await clock(client, d1)
            idle_times = await stream_times(client, d1, probe)
            idle = per_step(c0, await clock(client, d1))
            assert len(idle_times) == PROBE_TOKENS + 1
            # alone on the clock: a step is b plus the probe's few tokens (≤ 1 + 25) times a
            assert b <= idle <= b + a * (1 + PROBE_TOKENS), idle

            load = {"prompt": load_prompt, "max_tokens": load_tokens, "ignore_eos": True}
            loaders = [asyncio.create_task(client.post(d0 + "/v1/completions", json=load))
                       for _ in range(n_load)]
            deadline = time.monotonic() + 30
            while True:  # until every loader runs on rank 0 (a condition: under load they arrive late)
                m = (await client.get(d0 + "/metrics")).text
                running = metric_value(m, "vllm:num_requests_running")
                if running == n_load:
                    break
                assert time.monotonic() < deadline, f"{running:g} of {n_load} loaders running"
                assert not any(t.done() for t in loaders), [t.result() for t in loaders if t.done()]
                await asyncio.sleep(0.01)
            c0 = await clock(client, d1)
            t1, t2 = await asyncio.gather(stream_times(client, d1, probe), stream_times(client, d2, probe))
            c1 = await clock(client, d1)
            m = (await client.get(d0 + "/metrics")).text
            assert metric_value(m, "vllm:num_requests_running") == n_load, "a loader ended under the probes"
            for t in loaders:
                t.cancel()
            await asyncio.gather(*loaders, return_exceptions=True)

        # every step the probes lived through was the loaded rank's: a·L + b with L its load
        # (20 × 1000 prompt tokens plus what the loaders generated meanwhile, at most 400 each)
        low, high = a * n_load * 1000 + b, a * n_load * (1000 + load_tokens) + b  # 44 … 60 ms
        assert low <= per_step(c0, c1) <= high, (per_step(c0, c1), low, high)
        assert low > 4 * idle
        for times in (t1, t2):  # ranks 1 and 2: idle themselves, held to rank 0's steps
            assert len(times) == PROBE_TOKENS + 1
            # each token ends a loaded step; steps end on the clock's timeline, and the first one
            # can be back-dated by less than its own length: a lower bound no delay can break
            took, bound = times[-1] - times[0], (PROBE_TOKENS - 1) * low
            assert took >= bound, (took, bound)

    with FleetThread(cfg) as ft:
        asyncio.run(main(ft))
