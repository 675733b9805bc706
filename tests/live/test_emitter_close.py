"""Closing an Emitter while its flusher is posting a batch loses nothing (the two-forwarder serve
test sends through two emitters closed one after the other: the second used to be cancelled
mid-post, and its in-flight batch vanished without being counted)."""

from __future__ import annotations

import asyncio

import httpx

from shadow.contracts.events import Route
from shadow.mirror.emitter import Emitter


def test_aclose_waits_for_the_batch_in_flight_and_loses_nothing() -> None:
    received: list[str] = []

    async def slow_api(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.005)  # a post takes a while: the flusher is mid-post when closed
        received.extend(line for line in request.content.decode().splitlines() if line)
        return httpx.Response(200, json={"accepted": 1})

    async def main() -> list[Emitter]:
        ems = [Emitter("http://x", batch_size=200, transport=httpx.MockTransport(slow_api)) for _ in range(2)]
        for em in ems:
            em.start()
        for k, em in enumerate(ems):
            for i in range(3000):
                em.emit(Route(f"e{k}-{i}", 0.0, "d0"))
        for em in ems:  # closing the first lets the second's flusher start posting
            await em.aclose()
        return ems

    ems = asyncio.run(main())
    for em in ems:
        assert (em.sent, em.dropped, em.errors) == (3000, 0, 0), (em.sent, em.dropped, em.errors)
    assert len(received) == len(set(received)) == 6000, (
        f"{6000 - len(set(received))} of 6000 events never reached the API (a batch cut short by close)")


def test_a_post_cancelled_from_outside_is_counted_as_dropped() -> None:
    started = asyncio.Event()

    async def hang(request: httpx.Request) -> httpx.Response:
        started.set()
        await asyncio.sleep(3600)
        return httpx.Response(200)

    async def main() -> Emitter:
        em = Emitter("http://x", batch_size=10, transport=httpx.MockTransport(hang))
        for i in range(10):
            em.emit(Route(f"r{i}", 0.0, "d0"))
        task = asyncio.create_task(em.flush())
        await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return em

    em = asyncio.run(main())
    assert (em.sent, em.dropped) == (0, 10)
