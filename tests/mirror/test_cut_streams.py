"""A stream the upstream cuts is an error the client sees through a tap: an SSE error event in
vLLM's shape, then a chunked body that never ends (no terminating chunk), counted by reason; the
official `openai` client raises instead of returning a short completion. A stream cut inside an
event gets no event (it would end the open one, which the client would then parse): the body is
cut as it came. A body the client reads to the connection's close is reset."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
from typing import Any

import httpx
import openai
import pytest

from shadow.base.procs import read_json_line, shadow_argv
from shadow.contracts.tapwire import END_UPSTREAM_CUT
from shadow.dataplane.dropqueue import DropQueue
from shadow.dataplane.tap import Tap
from shadow.vllm.errors import cut_event, event_open
from tests.mirror.helpers import dechunk, openai_stream_error

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _event(i: int) -> bytes:
    doc = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def _upstream(how: str, events: int = 3) -> asyncio.Server:
    """An SSE upstream that sends `events` events and then ends badly: `close` (FIN mid-body),
    `reset` (RST), `garbage` (an invalid chunk size), `half` (close in the middle of an event)."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await r.readuntil(b"\r\n\r\n")
        n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await r.readexactly(n)
        w.write(SSE_HEAD + b"".join(_chunk(_event(i)) for i in range(events)))
        if how == "garbage":
            w.write(b"zz\r\nnot a chunk\r\n")
        elif how == "half":
            w.write(_chunk(_event(events)[:20]))
        await w.drain()
        if how == "reset":  # SO_LINGER 0: the close sends RST
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()
        else:
            w.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def _tap_for(srv: asyncio.Server) -> tuple[Tap, DropQueue]:
    q = DropQueue(1000)
    tap = Tap("d0", f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", q)
    await tap.start()
    return tap, q


async def _raw(tap: Tap) -> bytes:
    body = b'{"model":"m","prompt":"p","stream":true}'
    r, w = await asyncio.open_connection(tap.host, tap.port)
    w.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))
    out = await asyncio.wait_for(r.read(-1), 10)
    w.close()
    return out


