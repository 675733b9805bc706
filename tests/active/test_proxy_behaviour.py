"""The active proxy's contract against scripted upstreams (real HTTP on loopback, one event loop):
shadow-mode passthrough is byte-identical; retries happen only before the first byte reached the
client; a `stop_reason: "recomputed"` stream continues on a new P/D flow; a client cancel frees its
pool entry or decode slot at once; the transfer cap holds; both legs carry one X-Request-Id."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
import httpx
import orjson
import pytest

from shadow.active.modes import ModeConfig, ModeController
from shadow.contracts.labels import STREAM_INCOMPLETE
from shadow.contracts.modes import StaticModeSource
from tests.active.stubs import DONE, Step, Stub, metric, proxy_on, sse, until
from tests.mirror.helpers import openai_stream_error


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


def _texts(raw: bytes) -> list[str]:
    out = []
    for ev in raw.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            out += [c["text"] for c in orjson.loads(ev[6:]).get("choices", []) if c.get("text")]
    return out


def _error_events(raw: bytes) -> list[dict[str, Any]]:
    """The SSE error events (vLLM's shape) in a relayed body (an event cut in half is skipped)."""
    out = []
    for ev in raw.split(b"\n\n"):
        with contextlib.suppress(orjson.JSONDecodeError):
            doc = orjson.loads(ev[6:]) if ev.startswith(b"data: {") else {}
            if "error" in doc:
                out.append(doc["error"])
    return out


async def _read_cut(c: httpx.AsyncClient, url: str) -> bytes:
    """POST a stream that the proxy cuts: its bytes, after checking that the body did not end cleanly."""
    got = b""
    async with c.stream("POST", url + "/v1/completions", json=BODY) as r:
        assert r.status_code == 200
        try:
            async for chunk in r.aiter_raw():
                got += chunk
        except httpx.RemoteProtocolError:
            return got  # incomplete chunked read: what a cut stream must look like
    raise AssertionError(f"the cut stream ended cleanly: {got!r}")


BODY = {"model": "m", "prompt": "a b c", "max_tokens": 5, "stream": True}


def test_shadow_mode_passes_bytes_status_and_headers_unchanged() -> None:
    chunks = [b'data: {"x": 1}\n', b'\ndata: {"y"', b": 2}\n\n", b"data: [DONE]\n\n"]

    async def scenario() -> None:
        router = Stub(
            lambda n, body: (
                Step(events=chunks, headers={"x-router": "r1"})
                if n < 2
                else Step(status=429, body=b'{"error": "slow down"}', headers={"retry-after": "3"})
            )
        )
        await router.start()
        async with (
            proxy_on(
                {"d0": "http://127.0.0.1:9"}, router_url=router.url, modes=StaticModeSource("shadow")
            ) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            raw = orjson.dumps(BODY) + b"  "  # odd bytes: must reach the router as they are
            direct = await c.post(
                router.url + "/v1/completions",
                content=raw,
                headers={"content-type": "application/json", "x-client": "c1"},
            )
            through = await c.post(
                url + "/v1/completions",
                content=raw,
                headers={"content-type": "application/json", "x-client": "c1", "te": "trailers",
                         "proxy-connection": "keep-alive", "proxy-authorization": "Basic c2VjcmV0"},
            )
            assert through.content == direct.content == b"".join(chunks)
            assert through.status_code == direct.status_code == 200
            assert through.headers["x-router"] == "r1"
            assert router.raws[1] == router.raws[0] == raw  # body bytes as sent
            assert router.calls[1][0]["x-client"] == "c1"
            # hop-by-hop headers (shadow.base.hopbyhop) and proxy credentials stay with this hop
            assert not {"proxy-connection", "proxy-authorization", "te"} & set(router.calls[1][0])
            limited = await c.post(url + "/v1/completions", content=raw)
            assert limited.status_code == 429 and limited.content == b'{"error": "slow down"}'
            assert limited.headers["retry-after"] == "3"
            ok = metric(proxy, "shadow_router_requests_total", mode="shadow", policy="router", outcome="ok")
            assert ok == 1
        await router.stop()

    run(scenario)


def test_decode_failure_before_first_byte_is_retried_with_one_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        pre = Stub([], role="prefill")
        dec = Stub(
            [
                Step(status=503, body=b'{"error": "busy"}'),
                Step(events=[sse("t", i) for i in range(5)] + [DONE]),
            ]
        )
        await pre.start()
        await dec.start()
        async with (
            proxy_on({"d0": dec.url}, prefill={"p0": pre.url}) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            r = await c.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 200 and _texts(r.content) == ["t"] * 5
            assert len(dec.calls) == 2 and len(pre.calls) == 2  # the whole flow again (KV was claimed)
            ids = {h["x-request-id"] for h, _ in pre.calls + dec.calls}
            assert ids == {r.headers["x-request-id"]}
            assert metric(proxy, "shadow_router_retries_total", leg="decode") == 1
            assert metric(proxy, "shadow_router_upstream_errors_total", leg="decode", worker="d0") == 1
            p_body = pre.calls[0][1]
            assert p_body["max_tokens"] == 1 and p_body["min_tokens"] == 1 and p_body["stream"] is False
            assert p_body["kv_transfer_params"]["do_remote_decode"] is True
            assert dec.calls[1][1]["kv_transfer_params"]["remote_request_id"] == "kv-2"
            assert not proxy.ledger.legs and not proxy.dispatcher.waiting
        await pre.stop()
        await dec.stop()

    with caplog.at_level(logging.WARNING, logger="shadow.active"):
        run(scenario)
    (line,) = [r.getMessage() for r in caplog.records if "retried" in r.getMessage()]
    assert line == (
        "request retried (attempt 2, a new prefill): the decode leg failed on d0 (503, decode_status)"
    )


def test_no_retry_once_bytes_reached_the_client() -> None:
    async def scenario() -> None:
        dec = Stub([Step(events=[sse("t", 0), sse("t", 1)], cut=True)])
        await dec.start()
        async with proxy_on({"d0": dec.url}) as (proxy, url), httpx.AsyncClient() as c:
            got = await _read_cut(c, url)  # the proxy ends the stream without a clean end
            assert _texts(got) == ["t", "t"]
            (err,) = _error_events(got)  # then an error event in vLLM's shape, never [DONE]
            assert err["type"] == "InternalServerError" and "upstream_broke" in err["message"]
            assert b"[DONE]" not in got and proxy.cut[("decode", "upstream_broke")] == 1
            cut = metric(proxy, "shadow_router_streams_cut_total", leg="decode", reason="upstream_broke")
            assert cut == 1  # on /metrics too
            assert len(dec.calls) == 1
            await until(
                lambda: (
                    metric(
                        proxy,
                        "shadow_router_requests_total",
                        mode="active",
                        policy="br0",
                        outcome="upstream_error",
                    )
                    == 1
                ),
                what="the broken stream counted",
            )
            assert metric(proxy, "shadow_router_retries_total", leg="decode") == 0
            assert not proxy.ledger.legs
        await dec.stop()

    run(scenario)


def test_recomputed_stream_continues_with_prompt_plus_text_and_remaining_tokens() -> None:
    def script(n: int, body: Any) -> Step:
        if n == 0:
            return Step(events=[sse("x", 0), sse("y", 1), sse("", 2, "abort", "recomputed")])
        return Step(events=[sse("z", 3), sse("w", 4), sse("v", 5, "length"), DONE])

    async def scenario() -> None:
        pre = Stub([], role="prefill")
        dec = Stub(script)
        await pre.start()
        await dec.start()
        async with (
            proxy_on({"d0": dec.url, "d1": dec.url}, prefill={"p0": pre.url}) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            r = await c.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 200
            assert _texts(r.content) == ["x", "y", "z", "w", "v"]
            assert b"recomputed" not in r.content and r.content.endswith(DONE)
            assert len(dec.calls) == 2 and len(pre.calls) == 2
            second = dec.calls[1][1]
            assert second["prompt"] == "a b cxy" and second["max_tokens"] == 3
            assert {h["x-request-id"] for h, _ in pre.calls + dec.calls} == {r.headers["x-request-id"]}
            assert metric(proxy, "shadow_router_recomputed_total") == 1
            assert not proxy.ledger.legs
        await pre.stop()
        await dec.stop()

    run(scenario)


def test_client_cancel_frees_pool_entry_and_decode_slot_at_once() -> None:
    async def scenario() -> None:
        hold = asyncio.Event()
        dec = Stub([Step(events=[sse("t", 0), hold, sse("t", 1), DONE])])
        await dec.start()
        async with proxy_on({"d0": dec.url}, slots=1) as (proxy, url), httpx.AsyncClient() as c:
            first_byte = asyncio.Event()

            async def running() -> None:
                async with c.stream("POST", url + "/v1/completions", json=BODY) as r:
                    async for _ in r.aiter_raw():
                        first_byte.set()

            t1 = asyncio.create_task(running())
            await first_byte.wait()
            t2 = asyncio.create_task(c.post(url + "/v1/completions", json=BODY))
            await until(lambda: len(proxy.dispatcher.waiting) == 1, what="the second request in the pool")
            assert metric(proxy, "shadow_pool_requests") == 1
            t2.cancel()  # the client goes away while its request waits in the pool
            await until(lambda: not proxy.dispatcher.waiting, what="the pool entry freed")
            assert metric(proxy, "shadow_pool_requests") == 0
            assert len(dec.calls) == 1  # it never reached a decode worker
            await until(
                lambda: (
                    metric(
                        proxy,
                        "shadow_router_requests_total",
                        mode="active",
                        policy="br0",
                        outcome="client_cancel",
                    )
                    == 1
                ),
                what="the cancel counted",
            )
            t1.cancel()  # now the running stream's client goes away: its slot frees at once
            await until(lambda: not proxy.ledger.legs, what="the decode slot freed")
            await until(lambda: dec.gone == 1, what="the decode stream closed upstream")
            assert (
                metric(
                    proxy,
                    "shadow_router_requests_total",
                    mode="active",
                    policy="br0",
                    outcome="client_cancel",
                )
                == 2
            )
            for t in (t1, t2):
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await t
        await dec.stop()

    run(scenario)


def test_transfer_cap_holds_dispatch_until_a_first_token() -> None:
    async def scenario() -> None:
        release = asyncio.Event()
        dec = Stub([Step(events=[release, sse("t", 0), DONE])])
        await dec.start()
        async with (
            proxy_on({"d0": dec.url}, slots=4, transfer_cap=1) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            tasks = [asyncio.create_task(c.post(url + "/v1/completions", json=BODY)) for _ in range(3)]
            await until(
                lambda: len(dec.calls) == 1 and len(proxy.dispatcher.waiting) == 2,
                what="one transfer in flight, two held in the pool",
            )
            assert proxy.ledger.transfers == [1]
            assert metric(proxy, "shadow_router_kv_transfers_inflight", worker="d0") == 1
            assert metric(proxy, "shadow_router_backpressure_total", reason="transfer_cap") >= 1
            release.set()  # first tokens arrive: transfers end, the held requests go one by one
            done = await asyncio.gather(*tasks)
            assert all(r.status_code == 200 and _texts(r.content) == ["t"] for r in done)
            assert len(dec.calls) == 3 and not proxy.ledger.legs
        await dec.stop()

    run(scenario)


def test_decode_leg_not_sent_is_retried_with_the_same_kv_and_no_second_prefill() -> None:
    """The decode worker refuses connections (nothing was sent) until it comes up: the decode leg
    is tried again with the KV handle of the one prefill (the worker never saw it)."""

    async def scenario() -> None:
        pre = Stub([], role="prefill")
        dec = Stub([Step(events=[sse("t", i) for i in range(5)] + [DONE])])
        await pre.start()
        hold = socket.socket()  # bound, not listening: connections are refused
        hold.bind(("127.0.0.1", 0))
        port = hold.getsockname()[1]
        async with (
            proxy_on(
                {"d0": f"http://127.0.0.1:{port}"},
                prefill={"p0": pre.url},
                kv_backpressure=False,
                retries=6,
                retry_delay_s=0.05,
            ) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            task = asyncio.create_task(c.post(url + "/v1/completions", json=BODY))
            await until(
                lambda: metric(proxy, "shadow_router_upstream_errors_total", leg="decode", worker="d0") >= 1,
                what="a refused decode leg",
            )
            hold.close()
            dec.server.port = port
            await dec.start()
            r = await task
            assert r.status_code == 200 and _texts(r.content) == ["t"] * 5
            assert len(pre.calls) == 1 and len(dec.calls) == 1  # one prefill; the decode got its handle
            assert dec.calls[0][1]["kv_transfer_params"]["remote_request_id"] == "kv-1"
            assert metric(proxy, "shadow_router_retries_total", leg="decode") >= 1
            assert not proxy.legs.aborted  # the handle was used, not given up
            assert not proxy.ledger.legs and proxy.prefill.prefillers[0].requests == 0
        await pre.stop()
        await dec.stop()

    run(scenario)


def test_a_decode_request_already_written_is_never_sent_again() -> None:
    """The decode worker reads the whole request, then closes without answering: it may be running
    it, so the proxy answers 502 and does not send it again (nor re-run the prefill)."""
    got: list[bytes] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        done = asyncio.Event()

        class Parser:
            def on_message_complete(self) -> None:
                done.set()

        parser = httptools.HttpRequestParser(Parser())
        while not done.is_set():
            data = await reader.read(65536)
            if not data:
                break
            got.append(data)
            parser.feed_data(data)
        writer.close()

    async def scenario() -> None:
        pre = Stub([], role="prefill")
        await pre.start()
        server = await asyncio.start_server(swallow, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with (
            proxy_on({"d0": f"http://127.0.0.1:{port}"}, prefill={"p0": pre.url}, kv_backpressure=False) as (
                proxy,
                url,
            ),
            httpx.AsyncClient() as c,
        ):
            r = await c.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 502 and r.json()["error"]["type"] == "decode_no_answer"
            assert len(got) >= 1 and b"POST /v1/completions" in got[0]
            assert sum(b.count(b"POST /v1/completions") for b in got) == 1  # sent once
            assert len(pre.calls) == 1
            assert metric(proxy, "shadow_router_retries_total", leg="decode") == 0
            assert metric(proxy, "shadow_router_requests_total", mode="active", policy="br0",
                          outcome="upstream_error") == 1
            assert proxy.errors["decode_no_answer"] == 1
            assert not proxy.ledger.legs and proxy.prefill.prefillers[0].requests == 0
        server.close()
        await server.wait_closed()
        await pre.stop()

    run(scenario)


def test_a_client_leaving_right_after_done_counts_ok_in_every_mode() -> None:
    """The upstream has sent `data: [DONE]` but not yet ended its response when the client (as the
    openai client does) closes: the client had the whole stream, so the request counts `ok`,
    through the P/D flow and through shadow-mode passthrough alike."""

    async def scenario() -> None:
        never = asyncio.Event()  # the upstreams never end their responses on their own
        events = [sse("t", 0), sse("t", 1), DONE, never]
        dec = Stub([Step(events=events)])
        router = Stub([Step(events=events)])
        await dec.start()
        await router.start()
        for mode, policy in (("active", "br0"), ("shadow", "router")):
            async with (
                proxy_on({"d0": dec.url}, router_url=router.url, modes=StaticModeSource(mode)) as (
                    proxy,
                    url,
                ),
                httpx.AsyncClient() as c,
            ):
                got = b""
                async with c.stream("POST", url + "/v1/completions", json=BODY) as r:
                    async for chunk in r.aiter_raw():
                        got += chunk
                        if got.endswith(DONE):
                            break  # leave at once, as the openai client does
                assert _texts(got) == ["t", "t"]
                await until(
                    lambda proxy=proxy, mode=mode, policy=policy: sum(
                        metric(proxy, "shadow_router_requests_total", mode=mode, policy=policy, outcome=o)
                        for o in ("ok", "client_cancel", "upstream_error")
                    ) == 1,
                    what=f"the {mode} request counted",
                )
                ok = metric(proxy, "shadow_router_requests_total", mode=mode, policy=policy, outcome="ok")
                assert ok == 1
        await dec.stop()
        await router.stop()

    run(scenario)


def test_a_client_leaving_before_done_counts_client_cancel() -> None:
    async def scenario() -> None:
        never = asyncio.Event()
        dec = Stub([Step(events=[sse("t", 0), never, DONE])])
        await dec.start()
        async with proxy_on({"d0": dec.url}) as (proxy, url), httpx.AsyncClient() as c:
            async with c.stream("POST", url + "/v1/completions", json=BODY) as r:
                async for chunk in r.aiter_raw():
                    if b"data: {" in chunk:
                        break
            await until(lambda: not proxy.ledger.legs, what="the decode slot freed")
            await until(
                lambda: metric(proxy, "shadow_router_requests_total", mode="active", policy="br0",
                               outcome="client_cancel") == 1,
                what="counted client_cancel",
            )
            ok = metric(proxy, "shadow_router_requests_total", mode="active", policy="br0", outcome="ok")
            assert ok == 0
        await dec.stop()

    run(scenario)


def test_over_the_resume_budget_a_stream_keeps_no_bytes_counted_on_health_and_prometheus() -> None:
    """A stream whose bytes pass `resume_budget_bytes` stops keeping them (counted once, on /health
    and as shadow_router_resume_dropped_total); it still reaches the client whole, but a
    `recomputed` end can no longer be continued: the stream is cut there (an error event, no clean
    end), counted as an upstream error."""

    def script(n: int, body: Any) -> Step:
        if n == 0:
            return Step(events=[sse("x" * 40, i) for i in range(4)] + [DONE])
        return Step(events=[sse("y" * 40, i) for i in range(4)] + [sse("", 9, "abort", "recomputed")])

    async def scenario() -> None:
        dec = Stub(script)
        await dec.start()
        async with (
            proxy_on({"d0": dec.url}, resume_budget_bytes=300) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            r = await c.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 200 and _texts(r.content) == ["x" * 40] * 4
            assert r.content.endswith(DONE)
            assert metric(proxy, "shadow_router_resume_dropped_total") == 1
            assert (await c.get(url + "/health")).json()["resume_dropped"] == 1
            assert proxy.resume.held == 0  # nothing held once the stream ended
            r2 = await _read_cut(c, url)  # cut where it could not be continued: an error for the client
            assert _texts(r2) == ["y" * 40] * 4 and b"recomputed" not in r2
            assert "no_continuation" in _error_events(r2)[0]["message"]
            assert len(dec.calls) == 2  # no continuation: the kept bytes were gone
            assert metric(proxy, "shadow_router_resume_dropped_total") == 2
            await until(
                lambda: metric(proxy, "shadow_router_requests_total", mode="active", policy="br0",
                               outcome="upstream_error") == 1,
                what="the cut-short stream counted",
            )
        await dec.stop()

    run(scenario)


def test_a_router_stream_cut_in_shadow_mode_reaches_the_client_as_an_error() -> None:
    """Passthrough relays the router's bytes as they come; when its stream breaks off inside an
    event, the client gets that event's bytes as relayed and a body that never ends, and no error
    event (ending the open event first made clients parse it: a JSON error, not a cut)."""

    async def scenario() -> None:
        router = Stub([Step(events=[sse("t", 0), sse("t", 1)[:15]], cut=True)])
        await router.start()
        async with (
            proxy_on({"d0": "http://127.0.0.1:9"}, router_url=router.url,
                     modes=StaticModeSource("shadow")) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            got = await _read_cut(c, url)
            assert got == sse("t", 0) + sse("t", 1)[:15]  # as relayed: no event ends the open one
            assert proxy.cut[("router", "upstream_broke")] == 1
            cut = metric(proxy, "shadow_router_streams_cut_total", leg="router", reason="upstream_broke")
            assert cut == 1  # on /metrics too
            await until(lambda: metric(proxy, "shadow_router_requests_total", mode="shadow", policy="router",
                                       outcome="upstream_error") == 1, what="the broken stream counted")
        await router.stop()

    run(scenario)


@pytest.mark.parametrize(("mode", "cohort"), [("active", "shadow"), ("shadow", "router")])
def test_a_stream_that_ends_cleanly_without_its_finish_is_incomplete_and_fails_its_cohort(
        mode: str, cohort: str) -> None:
    """Issue 37: a stream whose upstream ended the body cleanly with neither a `finish_reason` nor
    `data: [DONE]` (cut short, however cleanly) was counted `ok`. It is `stream_incomplete` now (the
    name `shadow load` gives it), and the client-felt checks count it failed; a stream with either
    end marker is `ok`. Through the P/D flow and through shadow-mode passthrough alike."""

    async def scenario() -> None:
        cut_short = Step(events=[sse("t", 0), sse("t", 1)])
        finished = Step(events=[sse("t", 0), sse("t", 1, finish="length")])
        done = Step(events=[sse("t", 0), DONE])
        up = Stub([cut_short, finished, done])
        await up.start()
        modes = ModeController(ModeConfig(mode=mode))
        policy = "br0" if mode == "active" else "router"
        async with (
            proxy_on({"d0": up.url}, router_url=up.url, modes=modes) as (proxy, url),
            httpx.AsyncClient() as c,
        ):
            for texts in (["t", "t"], ["t", "t"], ["t"]):  # each relayed whole, as it came
                r = await c.post(url + "/v1/completions", json=BODY)
                assert r.status_code == 200 and _texts(r.content) == texts, r.content

            def counted(outcome: str) -> float:
                return metric(proxy, "shadow_router_requests_total", mode=mode, policy=policy,
                              outcome=outcome)

            await until(lambda: counted("ok") + counted(STREAM_INCOMPLETE) == 3, what="the streams counted")
            assert (counted("ok"), counted(STREAM_INCOMPLETE)) == (2, 1)
            assert modes.snapshot()["cohorts"] == {f"{cohort}/ok": 2, f"{cohort}/failed": 1}
        await up.stop()

    run(scenario)


@pytest.mark.parametrize(("mode", "leg"), [("active", "decode"), ("shadow", "router")])
def test_an_upstream_silent_past_the_idle_deadline_is_cut_and_the_openai_client_raises(
        mode: str, leg: str) -> None:
    """Issue 37: a worker that stopped sending mid-stream held the client for as long as it kept
    the connection. Past `upstream_idle_s` of silence the stream is cut (an SSE error event naming
    `upstream_idle`, then a body that never ends), counted by that reason, and the openai client
    raises."""

    async def scenario() -> None:
        never = asyncio.Event()
        up = Stub([Step(events=[sse("t", 0), never])])
        await up.start()
        async with proxy_on({"d0": up.url}, router_url=up.url, modes=StaticModeSource(mode),
                            upstream_idle_s=1.0) as (proxy, url):
            got, raised = await openai_stream_error(url + "/v1")
            assert "stream was cut (upstream_idle)" in raised.message, raised.message
            assert [c.choices[0].text for c in got] == ["t"]
            assert proxy.cut[(leg, "upstream_idle")] == 1 and sum(proxy.cut.values()) == 1
            assert metric(proxy, "shadow_router_streams_cut_total", leg=leg, reason="upstream_idle") == 1
            policy = "br0" if mode == "active" else "router"
            await until(lambda: metric(proxy, "shadow_router_requests_total", mode=mode, policy=policy,
                                       outcome="upstream_error") == 1, what="the stream counted failed")
        await up.stop()

    run(scenario)


def test_a_cut_stream_an_http10_client_reads_to_the_close_is_reset_not_ended() -> None:
    """An HTTP/1.0 client reads the body to the connection's close (no chunks): the listener's
    close after a cut stream would end it as complete. It resets the connection instead."""

    async def scenario() -> None:
        router = Stub([Step(events=[sse("t", 0)], cut=True)])
        await router.start()
        async with proxy_on({"d0": "http://127.0.0.1:9"}, router_url=router.url,
                            modes=StaticModeSource("shadow")) as (proxy, url):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            body = orjson.dumps(BODY)
            r, w = await asyncio.open_connection(host, int(port))
            w.write(b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body))
            with pytest.raises(ConnectionResetError):
                await r.read(-1)
            w.close()
            assert proxy.cut[("router", "upstream_broke")] == 1
        await router.stop()

    run(scenario)
