"""An upstream killed mid-stream behind `shadow serve --active` (issue 20): the official `openai`
client raises after the chunks that arrived (never a short completion returned as success), the
body the proxy sends ends without its terminating chunk, and the cut is on serve's /metrics as
`shadow_router_streams_cut_total{leg, reason="upstream_broke"}` — leg `decode` in mode active (the
proxy routes), leg `router` in mode shadow (it passes the request to the --front router).

The upstream is cut while both streams of a case are open, after their first events: a scripted
upstream resets its sockets (RST) or closes them without the terminating chunk (FIN), or a real
`shadow fleet` process is killed with SIGKILL (in mode shadow behind a real `shadow router`). One
stream is read as bytes to its end; the openai client leaves at the first relayed error event,
often before the break behind it reaches the proxy: both are counted cuts (upstream_error).
A scripted upstream that closes inside an event (issue 37: the client raised JSONDecodeError)
raises an API error in the openai client.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shadow.active.metrics import CUT_REASONS
from shadow.base.procs import shadow_argv
from tests.active.procs import shadow_process
from tests.active.raw_upstream import SSE_HEAD, Exchange, RawUpstream
from tests.active.test_fallback_e2e import wait_for
from tests.mirror.test_cut_streams import _event

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SENT = 3  # events the scripted upstream sends before it waits for the cut
LEG = {"active": "decode", "shadow": "router"}
MODEL, PROMPT, MAX_TOKENS = "sim-llm", "a b c d", 4000  # ignore_eos: the fleet streams all of them
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True}


@dataclass
class Cut:
    """The upstream of one case: `url` to route to, `cut()` kills every stream it has open."""

    url: str
    cut: Callable[[], None]


class Scripted:
    """A scripted upstream: `SENT` events on every stream, then (once cut) a reset or a plain close
    of every socket (`half`: after the first bytes of one more event), with no terminating chunk and
    no `data: [DONE]`."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.go = threading.Event()

    async def script(self, ex: Exchange) -> None:
        if ex.method != "POST":  # serve's scrapes of /metrics
            await ex.send(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        await ex.send(SSE_HEAD)
        for i in range(SENT):
            await ex.chunk(_event(i))
        while not self.go.is_set():  # the test's cut: a flag set from its thread
            await asyncio.sleep(0.01)
        if self.how == "reset":  # SO_LINGER 0: the close sends RST
            sock = ex.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            ex.writer.transport.abort()
            return
        if self.how == "half":  # inside an event: its `data:` line never ends
            await ex.chunk(_event(SENT)[:20])
        ex.writer.close()


@contextmanager
def upstream(how: str, mode: str) -> Iterator[Cut]:
    """The decode upstream (mode active) or the --front router (mode shadow) of one case."""
    if how != "sigkill":
        s = Scripted(how)
        with RawUpstream(s.script) as up:
            yield Cut(up.url, s.go.set)
        return
    fleet_args = ["fleet", "--prefill", "0", "--decode", "1", "--slots", "8", "--port", "0"]
    with shadow_process(fleet_args) as (fleet, ready):
        worker = ready["decode"][0]
        if mode == "active":
            yield Cut(worker, fleet.kill)
            return
        with shadow_process(["router", "--port", "0", "--decode", f"d0={worker}"]) as (_, router):
            yield Cut(router["url"], fleet.kill)


@contextmanager
def serve(mode: str, up: Cut, state: Path, *extra: str) -> Iterator[dict[str, Any]]:
    """`shadow serve --active` pinned in `mode` (and `extra` flags): in mode shadow the cut upstream
    is the --front router, and d0 (the mirror's worker) is the same server."""
    args = ["serve", "--upstream", f"d0={up.url}", "--slots", "16", "--scrape-interval", "3600",
            "--policies", "br0", "--active", "--mode", mode, "--pin-mode", "--stop-taps",
            "--state-dir", str(state), *extra]
    if mode == "shadow":
        args += ["--front", f"router={up.url}"]
    try:
        with shadow_process(args) as (_, ready):
            yield ready
    finally:
        subprocess.run(shadow_argv("tap", "--stop", "--all", "--state-dir", str(state)),
                       capture_output=True, timeout=120)


def cuts(api: str) -> dict[tuple[str, str], float]:
    """serve's `shadow_router_streams_cut_total` by (leg, reason)."""
    text = httpx.get(api + "/metrics", timeout=10).text
    return {(s.labels["leg"], s.labels["reason"]): s.value
            for f in text_string_to_metric_families(text) if f.name == "shadow_router_streams_cut"
            for s in f.samples if s.name == "shadow_router_streams_cut_total"}


def outcomes(api: str) -> dict[tuple[str, str], float]:
    """serve's `shadow_router_requests_total` by (mode, outcome), the series above 0."""
    text = httpx.get(api + "/metrics", timeout=10).text
    return {(s.labels["mode"], s.labels["outcome"]): s.value
            for f in text_string_to_metric_families(text) if f.name == "shadow_router_requests"
            for s in f.samples if s.name == "shadow_router_requests_total" and s.value}


def cut_after_sent(front: str, up: Cut) -> tuple[list[Any], openai.APIError]:
    """A stream through `front` with the official openai client, the upstream cut once SENT chunks
    arrived, read until the client raises (the test fails if it ends otherwise): the chunks, the error."""
    client = openai.OpenAI(base_url=front + "/v1", api_key="x", max_retries=0, timeout=120)
    got: list[Any] = []
    try:
        with pytest.raises(openai.APIError) as raised:
            stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                               stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                got.append(chunk)
                if len(got) == SENT:
                    up.cut()
    finally:
        client.close()
    return got, raised.value


class RawStream(threading.Thread):
    """One stream read as bytes: `got` (the body as it came), `error` (what ended the read, None
    for a clean end of the chunked body)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.got = b""
        self.status = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=BODY, timeout=120) as r:
                self.status = r.status_code
                for chunk in r.iter_raw():
                    self.got += chunk
        except httpx.HTTPError as exc:
            self.error = exc


@pytest.mark.parametrize("how", ["reset", "close", "sigkill"])
@pytest.mark.parametrize("mode", ["active", "shadow"])
def test_an_upstream_killed_mid_stream_raises_in_the_openai_client_and_is_counted(
        mode: str, how: str, tmp_path: Path) -> None:
    leg = LEG[mode]
    with upstream(how, mode) as up, serve(mode, up, tmp_path) as ready:
        front, api = ready["active"], ready["api"]
        assert cuts(api) == {(lg, r): 0.0 for lg in ("decode", "prefill", "router") for r in CUT_REASONS}
        raw = RawStream(front)  # a second stream, open when the cut comes: its bytes as sent
        raw.start()
        wait_for(lambda: b"\n\ndata: " in raw.got or not raw.is_alive(), "the raw stream's first events")
        assert raw.status == 200 and raw.is_alive(), (raw.status, raw.got, raw.error)

        got, raised = cut_after_sent(front, up)
        # the SSE error event made the client raise: the base APIError, not an HTTP status error
        assert type(raised) is openai.APIError, repr(raised)
        assert "stream was cut" in raised.message, raised.message
        assert len(got) >= SENT if how == "sigkill" else len(got) == SENT, got  # mid-stream
        assert all(c.choices[0].finish_reason is None for c in got), got

        raw.join(120)
        assert not raw.is_alive()
        # the body the client got ends without the terminating chunk, after the proxy's own event
        assert isinstance(raw.error, httpx.RemoteProtocolError), (raw.error, raw.got[-400:])
        assert f"shadow proxy: the {leg} stream was cut (upstream_broke)".encode() in raw.got, raw.got[-600:]
        assert b"[DONE]" not in raw.got and b'"finish_reason":"' not in raw.got.replace(b" ", b"")

        # The raw reader reads on to the break. The openai client leaves at the first SSE error
        # event (the tap's, or the router's in mode shadow) relayed ahead of the break, often
        # before the proxy reads the break (under load the shadow/sigkill case did 4 times in 6):
        # the error event it relayed makes that stream a counted cut too, never a client_cancel.
        def settled() -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]] | None:
            ended, cut = outcomes(api), cuts(api)
            done = sum(ended.values()) >= 2 and cut[(leg, "upstream_broke")] >= 2
            return (ended, cut) if done and sum(cut.values()) == ended.get((mode, "upstream_error")) else None

        try:
            ended, cut = wait_for(settled, f"both streams ended, the cuts counted for leg {leg}")
        except AssertionError as exc:  # say how the proxy ended them instead
            raise AssertionError(f"{exc}: cut {cuts(api)}, ended {outcomes(api)}") from None
        assert sum(ended.values()) == 2, ended
        assert set(ended) == {(mode, "upstream_error")}, ended
        assert cut[(leg, "upstream_broke")] == ended[(mode, "upstream_error")] == sum(cut.values()), cut


@pytest.mark.parametrize("mode", ["active", "shadow"])
def test_an_upstream_cut_inside_an_event_raises_an_api_error_in_the_openai_client(
        mode: str, tmp_path: Path) -> None:
    """Issue 37: the tap ended the event the worker left open before its own error event, so the
    openai client parsed the truncated event and raised JSONDecodeError, not an APIError. Now in
    mode active the proxy, which relays whole events, drops the open one and sends its own error
    event (APIError); in mode shadow it relays the bytes as they come, so the open event reaches
    the client as it came and the body is cut without an event: the client's transport fails
    (APIConnectionError). Counted as a cut either way."""
    leg = LEG[mode]
    with upstream("half", mode) as up, serve(mode, up, tmp_path) as ready:
        got, raised = cut_after_sent(ready["active"], up)
        if mode == "active":
            assert type(raised) is openai.APIError, repr(raised)
            assert "stream was cut (upstream_broke)" in raised.message, raised.message
        else:
            assert type(raised) is openai.APIConnectionError, repr(raised)
        assert len(got) == SENT and all(c.choices[0].finish_reason is None for c in got), got
        api = ready["api"]
        wait_for(lambda: cuts(api)[(leg, "upstream_broke")] == 1, f"the cut counted for leg {leg}")
        wait_for(lambda: outcomes(api) == {(mode, "upstream_error"): 1.0}, "the stream counted failed")


def test_an_upstream_silent_past_upstream_idle_is_cut_and_counted_on_serves_metrics(tmp_path: Path) -> None:
    """Issue 37: a worker that stops sending mid-stream held the client as long as httpx's read
    timeout (600 s, not settable). `--upstream-idle` bounds the silence: the stream is cut (the
    proxy's error event, then a body that never ends), counted as `upstream_idle`."""
    s = Scripted("stall")  # SENT events, then nothing (never cut)
    with RawUpstream(s.script) as raw, serve("active", Cut(raw.url, s.go.set), tmp_path,
                                             "--upstream-idle", "1") as ready:
        client = openai.OpenAI(base_url=ready["active"] + "/v1", api_key="x", max_retries=0, timeout=120)
        got: list[Any] = []
        with pytest.raises(openai.APIError) as raised:
            stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True)
            for chunk in stream:
                got.append(chunk)
        client.close()
        assert "stream was cut (upstream_idle)" in raised.value.message, raised.value.message
        assert len(got) <= SENT, got
        api = ready["api"]
        wait_for(lambda: cuts(api)[("decode", "upstream_idle")] == 1, "the idle cut counted")
        wait_for(lambda: outcomes(api) == {("active", "upstream_error"): 1.0}, "the stream counted failed")
