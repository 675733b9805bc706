"""Both relays of the active proxy (the P/D decode stream and shadow-mode passthrough) count a
stream's events the same way, the SSE way: whole events (lines ended by a blank line, any line ends,
split anywhere across reads) whose data is a JSON object. The passthrough used to count `data:` line
starts in each read (`chunk.count(b"\\ndata:")`) and subtract a `[DONE]` seen in the tail: it missed
an event whose `data:` was split across two reads or whose lines end in CR, and counted a multi-line
data event once per line. Its TPOT (over `events - 1` gaps, only with two events or more) was then
missing or wrong; these bodies tell the two countings apart by whether a TPOT is recorded at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from shadow.active.metrics import ActiveMetrics
from shadow.active.proxycounts import ProxyCounts
from shadow.active.streamrelay import LegRelay
from shadow.active.streamtally import StreamTally
from shadow.contracts.modes import RouteMode, StaticModeSource
from shadow.vllm.sse import EventSplitter
from tests.active.stubs import DONE, Step, Stub, proxy_on, sse, until

BODY = {"model": "m", "prompt": "a b c", "max_tokens": 5, "stream": True}
#: Between the reads an upstream's body is written in, so that they tend to arrive apart. Not a wait
#: on a condition, and none is needed: the assertions hold whether the proxy reads them apart or
#: coalesced (a busy machine); the pause only lets the split cases reach the proxy split.
PAUSE_S = 0.05


class Recorder(StaticModeSource):
    """A fixed mode that keeps what each ended request reported: (outcome, TPOT)."""

    def __init__(self, mode: RouteMode) -> None:
        super().__init__(mode)
        self.ended: list[tuple[str, float | None]] = []

    def on_request(self, mode: str, outcome: str, status: int | None, ttft_s: float | None,
                   tpot_s: float | None) -> None:
        self.ended.append((outcome, tpot_s))


def _chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    doc = {"id": "c", "object": "text_completion", "choices": [choice]}
    return orjson.dumps(doc)


TWO = sse("a", 0) + sse("b", 1)
#: (reads as the upstream writes them, whole JSON events in them)
BODIES: dict[str, tuple[list[bytes], int]] = {
    # the second event's `data:` split across two reads (the old count missed it: no TPOT)
    "data-split-across-reads": ([sse("a", 0) + b"da", sse("b", 1, "stop")[2:], DONE], 2),
    "line-start-split-across-reads": ([sse("a", 0)[:-1], b"\n" + sse("b", 1, "stop"), DONE], 2),
    # CR line ends (SSE allows them; the old count saw no `\ndata:`)
    "cr-line-ends": ([(TWO + sse("c", 2, "stop") + DONE).replace(b"\n", b"\r")], 3),
    # one event whose data spans two lines (the old count took each line for an event)
    "multi-line-data": ([b"data: " + _chunk("a", "stop").replace(b',"choices"', b',\ndata: "choices"')
                         + b"\n\n", DONE], 1),
    # plain vLLM framing, one event per read: both countings agree
    "one-event-per-read": ([sse("a", 0), sse("b", 1), sse("c", 2, "stop"), DONE], 3),
}


def _script(reads: list[bytes]) -> tuple[Step, list[asyncio.Event]]:
    """The upstream's answer: `reads`, each written after a pause (set by `_pace`)."""
    gates = [asyncio.Event() for _ in reads[1:]]
    events: list[Any] = [reads[0]]
    for gate, read in zip(gates, reads[1:], strict=True):
        events += [gate, read]
    return Step(events=events), gates


async def _pace(gates: list[asyncio.Event]) -> None:
    for gate in gates:
        await asyncio.sleep(PAUSE_S)
        gate.set()


@pytest.mark.parametrize("name", list(BODIES))
@pytest.mark.parametrize("mode", ["shadow", "active"])
def test_both_relays_count_whole_json_events(name: str, mode: RouteMode) -> None:
    """A TPOT is recorded exactly when the stream carried two JSON events or more, in both modes."""
    reads, events = BODIES[name]

    async def scenario() -> None:
        step, gates = _script(reads)
        up = Stub([step])
        await up.start()
        modes = Recorder(mode)
        kw: dict[str, Any] = {"router_url": up.url} if mode == "shadow" else {}
        async with proxy_on({"d0": up.url}, modes=modes, **kw) as (_, url), httpx.AsyncClient() as c:
            pacing = asyncio.create_task(_pace(gates))
            r = await c.post(url + "/v1/completions", json=BODY, timeout=30)
            await pacing
            assert r.status_code == 200 and r.content == b"".join(reads)  # relayed unchanged
            await until(lambda: len(modes.ended) == 1, what="the request counted")
            ((outcome, tpot),) = modes.ended
            assert outcome == "ok"
            assert (tpot is not None) == (events > 1), (name, mode, tpot)
        await up.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _reads(parts: list[bytes]) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


def _relayed(parts: list[bytes], aligned: bool) -> tuple[bytes, StreamTally]:
    """What one `LegRelay` forwards of an upstream body read as `parts`, and its tally."""
    counts = ProxyCounts(ActiveMetrics(CollectorRegistry()), StaticModeSource(), logging.getLogger("t"))
    tally = StreamTally(counts, "shadow", "b", 0.0)
    leg = LegRelay(tally, EventSplitter(), aligned=aligned, counts=counts)

    async def relay() -> bytes:
        return b"".join([out async for out in leg.relay(_reads(parts))])

    return asyncio.run(relay()), tally


@pytest.mark.parametrize("name", list(BODIES))
@pytest.mark.parametrize("aligned", [False, True])
def test_the_tally_counts_events_whatever_the_reads(name: str, aligned: bool) -> None:
    """The relay's count, forwarded read by read or event by event, split at every byte too."""
    reads, events = BODIES[name]
    body = b"".join(reads)
    for parts in (reads, [body[i:i + 1] for i in range(len(body))]):
        out, tally = _relayed(parts, aligned)
        assert out == body
        assert tally.events == events and tally.complete() == "ok" and not tally.errored


@pytest.mark.parametrize("aligned", [False, True])
def test_an_error_event_fails_the_stream_in_both_relays(aligned: bool) -> None:
    """vLLM's error event (`data: {"error": ...}` then `[DONE]`) is a JSON event that fails its
    stream, read whole or split across reads; an unterminated one at the end is no event (SSE)."""
    err = b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}\n\n'
    for body, errored in ((sse("a", 0) + err + DONE, True), (sse("a", 0) + err[:-2], False)):
        for parts in ([body], [body[i:i + 7] for i in range(0, len(body), 7)]):
            out, tally = _relayed(parts, aligned)
            assert out == body
            assert tally.errored is errored and tally.events == 1 + errored
