"""The simulated fleet's bookkeeping after real work: KV load returns to zero and the step time to
the model's `a·L + b` once requests finish naturally; a rank never runs more requests than its
slots (checked on the engine step by step and through `/metrics`).

Seeded bugs these kill: a natural finish releasing only the generated tokens (load stays
inflated, steps stay long), and admission with `<=` instead of `<` (one request past the slots).

The engine + clock tests run on an event loop with virtual time (timers fire at once, the clock
jumps), so step durations are the model's exactly and nothing depends on machine speed.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time

import httpx
import pytest
from fleet_helpers import metric_value, run_virtual, words

from shadow.core.stepmodel import StepTimeModel
from shadow.fleet import FleetConfig
from shadow.fleet.clock import StepClock
from shadow.fleet.engine import DecodeEngine, Seq
from shadow.fleet.faults import FaultState
from tests.harness import FleetThread

pytestmark = pytest.mark.timeout(60)

class Rig:
    """`n` decode engines on one step clock with model (a, b), as the fleet wires them."""

    def __init__(self, n: int, slots: int, a: float, b: float) -> None:
        self.engines = [
            DecodeEngine(str(g), slots=slots, kv_capacity_tokens=1 << 24, block_size=16,
                         max_model_len=1 << 20, faults=FaultState(), on_work=self._poke)
            for g in range(n)
        ]
        self.clock = StepClock(self.engines, StepTimeModel(a, b), time_scale=1.0, prefill_c1=0.0)
        self.a, self.b = a, b
        self._n = 0

    def _poke(self) -> None:
        self.clock.poke()

    def submit(self, g: int, prompt: int, target: int, reason: str = "stop") -> Seq:
        self._n += 1
        seq = Seq(f"r{self._n}", prompt, target, reason, target, asyncio.get_running_loop().time())
        self.engines[g].submit(seq)
        return seq


async def until_finished(seqs: list[Seq]) -> None:
    for s in seqs:
        while not s.finished:
            await s.wait_beyond(s.generated)


def test_load_returns_to_zero_and_step_time_to_b_after_natural_finishes() -> None:
    a, b = 1e-5, 0.02  # a·3000 = 30 ms: a phantom prompt would more than double the step

    async def main() -> None:
        rig = Rig(2, slots=8, a=a, b=b)
        clock_task = asyncio.create_task(rig.clock.run())
        # Different output lengths so requests finish in different steps beside running ones.
        first = [rig.submit(i % 2, prompt=3000 + 7 * i, target=3 + i,
                            reason="stop" if i % 3 else "length") for i in range(6)]
        await until_finished(first)
        for i, s in enumerate(first):
            assert (s.generated, s.finish_reason) == (3 + i, "stop" if i % 3 else "length")
        for e in rig.engines:
            assert e.load == 0, (
                f"rank {e.engine_label}: KV load {e.load} tokens after every request finished "
                "naturally (expected 0: prompt and generated tokens are released on finish)")
            assert e.kv_blocks() == 0 and e.num_running() == 0 and e.num_waiting() == 0
        # One small request: every step it runs costs a·L + b with L its own tokens only.
        small = rig.submit(0, prompt=10, target=4)
        steps_before = rig.clock.steps
        await until_finished([small])
        assert rig.clock.steps - steps_before == 4
        assert rig.clock.last_max_load == 10 + 3, (
            f"the last step was charged a load of {rig.clock.last_max_load} tokens, but the only running "
            "request holds 13 (load from finished requests was not released)")
        want = a * 13 + b
        assert rig.clock.last_step_s == pytest.approx(want, rel=1e-9), (
            f"step time {rig.clock.last_step_s * 1e3:.3f} ms after the earlier requests finished; the "
            f"model gives a·13 + b = {want * 1e3:.3f} ms (≈ b: nothing else runs)")
        assert rig.engines[0].load == 0 and rig.engines[1].load == 0
        clock_task.cancel()

    run_virtual(main)


def test_step_time_follows_the_loaded_rank_and_falls_back_as_requests_end() -> None:
    """Durations of consecutive steps: max_g(a·L_g + b), with L_g shrinking as requests finish."""
    a, b = 1e-5, 0.02

    async def main() -> list[tuple[int, float]]:
        rig = Rig(2, slots=4, a=a, b=b)
        seen: list[tuple[int, float]] = []
        finish_step = rig.engines[0].finish_step

        def spy(now: float, prefilled: int) -> None:
            seen.append((rig.engines[0].load, now))
            finish_step(now, prefilled)

        rig.engines[0].finish_step = spy  # type: ignore[method-assign]
        clock_task = asyncio.create_task(rig.clock.run())
        seqs = [rig.submit(0, prompt=1000, target=2), rig.submit(0, prompt=500, target=4)]
        await until_finished(seqs)
        clock_task.cancel()
        return seen

    seen = run_virtual(main)
    loads = [load for load, _ in seen]
    # step 1: 1500; step 2: 1502; then the 1000-token request (2 tokens) left: 502, 503
    assert loads == [1500, 1502, 502, 503], f"per-step loads {loads}: finished request not released?"
    durations = [t1 - t0 for (_, t0), (_, t1) in itertools.pairwise(seen)]
    for (load, _), d in zip(seen[1:], durations, strict=True):
        assert d == pytest.approx(a * load + b, rel=1e-9), f"step at load {load} took {d} s"


def test_a_rank_never_runs_more_than_its_slots() -> None:
    slots, n, target = 3, 8, 5

    async def main() -> tuple[list[tuple[int, int]], list[Seq]]:
        rig = Rig(1, slots=slots, a=1e-6, b=0.01)
        engine = rig.engines[0]
        per_step: list[tuple[int, int]] = []
        finish_step = engine.finish_step

        def spy(now: float, prefilled: int) -> None:
            per_step.append((engine.num_running(), engine.num_waiting()))
            finish_step(now, prefilled)

        engine.finish_step = spy  # type: ignore[method-assign]
        clock_task = asyncio.create_task(rig.clock.run())
        seqs = [rig.submit(0, prompt=100, target=target) for _ in range(n)]
        await until_finished(seqs)
        clock_task.cancel()
        return per_step, seqs

    per_step, seqs = run_virtual(main)
    worst = max(r for r, _ in per_step)
    assert worst <= slots, f"a rank with {slots} slots ran {worst} requests in one step"
    assert per_step[0] == (slots, n - slots), (
        f"first step ran/waited {per_step[0]}, expected {(slots, n - slots)} with {slots} slots")
    assert all(r + w <= n for r, w in per_step)
    # FIFO in waves of `slots`: ceil(n / slots) waves of `target` steps each
    assert len(per_step) == math.ceil(n / slots) * target
    starts = [s.scheduled_t for s in seqs]
    assert starts == sorted(starts), "admission is FIFO"
    assert len(set(starts[:slots])) == 1 and starts[slots] > starts[slots - 1]


def test_slots_and_load_through_metrics() -> None:
    """Fill a 2-slot rank with 5 long streams: /metrics shows 2 running and 3 waiting while they
    run; after the streams are cut and after short requests finish naturally, the rank's KV load
    gauge is 0 and the last step's load is the last request's own."""
    cfg = FleetConfig(prefill=0, decode=1, slots=2, base_port=0, time_scale=0.25)
    with FleetThread(cfg) as ft:
        url = ft.decode_urls[0]

        def metrics() -> str:
            return httpx.get(url + "/metrics", timeout=5).text

        async def flood() -> list[tuple[float, float]]:
            body = {"prompt": words(50), "max_tokens": 30_000, "stream": True, "ignore_eos": True}
            samples: list[tuple[float, float]] = []
            async with httpx.AsyncClient(timeout=30) as client:

                async def hold() -> None:
                    async with client.stream("POST", url + "/v1/completions", json=body) as r:
                        assert r.status_code == 200, (await r.aread())[:300]
                        async for _ in r.aiter_raw():
                            pass

                tasks = [asyncio.create_task(hold()) for _ in range(5)]
                for _ in range(400):  # until every request reached the engine
                    m = (await client.get(url + "/metrics")).text
                    running = metric_value(m, "vllm:num_requests_running")
                    waiting = metric_value(m, "vllm:num_requests_waiting")
                    if running + waiting == 5 or any(t.done() for t in tasks):
                        break
                    await asyncio.sleep(0.02)
                assert running + waiting == 5, (
                    f"5 streams sent, /metrics shows running={running:g} waiting={waiting:g}: "
                    f"{[t.result() for t in tasks if t.done()]}")
                # a few more scrapes while steps advance
                steps0 = metric_value(m, "shadow_fleet_steps_total")
                while len(samples) < 5 or metric_value(m, "shadow_fleet_steps_total") < steps0 + 5:
                    assert len(samples) < 2000, "the step clock stopped advancing"
                    m = (await client.get(url + "/metrics")).text
                    samples.append((metric_value(m, "vllm:num_requests_running"),
                                    metric_value(m, "vllm:num_requests_waiting")))
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return samples

        samples = asyncio.run(flood())
        for running, waiting in samples:
            assert running <= 2, f"/metrics shows {running:g} requests running on a rank with 2 slots"
            assert (running, waiting) == (2, 3), f"/metrics shows running={running:g} waiting={waiting:g}"

        def settled() -> str:
            for _ in range(200):
                m = metrics()
                if sum(metric_value(m, f"vllm:num_requests_{s}") for s in ("running", "waiting")) == 0:
                    return m
                time.sleep(0.02)
            return m

        m = settled()
        assert metric_value(m, "vllm:request_success_total", finished_reason="abort") == 5
        assert metric_value(m, "shadow_fleet_load_tokens", engine="0") == 0, "load left after aborts"

        # Natural finishes: four requests of 300 + 6 tokens, then one of 4 + 3.
        with httpx.Client(timeout=30) as c:
            for _ in range(4):
                r = c.post(url + "/v1/completions", json={"prompt": words(300), "max_tokens": 6,
                                                          "ignore_eos": True})
                assert r.json()["usage"]["completion_tokens"] == 6
            m = metrics()
            assert metric_value(m, "shadow_fleet_load_tokens", engine="0") == 0, (
                f"KV load gauge is {metric_value(m, 'shadow_fleet_load_tokens', engine='0'):g} tokens after "
                "every request finished naturally (expected 0)")
            assert metric_value(m, "vllm:request_success_total", finished_reason="length") == 4
            c.post(url + "/v1/completions", json={"prompt": words(4), "max_tokens": 3, "ignore_eos": True})
        m = metrics()
        assert metric_value(m, "shadow_fleet_last_max_load_tokens") == 4 + 2, (
            f"the last step was charged {metric_value(m, 'shadow_fleet_last_max_load_tokens'):g} tokens; "
            "the only request held 6 (finished requests' load not released)")
