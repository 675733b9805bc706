"""Reconciliation against worker /metrics, the drop queue, and the exported metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry

from shadow.contracts.events import Route
from shadow.mirror.dropqueue import DropQueue
from shadow.mirror.hub import Mirror
from shadow.mirror.metrics import MirrorCollector
from shadow.mirror.reconcile import Reconciler
from shadow.mirror.state import MirrorState
from shadow.vllm.metrics import parse_vllm_metrics

V033 = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""
OLD = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.125
"""


def test_parse_vllm_metrics_sums_engines_and_accepts_the_old_kv_name() -> None:
    load = parse_vllm_metrics(V033)
    assert (load.running, load.waiting, load.kv_usage) == (5.0, 1.0, 0.375)
    old = parse_vllm_metrics(OLD)
    assert (old.running, old.waiting, old.kv_usage) == (1.0, None, 0.125)
    assert parse_vllm_metrics("").running is None


def test_reconciler_drift_errors_and_gauges() -> None:
    state = MirrorState(["d0", "d1", "d2"])
    for i in range(7):
        state.apply(Route(f"r{i}", 0, "d0", 100), 0)
    state.apply(Route("x", 0, "d1", 100), 0)

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "w0":
            return httpx.Response(200, text=V033)
        if req.url.host == "w1":
            return httpx.Response(200, text=OLD)
        return httpx.Response(500)

    clock = [100.0]
    rec = Reconciler(
        {"d0": "http://w0/metrics", "d1": "http://w1/metrics", "d2": "http://w2/metrics"},
        state,
        kv_capacity_tokens={"d1": 400},
        transport=httpx.MockTransport(handler),
        clock=lambda: clock[0],
    )

    async def go() -> None:
        await rec.scrape_once()
        await rec.scrape_once()
        await rec.aclose()

    asyncio.run(go())
    assert rec.workers["d0"].drift_requests == 7 - 6
    assert rec.workers["d1"].drift_requests == 0
    assert rec.workers["d1"].drift_kv_ratio == pytest.approx(100 / 400 - 0.125)
    assert rec.workers["d2"].errors == 2 and rec.workers["d2"].last_ok is None
    mirror = Mirror(state)
    reg = CollectorRegistry()
    reg.register(MirrorCollector(mirror, reconciler=rec, clock=lambda: clock[0] + 2.5))
    assert reg.get_sample_value("shadow_mirror_drift_requests", {"worker": "d0"}) == 1
    assert reg.get_sample_value("shadow_mirror_scrape_age_seconds", {"worker": "d0"}) == 2.5
    assert reg.get_sample_value("shadow_mirror_scrape_errors_total", {"worker": "d2"}) == 2
    assert reg.get_sample_value("shadow_mirror_worker_kv_usage_ratio", {"worker": "d0"}) == 0.375
    assert reg.get_sample_value("shadow_mirror_drift_requests", {"worker": "d2"}) is None


def test_drop_queue_drops_data_but_never_end_markers() -> None:
    q = DropQueue(2)
    assert q.put("a") and q.put("b")
    assert not q.put("c") and q.dropped == 1
    q.put_end("end1")
    assert len(q) == 3
    assert q.get_nowait_batch(1) == ["a"]
    assert q.get_nowait_batch(10) == ["b", "end1"]  # after everything queued before it

    async def waiter() -> list[str]:
        async def later() -> None:
            await asyncio.sleep(0.01)
            q.put("z")

        asyncio.get_running_loop().create_task(later())
        return await q.get_batch(10)

    assert asyncio.run(waiter()) == ["z"]
    with pytest.raises(ValueError):
        DropQueue(0)


def _running(n: int) -> str:
    return f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {n}\n"


def test_a_worker_that_refuses_connections_drifts_by_what_the_mirror_counts_on_it() -> None:
    """A dead rank (connection refused or not connectable in time) runs nothing and takes nothing: its
    drift is its slots, or its mirrored requests when more; a worker that answers (even an error)
    is not gone; a rank back up is compared as usual again."""
    state = MirrorState(["d0", "d1", "d2"], slots=8)
    for i in range(3):
        state.apply(Route(f"r{i}", 0, "d0", 100), 0)
    for i in range(10):
        state.apply(Route(f"s{i}", 0, "d1", 100), 0)
    up = {"w0": 3}

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "w2":
            return httpx.Response(503)
        if req.url.host == "w1":
            raise httpx.ConnectTimeout("timed out", request=req)
        if req.url.host in up:
            return httpx.Response(200, text=_running(up[req.url.host]))
        raise httpx.ConnectError("[Errno 111] Connection refused", request=req)

    def reconciler(slots: int | None) -> Reconciler:
        return Reconciler({"d0": "http://w0/metrics", "d1": "http://w1/metrics", "d2": "http://w2/metrics"},
                          state, slots=slots, transport=httpx.MockTransport(handler))

    rec = reconciler(8)

    async def scrape(r: Reconciler) -> dict[str, float | None]:
        await r.scrape_once()
        return {n: w.drift_requests for n, w in r.workers.items()}

    async def go() -> None:
        assert await scrape(rec) == {"d0": 0.0, "d1": 10.0, "d2": None}
        del up["w0"]  # d0 is killed: the mirror still counts its 8 slots (3 running, 5 free)
        assert await scrape(rec) == {"d0": 8.0, "d1": 10.0, "d2": None}
        assert rec.workers["d0"].last_error == "ConnectError" and rec.workers["d0"].errors == 1
        up["w0"] = 0  # back, empty, while the mirror still holds 3 requests there
        assert (await scrape(rec))["d0"] == 3.0
        no_slots = reconciler(None)  # slots unknown: the requests the mirror holds there
        del up["w0"]
        assert await scrape(no_slots) == {"d0": 3.0, "d1": 10.0, "d2": None}
        await rec.aclose()
        await no_slots.aclose()

    asyncio.run(go())
