"""The active proxy's two dispatch options against scripted upstreams (real HTTP on loopback):

- `--pool-bypass` (the paper's BR-0 bypass): a request is placed the moment its prefill is done,
  without entering the Prompt Pool (no pool round runs, its pool wait is exactly 0), by BR-0's
  single-request score over running load (the load source) plus the proxy's dispatched-not-yet-
  running ("virtual") load; it may go beyond a worker's free slots while the worker takes KV
  transfers, and waits in the pool only when every worker is at its transfer cap;
- `--dispatch-ahead N`: pool rounds place up to N requests per worker beyond its free slots
  (running requests as the load source reports them count against the slots), never beyond the
  transfer cap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from shadow.contracts.modes import StaticModeSource
from tests.active.stubs import DONE, FixedSource, Step, Stub, metric, proxy_on, sse, until

BODY = {"model": "m", "prompt": "a b c", "max_tokens": 1, "stream": True}
BR0 = StaticModeSource("active", "br0")


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


class Held:
    """A decode stub whose n-th stream waits for `first[n]` before its token and `end[n]` before
    its end (so a leg stays a KV transfer, then a running request, as long as the test wants)."""

    def __init__(self, n: int = 8) -> None:
        self.first = [asyncio.Event() for _ in range(n)]
        self.end = [asyncio.Event() for _ in range(n)]
        self.stub = Stub(lambda i, body: Step(events=[self.first[i], sse("t", i), self.end[i], DONE]))

    def finish(self, i: int) -> None:
        self.first[i].set()
        self.end[i].set()


def _post(c: httpx.AsyncClient, url: str) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(c.post(url + "/v1/completions", json=BODY))


def test_bypass_places_at_prefill_completion_over_running_plus_virtual_load() -> None:
    """Running KV load 12 on d0, none on d1; every prompt is 5 tokens (the prefill's usage). BR-0's
    single-request score takes the larger margin under the peak: d1, d1, d1 (its virtual load
    5, 10, 15 — now over d0's 12), then d0. Without the virtual load all four would go to d1."""

    async def scenario() -> None:
        pre = Stub([], role="prefill")
        d0, d1 = Held(), Held()
        for s in (pre, d0.stub, d1.stub):
            await s.start()
        async with (
            proxy_on(
                {"d0": d0.stub.url, "d1": d1.stub.url},
                prefill={"p0": pre.url},
                bypass=True,
                kv_backpressure=False,
                modes=BR0,
                source=FixedSource([12.0, 0.0], [0, 0]),
            ) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            order: list[str] = []
            tasks = []
            for i in range(4):
                tasks.append(_post(c, url))
                await until(lambda i=i: len(d0.stub.calls) + len(d1.stub.calls) == i + 1, what=f"leg {i}")
                order.append("d0" if len(d0.stub.calls) > order.count("d0") else "d1")
                assert not proxy.dispatcher.waiting and metric(proxy, "shadow_pool_requests") == 0
            assert order == ["d1", "d1", "d1", "d0"]
            assert proxy.dispatcher.rounds == 0  # no pool round placed anything
            assert metric(proxy, "shadow_pool_wait_seconds_count") == 4
            assert metric(proxy, "shadow_pool_wait_seconds_sum") == 0.0
            assert metric(proxy, "shadow_router_decision_duration_seconds_count", policy="br0") == 4
            for h in (d0, d1):
                for i in range(4):
                    h.finish(i)
            assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))
            assert not proxy.ledger.legs and proxy.ledger.transfers == [0, 0]
        for s in (pre, d0.stub, d1.stub):
            await s.stop()

    run(scenario)


@pytest.mark.parametrize("bypass", [True, False])
def test_bypass_goes_past_full_slots_but_never_past_the_transfer_cap(bypass: bool) -> None:
    """One worker, one slot, two KV transfers. A takes the slot. B: the bypass places it at once
    (the worker queues it, a transfer is free); pool rounds hold it until a slot frees. C (with the
    bypass): both transfers in flight, so it waits in the pool, counted as transfer_cap back-pressure,
    and is placed by a round once a slot is free."""

    async def scenario() -> None:
        h = Held()
        await h.stub.start()
        async with (
            proxy_on({"d0": h.stub.url}, slots=1, transfer_cap=2, bypass=bypass, modes=BR0) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            a = _post(c, url)
            await until(lambda: len(h.stub.calls) == 1, what="A placed")
            b = _post(c, url)
            if bypass:
                await until(lambda: len(h.stub.calls) == 2, what="B placed beyond the free slots")
                assert not proxy.dispatcher.waiting and proxy.ledger.transfers == [2]
                cc = _post(c, url)
                await until(lambda: len(proxy.dispatcher.waiting) == 1, what="C waits: transfer cap")
                assert metric(proxy, "shadow_router_backpressure_total", reason="transfer_cap") >= 1
                assert len(h.stub.calls) == 2
                h.finish(0)
                h.finish(1)
                await until(lambda: len(h.stub.calls) == 3, what="C placed once a slot is free")
                h.finish(2)
                done = await asyncio.gather(a, b, cc)
            else:
                await until(lambda: len(proxy.dispatcher.waiting) == 1, what="B waits in the pool")
                assert len(h.stub.calls) == 1
                h.finish(0)
                await until(lambda: len(h.stub.calls) == 2, what="B placed when A ended")
                h.finish(1)
                done = await asyncio.gather(a, b)
            assert all(r.status_code == 200 for r in done)
            assert not proxy.ledger.legs and not proxy.dispatcher.waiting
        await h.stub.stop()

    run(scenario)


@pytest.mark.parametrize(("ahead", "running"), [(0, 0), (1, 0), (2, 0), (2, 1), (1, 2)])
def test_dispatch_ahead_places_n_beyond_the_free_slots(ahead: int, running: int) -> None:
    """One slot per worker, `running` requests the proxy did not route already on it (the load
    source): pool rounds place max(0, 1 + ahead - running) of three requests at once, the rest
    wait; each end frees room for the next."""

    async def scenario() -> None:
        h = Held()
        await h.stub.start()
        async with (
            proxy_on(
                {"d0": h.stub.url},
                slots=1,
                dispatch_ahead=ahead,
                modes=BR0,
                source=FixedSource([0.0], [running]),
            ) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            tasks = [_post(c, url) for _ in range(3)]
            placed = min(3, max(0, 1 + ahead - running))
            await until(
                lambda: len(h.stub.calls) == placed and len(proxy.dispatcher.waiting) == 3 - placed,
                what=f"{placed} placed, {3 - placed} waiting",
            )
            for _ in range(3):  # settle: a later round places no more than that
                await asyncio.sleep(0)
            assert len(h.stub.calls) == placed
            if running:
                proxy.source = FixedSource([0.0], [0])  # type: ignore[assignment]
                proxy.dispatcher.source = proxy.source
            for i in range(3):
                await until(lambda i=i: len(h.stub.calls) > i, what=f"request {i} placed")
                h.finish(i)
            assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))
            assert not proxy.ledger.legs and not proxy.dispatcher.waiting
        await h.stub.stop()

    run(scenario)


def test_dispatch_ahead_never_passes_the_transfer_cap() -> None:
    async def scenario() -> None:
        h = Held()
        await h.stub.start()
        async with (
            proxy_on({"d0": h.stub.url}, slots=1, dispatch_ahead=4, transfer_cap=2, modes=BR0) as (
                proxy,
                url,
            ),
            httpx.AsyncClient() as c,
        ):
            tasks = [_post(c, url) for _ in range(4)]
            await until(lambda: len(h.stub.calls) == 2 and len(proxy.dispatcher.waiting) == 2, what="cap")
            h.first[0].set()  # A's first token: its transfer is over, one more may go
            await until(lambda: len(h.stub.calls) == 3, what="a third placed after a first token")
            assert proxy.ledger.transfers == [2] and len(proxy.dispatcher.waiting) == 1
            for i in range(4):
                await until(lambda i=i: len(h.stub.calls) > i, what=f"request {i} placed")
                h.finish(i)
            assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))
        await h.stub.stop()

    run(scenario)
