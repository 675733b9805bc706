"""A hostile worker /metrics: pages bounded in bytes, scrapes in total time, non-finite values refused.

Each worker here is a raw asyncio server on loopback (it writes whatever bytes the attack needs);
the scraper is the one every caller uses (`shadow.vllm.metrics.MetricsScraper`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from shadow.mirror.reconcile import Reconciler
from shadow.mirror.state import MirrorState
from shadow.vllm.metrics import MetricsScraper, VllmLoad, parse_vllm_metrics

GOOD = (
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0"} 3.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{engine="0"} 1.0\n'
)

Writer = Callable[[asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def worker(write: Writer) -> AsyncIterator[tuple[str, list[int]]]:
    """A /metrics server whose answer is written by `write`; yields (url, [bytes it sent])."""
    sent = [0]

    async def handle(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            real = w.write

            def counting(data: bytes) -> None:
                sent[0] += len(data)
                real(data)

            w.write = counting  # type: ignore[method-assign]
            await write(w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/metrics", sent
    finally:
        server.close()
        await server.wait_closed()


def page(body: bytes, *, length: bool = True) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
    if length:
        head += b"content-length: %d\r\n" % len(body)
    return head + b"connection: close\r\n\r\n" + body


async def good(w: asyncio.StreamWriter) -> None:
    w.write(page(GOOD.encode()))
    await w.drain()


async def huge_streamed(w: asyncio.StreamWriter) -> None:
    """200 MB of valid-looking exposition without a Content-Length (read until close)."""
    w.write(page(b"", length=False))
    line = b'vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0\n' * 1000
    for _ in range((200 << 20) // len(line)):
        w.write(line)
        await w.drain()


async def drip(w: asyncio.StreamWriter) -> None:
    """One byte every 0.2 s, forever: each read arrives well within a per-read timeout."""
    w.write(page(b"", length=False))
    await w.drain()
    while True:
        w.write(b"#")
        await w.drain()
        await asyncio.sleep(0.2)


def test_a_200_mb_page_is_refused_after_the_cap_not_read_whole() -> None:
    async def go() -> None:
        async with worker(huge_streamed) as (url, sent):
            scraper = MetricsScraper(timeout_s=60.0)  # the default page cap (4 MiB)
            with pytest.raises(Exception) as info:
                await scraper.scrape(url)
            assert type(info.value).__name__ == "PageTooLarge"
            await scraper.aclose()
            assert scraper.rejected["too_large"] == 1
            # the scraper stopped reading at the cap: the worker could only fill the socket buffers
            # beyond it (on the old code the whole 200 MB was read and held)
            assert sent[0] < 64 << 20

    asyncio.run(go())


def test_a_dripping_worker_is_cut_at_the_scrape_deadline_and_stalls_no_other() -> None:
    async def go() -> None:
        async with worker(drip) as (slow, _), worker(good) as (fast, _):
            scraper = MetricsScraper(timeout_s=1.0)
            # bounded only so that the old code (a per-read timeout, never reached) fails, not hangs
            res = await asyncio.wait_for(scraper.scrape_all({"slow": slow, "fast": fast}), 60)
            await scraper.aclose()
            assert type(res["slow"]).__name__ == "ScrapeTimeout"
            assert isinstance(res["fast"], VllmLoad) and res["fast"].running == 3.0
            assert scraper.rejected["timeout"] == 1

    asyncio.run(go())


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-3"])
def test_a_non_finite_or_negative_load_is_refused_and_counted(value: str) -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0"}} 1\nvllm:num_requests_running{{engine="1"}} {value}\n'
    )
    with pytest.raises(ValueError) as info:
        parse_vllm_metrics(text)
    assert type(info.value).__name__ == "NonFiniteValue"

    async def bad(w: asyncio.StreamWriter) -> None:
        w.write(page(text.encode()))
        await w.drain()

    async def go() -> None:
        state = MirrorState(["d0"])
        async with worker(bad) as (url, _):
            rec = Reconciler({"d0": url}, state, timeout_s=5.0)
            await rec.scrape_once()
            await rec.aclose()
        w = rec.workers["d0"]
        # the old code summed NaN into `running` and made the drift NaN (which no check trips on)
        assert w.errors == 1 and w.last_error == "NonFiniteValue" and w.last_ok is None
        assert w.drift_requests is None and w.load is None

    asyncio.run(go())


def test_a_gzip_answer_is_not_inflated() -> None:
    async def gz(w: asyncio.StreamWriter) -> None:
        import gzip

        body = gzip.compress(b"#" * (64 << 20))  # 64 MB of comments in 64 KB
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(body) + body
        )
        await w.drain()

    async def go() -> None:
        async with worker(gz) as (url, _):
            scraper = MetricsScraper()
            res = await scraper.scrape_all({"w": url})
            await scraper.aclose()
        assert type(res["w"]).__name__ == "ScrapeRejected" and scraper.rejected["encoded"] == 1

    asyncio.run(go())


def test_only_the_load_series_are_parsed_and_a_good_page_still_reads() -> None:
    noise = "".join(f'vllm:other_histogram_bucket{{le="{i}"}} NaN\n' for i in range(1000))
    load = parse_vllm_metrics(noise + GOOD + "# HELP x y\n")
    assert (load.running, load.waiting, load.kv_usage) == (3.0, 1.0, None)
    assert math.isfinite(load.running or 0.0)
