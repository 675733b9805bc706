"""`shadow serve --active`'s listeners (the client-facing proxy, the API/admin port) against hostile
peers, on a real serve process: half-open connections at a low open-files limit, unbounded request
heads, heads RFC 9112 says to refuse (no or two Hosts, Transfer-Encoding in HTTP/1.0), and what the
client port exposes (metrics, doubled headers); whom the connection cap closes in an accept burst
(in process).
"""

from __future__ import annotations

import resource
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.base.listener import AsgiListener, ListenerLimits
from shadow.base.loopthread import LoopThread
from tests.active.procs import shadow_process
from tests.active.raw_upstream import SSE_HEAD, Exchange, RawUpstream


async def answer(ex: Exchange) -> None:
    """A worker (or a router, in shadow mode): a short stream for a POST, 200 for anything else."""
    if ex.method != "POST":
        await ex.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        return
    await ex.send(SSE_HEAD)
    await ex.chunk(b'data: {"choices":[{"index":0,"text":"a","finish_reason":"length"}]}\n\n')
    await ex.chunk(b"data: [DONE]\n\n")
    await ex.end_chunks()


def serve(args: list[str], nofile: int | None = None) -> AbstractContextManager[
        tuple[subprocess.Popen[str], dict[str, Any]]]:
    return shadow_process(["serve", *args], nofile=nofile)