def _dechunk(raw: bytes) -> tuple[bytes, bool]:
    """(the body of a whole response, whether it ended with the terminating zero-length chunk)."""
    return dechunk(raw.split(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize(("how", "reason"), [
    ("close", "upstream_closed"), ("reset", "upstream_reset"), ("garbage", "bad_upstream_response"),
])
def test_a_cut_sse_stream_ends_with_an_error_event_and_no_terminating_chunk(how: str, reason: str) -> None:
    async def go() -> None:
        srv = await _upstream(how)
        tap, q = await _tap_for(srv)
        try:
            raw = await _raw(tap)
            body, clean = _dechunk(raw)
            assert not clean, "a cut stream must not end with the zero-length chunk"
            events = [e for e in body.split(b"\n\n") if e]
            assert events[:3] == [_event(i)[:-2] for i in range(3)]  # what arrived, unchanged
            last = json.loads(events[-1].split(b"data: ", 1)[1])
            assert set(last) == {"error"} and set(last["error"]) == {"message", "type", "param", "code"}
            assert last["error"]["type"] == "InternalServerError" and last["error"]["code"] == 500
            assert reason in last["error"]["message"]
            assert b"[DONE]" not in body
            assert tap.cut[reason] == 1 and sum(tap.cut.values()) == 1
            ends = [p for _, s, _, p in q.get_nowait_batch(100) if s == -1]
            assert ends == [END_UPSTREAM_CUT]
        finally:
            await tap.close()
            srv.close()

    asyncio.run(go())


def test_the_openai_client_raises_on_a_stream_cut_behind_a_tap() -> None:
    async def go() -> None:
        srv = await _upstream("close", events=5)
        tap, _ = await _tap_for(srv)
        try:
            got, _ = await openai_stream_error(tap.url + "/v1")
            assert len(got) == 5  # the tokens before the cut reached the client, then the error
            # a client that ignores SSE errors still sees a broken body
            async with httpx.AsyncClient() as h:
                with pytest.raises(httpx.RemoteProtocolError):
                    await h.post(tap.url + "/v1/completions",
                                 json={"model": "m", "prompt": "p", "stream": True})
        finally:
            await tap.close()
            srv.close()

    asyncio.run(go())


def test_a_stream_cut_inside_an_event_is_cut_as_it_came_and_the_openai_client_gets_a_connection_error(
        ) -> None:
    """Issue 37: the tap ended the event the worker left open (a blank line, then its error event),
    so the openai client parsed the truncated event and raised JSONDecodeError, not an APIError.
    Now the bytes are relayed unchanged and the body is cut without its end: the client's transport
    fails (httpx RemoteProtocolError, openai APIConnectionError) after the whole events."""

    async def go() -> None:
        srv = await _upstream("half")
        tap, q = await _tap_for(srv)
        try:
            body, clean = _dechunk(await _raw(tap))
            assert not clean, "a cut stream must not end with the zero-length chunk"
            assert body == b"".join(_event(i) for i in range(3)) + _event(3)[:20]  # as it came
            assert tap.cut["upstream_closed"] == 1 and sum(tap.cut.values()) == 1
            ends = [p for _, s, _, p in q.get_nowait_batch(100) if s == -1]
            assert ends == [END_UPSTREAM_CUT]
            got, raised = await openai_stream_error(tap.url + "/v1", openai.APIConnectionError)
            assert [c.choices[0].text for c in got] == [" t0", " t1", " t2"]
            cause = raised.__cause__
            assert type(cause).__name__ == "RemoteProtocolError", repr(cause)  # (httpx's, in openai)
        finally:
            await tap.close()
            srv.close()

    asyncio.run(go())


def test_a_cut_body_an_http10_client_reads_to_the_close_is_reset_not_ended() -> None:
    """An HTTP/1.0 client reads the body to the connection's close (no chunks): a FIN after a cut
    would end it as complete. The tap resets the connection instead."""

    async def go() -> None:
        srv = await _upstream("close")
        tap, _ = await _tap_for(srv)
        try:
            body = b'{"model":"m","prompt":"p","stream":true}'
            r, w = await asyncio.open_connection(tap.host, tap.port)
            w.write(b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body))
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(r.read(-1), 10)
            w.close()
            assert tap.cut["upstream_closed"] == 1
        finally:
            await tap.close()
            srv.close()

    asyncio.run(go())


@pytest.mark.parametrize(("tail", "open_"), [
    (b"", False), (b'}\n\n', False), (b"}\r\n\r\n", False), (b"\r\n\r", False), (b"}\r\r", False),
    (b'"cmp', True), (b"}\n", True), (b"}\r\n", True), (b"\n\r\nx", True),
])
def test_an_event_is_open_until_its_blank_line_with_any_line_ending(tail: bytes, open_: bool) -> None:
    assert event_open(tail) is open_
    assert (cut_event("cut", tail) is None) is open_


def test_tap_shutdown_cuts_open_streams_visibly() -> None:
    """A tap closed with a stream in flight (drain timed out) ends it the same way."""

    async def go() -> None:
        started = asyncio.Event()

        async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            head = await r.readuntil(b"\r\n\r\n")
            await r.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
            w.write(SSE_HEAD + _chunk(_event(0)))
            await w.drain()
            started.set()
            await asyncio.sleep(30)

        srv = await asyncio.start_server(slow, "127.0.0.1", 0)
        tap, _ = await _tap_for(srv)
        reader = asyncio.create_task(_raw(tap))
        await asyncio.wait_for(started.wait(), 10)
        def relayed() -> bool:  # the first event went out to the client
            return any(c.active is not None and c.active.up is not None and c.active.up.tail
                       for c in tap._clients)

        while not relayed():
            await asyncio.sleep(0.01)
        await tap.close()
        body, clean = _dechunk(await reader)
        srv.close()
        assert not clean and b"tap_shutdown" in body and body.startswith(_event(0))
        assert tap.cut["tap_shutdown"] == 1

    asyncio.run(go())


def test_a_cut_through_the_data_plane_raises_in_the_openai_client_and_is_counted_on_its_metrics() -> None:
    """The same through `shadow tap` (the data plane process): the client raises, and the cut is on
    the data plane's own /metrics by reason."""

    async def go() -> None:
        srv = await _upstream("reset", events=4)
        port = srv.sockets[0].getsockname()[1]
        proc = subprocess.Popen(shadow_argv("tap", "--name", "d0", "--upstream", f"d0=http://127.0.0.1:{port}"),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            ready = read_json_line(proc, "tap", 60)
            client = openai.AsyncOpenAI(base_url=ready["taps"]["d0"] + "/v1", api_key="x", max_retries=0)
            got: list[Any] = []
            with pytest.raises(openai.APIError):
                stream = await client.completions.create(model="m", prompt="p", stream=True)
                async for chunk in stream:
                    got.append(chunk)
            assert len(got) == 4
            await client.close()
            async with httpx.AsyncClient() as h:
                text = (await h.get(ready["metrics"] + "/metrics", timeout=10)).text
            line = 'shadow_tap_streams_cut_total{reason="upstream_reset",worker="d0"} 1.0'
            assert line in text.splitlines(), [x for x in text.splitlines() if "streams_cut" in x]
        finally:
            proc.terminate()
            proc.wait(60)
            if proc.stdout is not None:
                proc.stdout.close()
            srv.close()

    asyncio.run(go())
