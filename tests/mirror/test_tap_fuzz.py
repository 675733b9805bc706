"""Differential fuzzing of the tap's HTTP/1.1 framing against a real uvicorn+h11 upstream.

Hypothesis generates request sequences (valid ones, then mutated with the classic smuggling
tricks: obs-fold, bare LF, CL+TE, repeated or negative Content-Length, bad chunk sizes, odd
Transfer-Encoding spellings, requests hidden in bodies, random byte edits) and sends each, split
at random points, (a) through a fresh tap and (b) straight to the same upstream server. It shows:
- the upstream never frames more requests from the tap's bytes than the tap itself parsed, and
  the ones it frames are the tap's, in order (method, path), never with more body;
- the tap never hangs: every connection ends (answered, or closed by its timeouts);
- while the fuzzed connection is open, a second client is served normally.
Direct sends are the reference: `event()` reports how often the upstream, fed directly, framed
requests the tap refused (the cases the tap protects it from).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shadow.base.loopthread import LoopThread
from shadow.contracts.tapwire import TapContext
from shadow.dataplane.dropqueue import DropQueue
from shadow.dataplane.http1 import TapLimits
from shadow.dataplane.tap import Tap
from tests.mirror.h11_upstream import H11Server, Recorder, recording_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PATHS = [b"/v1/completions", b"/health", b"/v1/models", b"/fleet/faults", b"/v1/chat/completions?x=1"]
HIDDEN = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
LIMITS = TapLimits(header_timeout_s=1.0, idle_timeout_s=0.5)  # short, so every connection ends


def _serialize(method: bytes, path: bytes, headers: list[bytes], body: bytes, framing: str) -> bytes:
    hs = [b"Host: x", *headers]
    if framing == "cl":
        hs.append(b"Content-Length: %d" % len(body))
        payload = body
    elif framing == "chunked":
        hs.append(b"Transfer-Encoding: chunked")
        payload = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    else:
        payload = b""
    return b"%s %s HTTP/1.1\r\n%s\r\n\r\n%s" % (method, path, b"\r\n".join(hs), payload)


def _replace_first(data: bytes, old: bytes, new: bytes) -> bytes:
    i = data.find(old)
    return data if i < 0 else data[:i] + new + data[i + len(old) :]


def _mutate(data: bytes, name: str, pos: int, blob: bytes) -> bytes:
    head_end = data.find(b"\r\n\r\n")
    at = pos % (len(data) + 1)
    if name == "obs_fold":
        return _replace_first(data, b"\r\nHost: x", b"\r\nHost: x\r\n Content-Length: 40")
    if name == "bare_lf_end":
        return _replace_first(data, b"\r\n\r\n", b"\r\n\n")
    if name == "bare_lf":
        i = data.find(b"\r\n", at)
        return data if i < 0 else data[:i] + b"\n" + data[i + 2 :]
    if name == "cl_te":
        return _replace_first(
            data, b"\r\nHost: x", b"\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked"
        )
    if name == "dup_cl":
        return _replace_first(data, b"\r\nHost: x", b"\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 7")
    if name == "neg_cl":
        return _replace_first(data, b"\r\nHost: x", b"\r\nHost: x\r\nContent-Length: -4")
    if name == "neg_chunk":
        return _replace_first(data, b"\r\n\r\n", b"\r\n\r\n-6\r\n")
    if name == "bad_chunk":
        return _replace_first(data, b"\r\n\r\n", b"\r\n\r\nzz\r\n")
    if name == "te_variant":
        te = [b"chunked, identity", b" chunked", b"xchunked", b"chunked\x0b", b"CHUNKED", b"identity"][
            pos % 6
        ]
        return _replace_first(data, b"\r\nHost: x", b"\r\nHost: x\r\nTransfer-Encoding: " + te)
    if name == "te_space_colon":
        return _replace_first(data, b"\r\nHost: x", b"\r\nHost: x\r\nTransfer-Encoding : chunked")
    if name == "hidden_request":
        return data + HIDDEN if head_end < 0 else data[: head_end + 4] + HIDDEN + data[head_end + 4 :]
    if name == "flip" and data:
        i = pos % len(data)
        return data[:i] + bytes([blob[0] if blob else 0]) + data[i + 1 :]
    if name == "insert":
        return data[:at] + blob + data[at:]
    if name == "delete":
        return data[:at] + data[at + 1 + (len(blob) % 8) :]
    return data


MUTATIONS = [
    "obs_fold",
    "bare_lf_end",
    "bare_lf",
    "cl_te",
    "dup_cl",
    "neg_cl",
    "neg_chunk",
    "bad_chunk",
    "te_variant",
    "te_space_colon",
    "hidden_request",
    "flip",
    "insert",
    "delete",
]


BLOBS = [b"\r", b"\n", b" ", b"\t", b"\x00", b":", b"0", b"-", b"\r\n", b"\r\n\r\n"]


@st.composite
def fuzzed_requests(draw: Any) -> tuple[bytes, list[int]]:
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        method = draw(st.sampled_from([b"GET", b"POST", b"HEAD", b"DELETE", b"PUT"]))
        path = draw(st.sampled_from(PATHS))
        framing = draw(st.sampled_from(["cl", "chunked", "none"]))
        body = draw(st.binary(max_size=24)) if framing != "none" else b""
        extra = draw(
            st.lists(
                st.sampled_from([b"X-A: 1", b"Connection: keep-alive", b"Connection: close", b"Accept: */*"]),
                max_size=2,
            )
        )
        parts.append(_serialize(method, path, extra, body, framing))
    data = b"".join(parts)
    for name in draw(st.lists(st.sampled_from(MUTATIONS), max_size=3)):
        pos = draw(st.integers(0, 10_000))
        blob = draw(
            st.sampled_from([b"\r", b"\n", b" ", b"\t", b"\x00", b":", b"0", b"-", b"\r\n", b"\r\n\r\n"])
        )
        data = _mutate(data, name, pos, blob)
    cuts = sorted(draw(st.lists(st.integers(0, max(0, len(data))), max_size=3)))
    return data, cuts


async def _send_read(port: int, data: bytes, cuts: list[int], *, half_close: bool, timeout: float) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        prev = 0
        with contextlib.suppress(OSError):  # the peer may close early (a rejected request)
            for c in [*cuts, len(data)]:
                if c > prev:
                    writer.write(data[prev:c])
                    await writer.drain()
                    prev = c
            if half_close:
                writer.write_eof()
        try:
            return await asyncio.wait_for(reader.read(-1), timeout)  # never hangs: bounded, else failure
        except OSError:
            return b""
    finally:
        writer.close()


async def _good_request(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        return await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()


def _wait(pred: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return bool(pred())


def _tap_view(q: DropQueue) -> list[TapContext]:
    out: list[TapContext] = []
    seen: set[int] = set()
    for ctx, _seq, _t, _p in q.get_nowait_batch(1 << 20):
        if id(ctx) not in seen:
            seen.add(id(ctx))
            out.append(ctx)
    return out


@pytest.fixture(scope="module")
def rig() -> Any:
    rec = Recorder()
    relay = LoopThread("fuzz-relay")
    relay.start()
    with H11Server(recording_app(rec), keep_alive_s=1) as up:
        yield rec, up, relay
    relay.stop()


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
@given(case=fuzzed_requests())
def test_tap_never_forwards_what_the_upstream_frames_as_more_requests(
    case: tuple[bytes, list[int]], rig: Any
) -> None:
    rec, up, relay = rig
    data, cuts = case
    q = DropQueue(1 << 16)

    async def start() -> Tap:
        tap = Tap("fz", up.url, q, limits=LIMITS)
        await tap.start()
        return tap

    tap = relay.call(start())
    with rec.lock:
        rec.seen.clear()

    async def through_tap() -> tuple[bytes, bytes]:
        fuzz = asyncio.create_task(_send_read(tap.port, data, cuts, half_close=False, timeout=15))
        await asyncio.sleep(0)
        good = await _good_request(tap.port)  # a second client, while the fuzzed one is open
        return await fuzz, good

    out, good = asyncio.run(through_tap())
    assert good.startswith(b"HTTP/1.1 200 ") and good.endswith(b"ok /version"), good
    relay.call(tap.close())
    assert _wait(lambda: up.connections() == 0 and rec.inflight == 0), "upstream connections left open"
    with rec.lock:
        via = [s for s in rec.seen if s.path != "/version"]  # the second client's request aside
        rec.seen.clear()
    view = [c for c in _tap_view(q) if c.path != "/version"]
    assert len(via) <= len(view), (
        data,
        [(s.method, s.path) for s in via],
        [(c.method, c.path) for c in view],
    )
    for s, c in zip(via, view, strict=False):
        assert (s.method, s.path) == (c.method, c.path.split("?", 1)[0]), (data, s, c.method, c.path)
        assert s.body_len <= c.body_len, (data, s, c.body_len)
    assert all(c.path.split("?", 1)[0] != "/fleet/faults" for c in view)  # never relayed
    assert out == b"" or out.startswith(b"HTTP/1.1 "), out[:200]

    # the same bytes straight to the upstream (the reference)
    asyncio.run(_send_read(up.port, data, cuts, half_close=True, timeout=15))
    assert _wait(lambda: up.connections() == 0 and rec.inflight == 0)
    with rec.lock:
        direct = list(rec.seen)
        rec.seen.clear()
    if len(direct) > len(via):
        event("upstream framed more requests directly than the tap forwarded")
    if b"400 Bad Request" in out:
        event("tap answered 400")
