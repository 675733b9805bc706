"""Differential fuzzing of the active proxy's SSE relay against the upstream's own bytes.

Hypothesis generates SSE bodies (events of every size, some over the proxy's 1 MiB event cap;
line ends CRLF, LF, CR and mixtures; multi-line data, comments, field-only events, a final event
without its blank line, `[DONE]` or not) and splits them at random points. A real `shadow router`
process relays each body from a scripted upstream to a client. It shows, per example:
- the client receives exactly the upstream's bytes (the direct reference), nothing held at the end;
- event by event: after each piece the upstream sends, it waits until the client has every byte up
  to the last blank line so far (found by an independent line-by-line reading of the SSE spec),
  and, inside an event over the cap, all but the last 2 bytes sent — a proxy that holds a complete
  event back until more bytes come fails here (the upstream sends nothing more while it waits).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shadow.vllm.sse import EventSplitter
from tests.active.procs import shadow_process
from tests.active.raw_upstream import SSE_HEAD, Exchange, RawUpstream

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CAP = 1 << 20  # the proxy's default event cap (ActiveConfig.max_event_bytes)
HOLD_S = 15.0
ENDS = [b"\r\n", b"\n", b"\r"]


def blank_line_ends(body: bytes) -> list[int]:
    """Offsets just past every blank line (the SSE spec, read line by line; CRLF is one line end,
    and a CR already ends its line)."""
    out: list[int] = []
    i, n, line_empty = 0, len(body), True
    while i < n:
        c = body[i : i + 1]
        if c in (b"\r", b"\n"):
            i += 2 if body[i : i + 2] == b"\r\n" else 1
            if line_empty:
                out.append(i)
            line_empty = True
        else:
            line_empty = False
            i += 1
    return out


def expected_at(body: bytes, sent: int, cap: int = CAP) -> int:
    """Bytes the client must have once `sent` bytes of the body were sent: up to the last blank
    line, and inside an event over `cap`, all but the 2 bytes that may start its blank line."""
    ends = blank_line_ends(body[:sent])
    last = ends[-1] if ends else 0
    if sent - last > cap:
        return max(last, sent - 2)
    return last


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    events: list[bytes] = []
    for _ in range(draw(st.integers(1, 8))):
        end = draw(st.sampled_from(ENDS))
        kind = draw(st.sampled_from(["data", "data", "multi", "comment", "field", "blank", "big"]))
        if kind == "blank":
            lines = []  # a blank line alone (an empty event)
        elif kind == "data":
            line = b'data: {"choices":[{"text":"%d"}]}' % draw(st.integers(0, 999))
            lines = [line]
        elif kind == "multi":
            lines = [b"data: part%d" % k for k in range(draw(st.integers(2, 4)))]
        elif kind == "comment":
            lines = [b": keep-alive"]
        elif kind == "field":
            lines = [b"event: ping", b"id: 7"]
        else:
            lines = [b"data: " + b"y" * draw(st.sampled_from([CAP // 2, CAP + 10, CAP + (CAP >> 1)]))]
        mixed = [ln + draw(st.sampled_from(ENDS)) if draw(st.booleans()) else ln + end for ln in lines]
        events.append(b"".join(mixed) + end)
    if draw(st.booleans()):
        events.append(b"data: [DONE]" + draw(st.sampled_from(ENDS)) * 2)
    if draw(st.booleans()):
        events.append(b"data: tail without its blank line")
    body = b"".join(events)
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(body) - 1)), max_size=12))))
    return body, [c for c in cuts if 0 < c < len(body)]


LINES = st.tuples(st.binary(max_size=40), st.sampled_from([*ENDS, b"\r\r", b"\n\r"]))


@settings(max_examples=400, deadline=None)
@given(events=st.lists(LINES, max_size=10), cuts=st.lists(st.integers(1, 400), max_size=15),
       cap=st.sampled_from([8, 64, 1 << 20]))
def test_the_splitter_against_a_line_by_line_reading(
    events: list[tuple[bytes, bytes]], cuts: list[int], cap: int
) -> None:
    """The splitter alone (any bytes, tiny caps): nothing lost or reordered, nothing held back."""
    body = b"".join(line + end + end for line, end in events)
    cuts = sorted({c for c in cuts if c < len(body)})
    split = EventSplitter(cap)
    out = b""
    for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
        out += b"".join(piece for piece, _ in split.feed(body[a:b]))
        assert len(out) >= expected_at(body, b, cap), (body, b)
        assert body.startswith(out)
    assert out + split.rest() == body


class Rig:
    """One upstream and one router process for the whole run; each example swaps the script."""

    def __init__(self) -> None:
        self.body = b""
        self.cuts: list[int] = []
        self.received = 0
        self.cond = threading.Condition()
        self.violations: list[str] = []

    async def script(self, ex: Exchange) -> None:
        await ex.send(SSE_HEAD)
        body, cuts = self.body, self.cuts
        for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
            await ex.chunk(body[a:b])
            if b == len(body):
                break
            need = expected_at(body, b)
            ok = await asyncio.get_running_loop().run_in_executor(None, self._wait, need)
            if not ok:
                self.violations.append(f"after {b} of {len(body)} bytes the client had {self.received}, "
                                       f"not {need}")
                break
        await ex.end_chunks()

    def _wait(self, need: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.received >= need, HOLD_S)

    def got(self, n: int) -> None:
        with self.cond:
            self.received += n
            self.cond.notify_all()


@pytest.fixture(scope="module")
def rig() -> Iterator[tuple[Rig, str]]:
    r = Rig()
    with RawUpstream(r.script) as up:
        argv = ["router", "--decode", f"d0={up.url}", "--port", "0"]
        with shadow_process(argv) as (_, ready):
            yield r, ready["url"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow,
                                                                    HealthCheck.data_too_large])
@given(case=bodies())
def test_the_proxy_relays_sse_event_by_event_and_byte_for_byte(
    rig: tuple[Rig, str], case: tuple[bytes, list[int]]
) -> None:
    r, proxy = rig
    body, cuts = case
    r.body, r.cuts, r.received, r.violations = body, cuts, 0, []
    event(f"pieces: {min(len(cuts) + 1, 5)}+")
    ends = [0, *blank_line_ends(body), len(body)]
    big = any(b - a > CAP for a, b in itertools.pairwise(ends))
    event("an event over the cap" if big else "small events")
    got = bytearray()
    t0 = time.monotonic()
    with httpx.stream("POST", proxy + "/v1/completions", json={"model": "m", "prompt": "p", "stream": True},
                      timeout=120) as resp:
        assert resp.status_code == 200
        for part in resp.iter_raw():
            got += part
            r.got(len(part))
    assert not r.violations, r.violations
    assert bytes(got) == body, (len(got), len(body), time.monotonic() - t0)