def _addr(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def _complete(proxy: str) -> bool:
    body = {"model": "m", "prompt": "p", "max_tokens": 1, "stream": True}
    with httpx.stream("POST", proxy + "/v1/completions", json=body, timeout=60) as r:
        return r.status_code == 200 and b"".join(r.iter_raw()).rstrip().endswith(b"data: [DONE]")


def test_half_open_connections_at_a_low_file_limit_are_evicted_and_nothing_flips(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 3000:
        pytest.skip(f"the test itself holds 1,100 sockets; the open-files hard limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 3000), hard))
    flag = tmp_path / "mode.yaml"
    flag.write_text("mode: active\npin: true\n")
    with RawUpstream(answer) as up:
        args = ["--upstream", f"d0={up.url}", "--slots", "16", "--scrape-interval", "3600",
                "--policies", "br0", "--active", "--mode-file", str(flag), "--mode-file-interval", "0.1",
                "--header-timeout", "60"]
        with serve(args, nofile=1024) as (proc, ready):
            api, proxy = ready["api"], ready["active"]
            socks = []
            try:
                for _ in range(1100):  # a head begun and never finished, on the API/admin port
                    s = socket.create_connection(_addr(api), timeout=10)
                    s.sendall(b"GET /v1/mode HTTP/1.1\r\nHost: x\r\n")
                    socks.append(s)
                # the flag file is read every 0.1 s: let it be read a few times with the sockets open
                state = httpx.get(api + "/v1/state", timeout=30).json()
                for _ in range(3):
                    assert _complete(proxy)
                mode = httpx.get(api + "/v1/mode", timeout=30).json()
            finally:
                for s in socks:
                    s.close()
            assert mode["current"] == "active" and mode["last_flag_error"] is None, mode["transitions"]
            api_counts = state["listeners"]["api"]
            assert api_counts["connections"] <= 256
            refused = api_counts["rejected"]
            # each beyond the cap closed an idle one, or got 503 when only unread newcomers were idle
            assert refused["evicted_idle"] + refused["busy"] >= 1100 - 256, refused
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
            assert proc.stderr is not None
            assert len(proc.stderr.read()) < 64 << 10  # no log line per connection


@pytest.mark.parametrize("port", ["api", "active"])
def test_an_endless_request_head_gets_431_at_the_cap(port: str) -> None:
    with RawUpstream(answer) as up:
        args = ["--upstream", f"d0={up.url}", "--slots", "16", "--scrape-interval", "3600",
                "--policies", "br0", "--active"]
        with serve(args) as (_, ready):
            s = socket.create_connection(_addr(ready[port]), timeout=30)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            sent = 0
            line = b"x-pad: " + b"a" * 8000 + b"\r\n"
            try:
                while sent < 256 << 20:  # the old listeners took all of it (RSS +337-540 MB)
                    s.sendall(line)
                    sent += len(line)
            except OSError:
                pass  # the listener answered and closed
            reply = b""
            try:
                while chunk := s.recv(65536):
                    reply += chunk
            except OSError:
                pass
            s.close()
            assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
            assert sent < 16 << 20, sent  # closed soon after the 64 KiB cap (socket buffers aside)
            many = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(200))
            s = socket.create_connection(_addr(ready[port]), timeout=30)
            s.sendall(many + b"\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 431 ")
            s.close()
            state = httpx.get(ready["api"] + "/v1/state", timeout=30).json()
            assert state["listeners"][port]["rejected"]["head_too_large"] == 2
            text = httpx.get(ready["api"] + "/metrics", timeout=30).text
            assert f'shadow_listener_rejected_total{{listener="{port}",reason="head_too_large"}} 2.0' in text


@contextmanager
def shadow_mode_serve() -> Iterator[dict[str, Any]]:
    """serve --active in mode shadow in front of a raw router, with a raw decode worker."""
    with RawUpstream(answer) as router, RawUpstream(answer) as worker:
        args = ["--front", f"router={router.url}", "--worker", f"d0={worker.url}", "--slots", "16",
                "--scrape-interval", "3600", "--policies", "br0", "--active", "--mode", "shadow"]
        with serve(args) as (_, ready):
            yield ready


#: Request heads a server must answer 400 and close (RFC 9112 3.2, 6.1), by name.
REFUSED_HEADS = {
    "no_host": b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n",
    "two_hosts": b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    "te_in_http10": b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"2\r\n{}\r\n0\r\n\r\n",
}


def _exchange(addr: tuple[str, int], data: bytes) -> bytes:
    """`data` on a new connection; every byte until the listener closes it."""
    s = socket.create_connection(addr, timeout=30)
    try:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):  # (the socket's 30 s timeout bounds a stuck answer)
            out += chunk
        return out
    finally:
        s.close()


def test_heads_rfc_9112_refuses_get_400_on_both_ports_counted_and_http10_without_host_is_served() -> None:
    """Issue 37: an HTTP/1.1 request without Host got 200, and an HTTP/1.0 one with
    Transfer-Encoding was served. Both ports answer 400 naming the fault and close, counted as
    bad_framing; HTTP/1.0 needs no Host."""
    with shadow_mode_serve() as ready:
        for port in ("active", "api"):
            addr = _addr(ready[port])
            for name, head in REFUSED_HEADS.items():
                out = _exchange(addr, head)
                assert out.startswith(b"HTTP/1.1 400 ") and b"connection: close" in out, (port, name, out)
            assert b"without a Host header" in _exchange(addr, REFUSED_HEADS["no_host"])
            said = _exchange(addr, REFUSED_HEADS["te_in_http10"])
            assert b"Transfer-Encoding in an HTTP/1.0 request" in said, said
            assert _exchange(addr, b"GET /health HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200 ")
        refused = len(REFUSED_HEADS) + 2  # per port
        state = httpx.get(ready["api"] + "/v1/state", timeout=30).json()
        text = httpx.get(ready["api"] + "/metrics", timeout=30).text.splitlines()
        for port in ("active", "api"):
            assert state["listeners"][port]["rejected"]["bad_framing"] == refused, state
            line = f'shadow_listener_rejected_total{{listener="{port}",reason="bad_framing"}} {refused:.1f}'
            assert line in text, [x for x in text if "rejected_total" in x]


def test_the_client_port_serves_no_metrics() -> None:
    with shadow_mode_serve() as ready:
        assert httpx.get(ready["active"] + "/metrics", timeout=10).status_code == 404
        assert httpx.get(ready["api"] + "/metrics", timeout=10).status_code == 200


def test_a_passed_through_answer_has_one_date_and_the_routers_server() -> None:
    with shadow_mode_serve() as ready:
        s = socket.create_connection(_addr(ready["active"]), timeout=30)
        body = b'{"model":"m","prompt":"p","stream":true}'
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        raw = b""
        while chunk := s.recv(65536):  # (the socket's 30 s timeout bounds a stuck answer)
            raw += chunk
        s.close()
        head = raw.split(b"\r\n\r\n", 1)[0].lower().split(b"\r\n")
        names = [ln.split(b":", 1)[0] for ln in head[1:]]
        assert names.count(b"date") == 1 and names.count(b"server") == 1, head
        assert b"server: raw-upstream" in head  # the router's own, passed through
        assert b"data: [DONE]" in raw


async def _ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _counts(ln: AsgiListener) -> dict[str, int]:
    return dict(ln.rejected)


def test_a_client_in_an_accept_burst_beyond_the_cap_is_read_not_evicted() -> None:
    """A flood makes the listener accept many connections at once (its loop was busy): the cap
    may close connections that had their chance (read from), never a newcomer of the same burst
    whose request may be waiting unread; newcomers beyond that get 503."""
    loop = LoopThread("listener-test")
    loop.start()
    assert loop.loop is not None
    ln = AsgiListener(_ok_app, lifespan="off", limits=ListenerLimits(max_connections=4, evict_grace_s=60.0))
    addr = _addr(loop.call(ln.start()))
    get = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    socks: list[socket.socket] = []
    release = threading.Event()
    try:
        for _ in range(4):  # keep-alive clients, each served once and idle since
            s = socket.create_connection(addr, timeout=30)
            s.sendall(get)
            assert s.recv(65536).startswith(b"HTTP/1.1 200 "), "a first request"
            socks.append(s)
        blocked = threading.Event()

        def stall() -> None:  # the listener's loop busy elsewhere while connections queue up
            blocked.set()
            release.wait(60)

        loop.loop.call_soon_threadsafe(stall)
        assert blocked.wait(30)
        client = socket.create_connection(addr, timeout=30)  # (the kernel completes the handshakes)
        client.sendall(get)
        for _ in range(4):  # the listen backlog is the cap: Linux queues cap + 1 handshakes
            s = socket.create_connection(addr, timeout=30)
            s.sendall(b"GET / HTTP/1.1\r\n")
            socks.append(s)
        release.set()
        reply = client.recv(65536)
        client.close()
        # the old rule (the oldest idle, whatever it was) closed the client: the 5th newcomer found
        # it the oldest idle connection before its request was read
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
        counts = loop.call(_counts(ln))
        assert counts["evicted_idle"] == 4 and counts["busy"] == 1, counts
    finally:
        release.set()
        for s in socks:
            s.close()
        loop.call(ln.stop(grace_s=0))
        loop.stop()


def _late_head_is_408_and_the_silent_connection_still_serves(addr: tuple[str, int], path: str = "/") -> bytes:
    """A connection opened and left silent (as a client's pool opens one it uses later), then a
    partial head on a second connection until its 408 (the header deadline has passed for both),
    then a request on the first: the answer it gets."""
    silent = socket.create_connection(addr, timeout=30)
    try:
        late = socket.create_connection(addr, timeout=30)
        late.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n" % path.encode())
        assert late.recv(65536).startswith(b"HTTP/1.1 408 ")
        late.close()
        silent.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
        return silent.recv(65536)
    finally:
        silent.close()


def test_a_connection_that_has_sent_nothing_is_idle_not_a_late_head() -> None:
    """Before, a new connection got 408 after the header deadline though it had sent no byte: a
    request the client sent on it then (hyper's pool keeps connections it opened for a race it
    lost) read the 408 as its answer. Now it is idle: closed after the idle timeout, unanswered."""
    loop = LoopThread("listener-test")
    loop.start()
    ln = AsgiListener(_ok_app, lifespan="off", limits=ListenerLimits(header_timeout_s=0.2, idle_timeout_s=60))
    try:
        addr = _addr(loop.call(ln.start()))
        reply = _late_head_is_408_and_the_silent_connection_still_serves(addr)
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
        counts = loop.call(_counts(ln))
        assert counts["header_timeout"] == 1, counts
    finally:
        loop.call(ln.stop(grace_s=0))
        loop.stop()
