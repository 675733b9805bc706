"""Reconciliation against worker /metrics, the drop queue, and the exported metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry

from shadow.contracts.events import Finish, Route
from shadow.dataplane.dropqueue import DropQueue
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


def test_the_drift_waits_for_the_analysis_to_take_in_what_the_taps_had_seen() -> None:
    """A burst of starts the worker counts (6 running + waiting on V033's engines) and the analysis has
    not reached when the scrape returns: the round's `settle` lets it catch up before the drift is
    taken, so it reads 0, not -6; a settle that times out or raises is counted and the drift taken as
    it is."""
    state = MirrorState(["d0"])
    pending = [Route(f"r{i}", 0, "d0", 100) for i in range(6)]  # seen by the taps, not yet analysed
    outcome: list[bool | None] = [True]

    async def settle() -> bool:
        while pending:
            state.apply(pending.pop(), 0)
        if outcome[0] is None:
            raise OSError("the analysis' channel broke")
        return outcome[0]

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=V033)

    page = {"d0": "http://w0/metrics"}
    rec = Reconciler(page, state, transport=httpx.MockTransport(handler), settle=settle)
    late = Reconciler(page, MirrorState(["d0"]), transport=httpx.MockTransport(handler))

    async def go() -> None:
        await rec.scrape_once()
        outcome[0] = False
        await rec.scrape_once()
        outcome[0] = None  # a settle that raises: the round goes on (scrape_once never raises)
        await rec.scrape_once()
        await late.scrape_once()
        await rec.aclose()
        await late.aclose()

    asyncio.run(go())
    assert rec.workers["d0"].drift_requests == 0 and rec.unsettled == 2 and rec.scrapes == 3
    assert late.workers["d0"].drift_requests == -6 and late.unsettled == 0  # (no settle: as before)
    reg = CollectorRegistry()
    reg.register(MirrorCollector(Mirror(state), reconciler=rec))
    assert reg.get_sample_value("shadow_mirror_drift_unsettled_total") == 2


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


def _dp_page(running: tuple[int, int], done: tuple[int, int], kv: tuple[float, float] = (0.0, 0.0)) -> str:
    """A DP server's page as vLLM 0.32 writes it (one series per engine, capacity in cache_config_info)."""
    lines = ["# TYPE vllm:num_requests_running gauge"]
    lines += [f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {running[e]}' for e in (0, 1)]
    lines += ["# TYPE vllm:num_requests_waiting gauge"]
    lines += [f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} 0' for e in (0, 1)]
    lines += ["# TYPE vllm:kv_cache_usage_perc gauge"]
    lines += [f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {kv[e]}' for e in (0, 1)]
    lines += ["# TYPE vllm:cache_config_info gauge"]
    lines += [f'vllm:cache_config_info{{block_size="128",engine="{e}",'
              f'kv_cache_size_tokens="{1000 * (e + 1)}",num_gpu_blocks="8"}} 1.0' for e in (0, 1)]
    lines += ["# TYPE vllm:request_success counter"]
    for e in (0, 1):
        series = f'vllm:request_success_total{{engine="{e}",model_name="m",finished_reason='
        lines += [f'{series}"length"}} {done[e]}', f'{series}"abort"}} 0']
    return "\n".join(lines) + "\n"


def test_a_dp_page_is_read_per_engine_and_summed() -> None:
    load = parse_vllm_metrics(_dp_page((3, 1), (10, 4), (0.5, 0.25)))
    assert (load.running, load.finished, load.kv_capacity_tokens) == (4.0, 14.0, 3000.0)
    assert load.kv_usage == pytest.approx((0.5 * 1000 + 0.25 * 2000) / 3000)  # weighted by capacity
    e1 = load.engine("1")
    assert e1 is not None
    assert (e1.running, e1.finished, e1.kv_capacity_tokens, e1.kv_usage) == (1, 4, 2000, 0.25)
    assert load.engine("7") is None


def test_workers_that_are_engines_of_one_dp_server_reconcile_against_their_engine_scraped_once() -> None:
    state = MirrorState(["r0", "r1"])
    for i in range(3):
        state.apply(Route(f"a{i}", 0, "r0", 100), 0)
    state.apply(Route("b", 0, "r1", 100), 0)
    pages = []

    def handler(req: httpx.Request) -> httpx.Response:
        pages.append(str(req.url))
        return httpx.Response(200, text=_dp_page((3, 1), (0, 0), (0.3, 0.05)))

    rec = Reconciler({"r0": "http://dp/metrics#engine=0", "r1": "http://dp/metrics#engine=1"}, state,
                     transport=httpx.MockTransport(handler))
    asyncio.run(rec.scrape_once())
    assert pages == ["http://dp/metrics"]
    assert rec.workers["r0"].drift_requests == 0 and rec.workers["r1"].drift_requests == 0
    assert rec.workers["r0"].load is not None and rec.workers["r0"].load.running == 3
    # plain-mode KV against the engine's usage × its own capacity (from cache_config_info)
    assert rec.workers["r1"].kv_capacity_tokens == 2000
    assert rec.workers["r1"].drift_kv_ratio == pytest.approx(100 / 2000 - 0.05)
    with pytest.raises(ValueError, match="engine=N"):
        Reconciler({"x": "http://dp/metrics#rank=1"}, state)


def test_streams_the_engine_finished_but_still_draining_to_the_client_are_not_drift() -> None:
    """The engine finished 5 of the mirror's 6 requests on d0 (its success counter went up, its
    running count down) while their streams still drain to a slow client: 5 draining, drift 0. A
    request the engine never had is still drift."""
    state = MirrorState(["d0"])
    page = {"running": (0, 0), "done": (7, 0)}  # 7 finished before the mirror started

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=_dp_page(page["running"], page["done"]))

    rec = Reconciler({"d0": "http://w/metrics"}, state, transport=httpx.MockTransport(handler))
    asyncio.run(rec.scrape_once())  # quiet: both sides run nothing
    assert rec.workers["d0"].drift_requests == 0 and rec.workers["d0"].draining == 0
    for i in range(6):
        state.apply(Route(f"r{i}", 0, "d0", 10), 0)
    page.update(running=(1, 0), done=(12, 0))
    asyncio.run(rec.scrape_once())
    w = rec.workers["d0"]
    assert (w.draining, w.drift_requests) == (5, 0)
    state.apply(Route("phantom", 0, "d0", 10), 0)
    asyncio.run(rec.scrape_once())
    assert (w.draining, w.drift_requests) == (5, 1)
    for i in range(6):
        state.apply(Finish(f"r{i}", 1.0, "length", 1), 1.0)
    page.update(running=(0, 0), done=(13, 0))
    asyncio.run(rec.scrape_once())
    assert (w.draining, w.drift_requests) == (0, 1)


def test_the_drift_is_taken_over_the_round_so_ends_the_page_had_not_counted_are_not_drift() -> None:
    """A worker's page is its state at one instant of the round; the mirror moves meanwhile. Six
    requests end while the round's scrape is in flight, after the page was written (it still counts
    them running, its success counter not yet): the mirror matches the page at the round's start, so
    the drift is 0 (before: -6, and a burst of such ends tripped fallback under load). A request the
    worker has and the mirror never had during the round is still drift."""
    state = MirrorState(["d0"])
    page = {"running": (0, 0), "done": (0, 0)}
    during: list[list[Finish | Route]] = [[]]

    def handler(req: httpx.Request) -> httpx.Response:
        text = _dp_page(page["running"], page["done"])  # the page is written first ...
        for ev in during[0]:  # ... then the taps see these and the analysis takes them in
            state.apply(ev, 1.0)
        during[0] = []
        return httpx.Response(200, text=text)

    rec = Reconciler({"d0": "http://w/metrics"}, state, transport=httpx.MockTransport(handler))
    w = rec.workers["d0"]
    asyncio.run(rec.scrape_once())  # quiet: both sides run nothing
    for i in range(6):
        state.apply(Route(f"r{i}", 0, "d0", 10), 0)
    page.update(running=(4, 2))
    during[0] = [Finish(f"r{i}", 1.0, "length", 1) for i in range(6)]
    asyncio.run(rec.scrape_once())
    assert state.active("d0") == 0 and (w.draining, w.drift_requests) == (0, 0)
    page.update(running=(0, 0), done=(6, 0))
    asyncio.run(rec.scrape_once())
    assert (w.draining, w.drift_requests) == (0, 0)
    state.apply(Route("a", 0, "d0", 10), 0)
    state.apply(Route("b", 0, "d0", 10), 0)
    page.update(running=(3, 2))  # five on the worker, two in the mirror all round long
    asyncio.run(rec.scrape_once())
    assert w.drift_requests == -3
    asyncio.run(rec.aclose())
