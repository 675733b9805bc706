"""Differential fuzzing of the active proxy's request framing (its client port, `AsgiListener` over
llhttp) against a strict HTTP/1.1 parser (h11) reading the same bytes, with a recording uvicorn+h11
upstream as the decode worker.

Hypothesis generates pipelined request sequences (POST completions with JSON or other bodies, GET
/v1/models, local and unknown routes; Content-Length, chunked or no body; HTTP/1.1 and 1.0;
keep-alive or close; requests hidden in bodies), then either leaves them clean, applies one named
smuggling trick to one request (CL+TE, TE+CL, duplicate or odd Content-Length, obfuscated
Transfer-Encoding, obs-fold, bare LF/CR, two Hosts or none in HTTP/1.1, Transfer-Encoding in
HTTP/1.0, NUL, bad chunk-size lines, a Content-Length trailer), or edits random bytes. Each
sequence is written, split at random points, to the proxy. Per example it shows:
- what reaches the upstream is, in order, a prefix of what h11 frames from the same bytes and the
  proxy would forward (`E`): the same method, path and body bytes, each once — so nothing hidden in
  a body, after a rejected request or after `Connection: close` is ever forwarded;
- a clean sequence: every request is answered in order, and all of `E` reaches the upstream;
- a trick: the connection ends with the listener's 400 (counted as bad_framing), nothing of the
  tricked request or after it reaches the upstream;
- every connection ends (answered, or closed by the listener's deadlines) and the proxy then serves
  a normal completion.
The fuzz runs the same app and listener `shadow router` runs (`router_proxy(config).app` in an
`AsgiListener`), in process with short deadlines so a connection left waiting ends in about a
second; the named smuggling shapes below run against a real `shadow router` process, each beside
the same bytes sent straight to the upstream (the attack is real there).
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import h11
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shadow.active.standin import RouterConfig, router_proxy
from shadow.base.listener import AsgiListener, ListenerLimits
from shadow.base.loopthread import LoopThread
from tests.active.procs import shadow_process
from tests.mirror.h11_upstream import H11Server, Recorder, recording_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

GENERATE = ("/v1/completions", "/v1/chat/completions")
HIDDEN = b"GET /v1/models HTTP/1.1\r\nHost: hidden\r\n\r\n"  # (no real request has this Host)
CANNED_400 = b"malformed or ambiguous HTTP/1.1 request"  # the listener's framing refusal
# Short, so a connection left waiting ends soon; long enough that a loaded machine still writes a
# whole example (its pieces go out back to back) within them.
# 5 s: at 1.5 s a piece of an example sent late on a loaded host (load ~10) hit the deadline
LIMITS = ListenerLimits(header_timeout_s=5.0, body_timeout_s=5.0, idle_timeout_s=5.0)

Record = tuple[str, str, bytes]  # (method, path, body) as the upstream framed it


# -- the requests -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One request of a sequence, before serialization."""

    method: bytes
    path: bytes
    version: bytes
    headers: tuple[bytes, ...]
    body: bytes
    framing: str  # "cl" | "chunked" | "none"


def _chunks(body: bytes, size_line: Callable[[int], bytes] | None = None) -> bytes:
    """`body` as one chunk (or none) and the last chunk; `size_line` writes the first size line."""
    sl = size_line or (lambda n: b"%x\r\n" % n)
    return (sl(len(body)) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"


def serialize(p: Part, trick: str | None = None, at: int = 0) -> bytes:
    """The request's bytes; `trick` makes its framing ambiguous or invalid (TRICKS), `at` picks
    where when there is a choice."""
    framing_lines: list[bytes] = []
    payload = b""
    if p.framing == "cl":
        framing_lines = [b"Content-Length: %d" % len(p.body)]
        payload = p.body
    elif p.framing == "chunked":
        framing_lines = [b"Transfer-Encoding: chunked"]
        payload = _chunks(p.body)
    head = [b"Host: x", *p.headers]
    version = p.version
    n = len(p.body)
    if trick == "cl_te":  # CL.TE: a front reading Content-Length sees the chunks as the body
        payload = _chunks(p.body)
        framing_lines = [b"Content-Length: %d" % len(payload), b"Transfer-Encoding: chunked"]
    elif trick == "te_cl":  # TE.CL
        payload = _chunks(p.body)
        framing_lines = [b"Transfer-Encoding: chunked", b"Content-Length: 4"]
    elif trick == "dup_cl":
        payload, framing_lines = p.body, [b"Content-Length: 0", b"Content-Length: %d" % n]
    elif trick == "dup_cl_same":
        payload, framing_lines = p.body, [b"Content-Length: %d" % n] * 2
    elif trick == "cl_list":
        payload, framing_lines = p.body, [b"Content-Length: %d, %d" % (n, n)]
    elif trick == "cl_sign":
        payload, framing_lines = p.body, [b"Content-Length: +%d" % n]
    elif trick == "neg_cl":
        payload, framing_lines = p.body, [b"Content-Length: -%d" % (n + 1)]
    elif trick == "te_obfuscated":  # TE.TE: one side does not see `chunked`
        te = [b"xchunked", b"chunked, identity", b"identity", b"chunked\x0b", b"chunk"][at % 5]
        payload = _chunks(p.body)
        framing_lines = [b"Transfer-Encoding: " + te, b"Content-Length: %d" % len(payload)]
    elif trick == "te_two":
        payload = _chunks(p.body)
        framing_lines = [b"Transfer-Encoding: chunked", b"Transfer-Encoding: identity"]
    elif trick == "te_space_colon":
        payload = _chunks(p.body)
        framing_lines = [b"Transfer-Encoding : chunked", b"Content-Length: %d" % len(payload)]
    elif trick == "obs_fold":  # a folded Content-Length line
        head.append(b"X-A: 1\r\n Content-Length: 40")
    elif trick == "two_hosts":
        head.append(b"Host: y")
    elif trick == "no_host":  # RFC 9112 3.2: HTTP/1.1 needs one
        head.remove(b"Host: x")
        version = b"1.1"
    elif trick == "te_in_http10":  # RFC 9112 6.1: faulty framing
        payload, framing_lines, version = _chunks(p.body), [b"Transfer-Encoding: chunked"], b"1.0"
    elif trick == "nul":
        head.append(b"X-A: a\x00b")
    elif trick in CHUNK_TRICKS:
        framing_lines = [b"Transfer-Encoding: chunked"]
        body = p.body or b"{}"
        if trick == "chunk_no_crlf":
            payload = b"%x\r\n%s0\r\n\r\n" % (len(body), body)
        elif trick == "trailer_cl":
            payload = b"%x\r\n%s\r\n0\r\nContent-Length: 9\r\n\r\n" % (len(body), body)
        else:
            size = {
                "chunk_neg": lambda k: b"-%x\r\n" % k,
                "chunk_junk": lambda k: b"zz\r\n",
                "chunk_0x": lambda k: b"0x%x\r\n" % k,
                "chunk_huge": lambda k: b"ffffffffffffffffff\r\n",
                "chunk_space": lambda k: b"%x \r\n" % k,
                "chunk_lf": lambda k: b"%x\n" % k,
            }[trick]
            payload = _chunks(body, size)
    lines = [b"%s %s HTTP/%s" % (p.method, p.path, version), *head, *framing_lines]
    if trick in ("bare_lf", "bare_cr"):  # one line of the head (or its blank line) ends in LF / CR
        i = at % (len(lines) + 1)
        ends = [b"\r\n"] * (len(lines) + 1)
        ends[i] = b"\n" if trick == "bare_lf" else b"\r"
        data = b"".join(ln + e for ln, e in zip([*lines, b""], ends, strict=True)) + payload
        # a CR that ends the bytes is a CRLF cut short (a head still coming: a 408 in time), not a
        # bare CR: a byte follows it that is no LF
        return data + b"x" if data.endswith(b"\r") else data
    return b"\r\n".join(lines) + b"\r\n\r\n" + payload


CHUNK_TRICKS = ("chunk_neg", "chunk_junk", "chunk_0x", "chunk_huge", "chunk_space", "chunk_lf",
                "chunk_no_crlf", "trailer_cl")
HEAD_TRICKS = ("cl_te", "te_cl", "dup_cl", "dup_cl_same", "cl_list", "cl_sign", "neg_cl", "te_obfuscated",
               "te_two", "te_space_colon", "obs_fold", "two_hosts", "no_host", "te_in_http10", "nul",
               "bare_lf", "bare_cr")
TRICKS = HEAD_TRICKS + CHUNK_TRICKS
BLOBS = [b"\r", b"\n", b" ", b"\t", b"\x00", b":", b"0", b"-", b"\r\n", b"\r\n\r\n"]


def _edit(data: bytes, name: str, pos: int, blob: bytes) -> bytes:
    at = pos % (len(data) + 1)
    if name == "flip" and data:
        i = pos % len(data)
        return data[:i] + blob[:1] + data[i + 1 :]
    if name == "insert":
        return data[:at] + blob + data[at:]
    return data[:at] + data[at + 1 + (len(blob) % 8) :]  # delete


JSON_BODY = st.builds(
    lambda p, s: orjson.dumps({"model": "m", "prompt": p, "max_tokens": 1, "stream": s}),
    st.text(st.characters(codec="ascii"), max_size=16), st.just(False),
)
BODIES = st.one_of(JSON_BODY, JSON_BODY, st.binary(max_size=24), st.just(HIDDEN), st.just(b"[1,2]"))


@st.composite
def parts(draw: st.DrawFn, last: bool) -> Part:
    kind = draw(st.sampled_from(["generate", "generate", "generate", "models", "local", "other"]))
    if kind == "generate":
        method, path = b"POST", draw(st.sampled_from([p.encode() for p in GENERATE]))
    elif kind == "models":
        method, path = b"GET", b"/v1/models"
    elif kind == "local":
        method, path = b"GET", draw(st.sampled_from([b"/health", b"/healthcheck"]))
    else:
        method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE"]))
        path = draw(st.sampled_from([b"/v1/completions", b"/fleet/faults", b"/v1/models?x=1", b"/metricz"]))
    version = draw(st.sampled_from([b"1.1", b"1.1", b"1.1", b"1.0"]))
    framings = ["cl", "chunked", "none"] if method != b"POST" else ["cl", "cl", "chunked"]
    if version == b"1.0":
        framings.remove("chunked")  # (Transfer-Encoding in HTTP/1.0 is the trick te_in_http10)
    framing = draw(st.sampled_from(framings))
    body = draw(BODIES) if framing != "none" else b""
    extra = st.sampled_from([b"X-A: 1", b"Accept: */*", b"User-Agent: fz"])
    headers = list(draw(st.lists(extra, max_size=2)))
    if last:
        headers.append(b"Connection: close")  # the connection ends once it is answered
    elif version == b"1.0":
        headers.append(b"Connection: keep-alive")
    elif draw(st.integers(0, 7)) == 0:
        headers.append(b"Connection: close")  # what follows must not be served at all
    return Part(method, path, version, tuple(headers), body, framing)


@dataclass(frozen=True)
class Case:
    parts: tuple[Part, ...]
    kind: str  # "clean" | "trick" | "noise"
    trick: str | None
    at: int  # the tricked request
    data: bytes
    cuts: tuple[int, ...]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(1, 4))
    ps = tuple(draw(parts(last=i == n - 1)) for i in range(n))
    kind = draw(st.sampled_from(["clean", "trick", "trick", "noise"]))
    trick, at = None, 0
    if kind != "clean":
        at = draw(st.integers(0, n - 1))
        trick = draw(st.sampled_from(TRICKS)) if kind == "trick" or draw(st.booleans()) else None
    where = draw(st.integers(0, 1000))
    data = b"".join(serialize(p, trick if i == at else None, where) for i, p in enumerate(ps))
    if kind == "noise":
        for _ in range(draw(st.integers(1, 3))):
            name = draw(st.sampled_from(["flip", "insert", "delete"]))
            data = _edit(data, name, draw(st.integers(0, 10_000)), draw(st.sampled_from(BLOBS)))
    cuts = tuple(sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=4)))))
    return Case(ps, kind, trick, at, data, cuts)


# -- the references -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Framed:
    method: str
    path: str
    body: bytes
    keep_alive: bool


class _Broken(Exception):
    """h11 refused a request, or its bytes ended; `head` is its head when h11 had read that."""

    def __init__(self, end: str, head: Framed | None) -> None:
        super().__init__(end)
        self.end, self.head = end, head


def _framed(req: h11.Request, body: bytes) -> Framed:
    tokens = {t.strip().lower() for n, v in req.headers if n == b"connection" for t in v.split(b",")}
    keep = b"close" not in tokens if req.http_version == b"1.1" else b"keep-alive" in tokens
    path = urllib.parse.unquote(urllib.parse.urlsplit(req.target.decode("ascii")).path or "/")
    return Framed(req.method.decode(), path, body, keep)


def _one_request(data: bytes) -> tuple[Framed, bytes]:
    """The first request h11 frames from `data` and the bytes after it (_Broken: it refuses it, or
    `data` ends first)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    head: Framed | None = None
    body: list[bytes] = []
    while True:
        try:
            ev = conn.next_event()
        except h11.RemoteProtocolError:
            raise _Broken("error", head) from None
        if ev is h11.NEED_DATA:
            raise _Broken("incomplete", head)
        if isinstance(ev, h11.Request):
            if ev.http_version == b"1.0" and any(n == b"transfer-encoding" for n, _ in ev.headers):
                raise _Broken("error", None)  # RFC 9112 6.1 (h11 reads its chunks)
            head = _framed(ev, b"")
            req = ev
        elif isinstance(ev, h11.Data):
            body.append(bytes(ev.data))
        elif isinstance(ev, h11.EndOfMessage):
            return _framed(req, b"".join(body)), bytes(conn.trailing_data[0])


@dataclass(frozen=True)
class Reading:
    """What h11 frames from some bytes: the requests, why it stops ("error", "incomplete", "close":
    a request ended the connection, "end"), and the head of the request it stopped inside."""

    frames: list[Framed]
    end: str
    head: Framed | None = None

    def allowed(self) -> list[Record]:
        """What the proxy may forward, in order: the framed requests it forwards, and the one it
        stopped inside when its head was read and the proxy answers it without reading its body
        (GET /v1/models: the listener starts a request once its head is in)."""
        out = expected(self.frames)
        fwd = forwarded(self.head) if self.head is not None and not _generate(self.head) else None
        return [*out, fwd] if fwd is not None else out


def h11_frames(data: bytes) -> Reading:
    """The requests a strict HTTP/1.1 server (h11) frames from `data`, in order. Each request is
    read by a fresh h11 connection from the bytes the last left, so an HTTP/1.0 keep-alive is
    honoured as the listener does (h11 itself closes after 1.0). Empty lines before a request line
    are skipped (RFC 9112 2.2), as the listener does; an HTTP/1.0 request with Transfer-Encoding is
    refused (RFC 9112 6.1), which h11 reads."""
    out: list[Framed] = []
    rest = data
    while True:
        while rest.startswith(b"\r\n"):
            rest = rest[2:]
        if not rest:
            return Reading(out, "end")
        try:
            framed, rest = _one_request(rest)
        except _Broken as b:
            return Reading(out, b.end, b.head)
        out.append(framed)
        if not framed.keep_alive:
            return Reading(out, "close")


def forwarded(f: Framed) -> Record | None:
    """What the proxy sends the upstream for a request it read as `f` (None: answered itself)."""
    if _generate(f):
        try:
            ok = isinstance(orjson.loads(f.body), dict)
        except orjson.JSONDecodeError:
            ok = False
        return ("POST", f.path, f.body) if ok else None
    if f.method == "GET" and f.path == "/v1/models":
        return ("GET", "/v1/models", b"")
    return None


def _generate(f: Framed) -> bool:
    return f.method == "POST" and f.path in GENERATE


def expected(frames: list[Framed]) -> list[Record]:
    return [r for r in map(forwarded, frames) if r is not None]


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    close: bool  # it says `connection: close`


def responses(raw: bytes) -> list[Answer]:
    """The complete responses in `raw`, read in order by h11 as the client."""
    out: list[Answer] = []
    rest = raw
    while rest:
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        conn.send(h11.EndOfMessage())
        conn.receive_data(rest)
        status, body, close = 0, b"", False
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                return out  # a response cut short
            if isinstance(ev, h11.Response):
                status = ev.status_code
                close = any(n == b"connection" and b"close" in v.lower() for n, v in ev.headers)
            elif isinstance(ev, h11.Data):
                body += bytes(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                break
        out.append(Answer(status, body, close))
        rest = bytes(conn.trailing_data[0])
    return out


# -- the wire -----------------------------------------------------------------------------------


def send_raw(port: int, data: bytes, cuts: tuple[int, ...] = (), *, half_close: bool = False,
             timeout: float = 30.0) -> bytes:
    """Write `data` (split at `cuts`) and read until the peer closes; AssertionError if it has not
    closed within `timeout`."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = bytearray()
    try:
        prev = 0
        try:
            for c in [*cuts, len(data)]:
                if c > prev:
                    s.sendall(data[prev:c])
                    prev = c
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the peer closed early (a refused request): read what it said
        deadline = time.monotonic() + timeout
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                got = s.recv(65536)
            except TimeoutError:
                left = bytes(out)[:300]
                raise AssertionError(f"the connection is still open after {timeout} s: {left!r}") from None
            except OSError:
                break  # reset: what came before is what the client got
            if not got:
                break
            out += got
    finally:
        s.close()
    return bytes(out)


def wait_for(pred: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return bool(pred())


def take(rec: Recorder) -> list[Record]:
    """What the upstream framed so far (cleared)."""
    with rec.lock:
        seen, rec.seen = rec.seen, []
    return [(s.method, s.path, s.body) for s in seen]


def normal_completion(url: str, rec: Recorder, tag: str) -> None:
    """The proxy serves a completion, and it reaches the upstream once, as sent."""
    body = orjson.dumps({"model": "m", "prompt": tag, "max_tokens": 1})
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 200 and r.content == b"ok /v1/completions", (r.status_code, r.content[:200])
    assert wait_for(lambda: rec.inflight == 0)
    assert take(rec) == [("POST", "/v1/completions", body)]


# -- the fuzz (in process: the router's app and listener, short deadlines) -----------------------


@dataclass
class FuzzRig:
    rec: Recorder
    loop: LoopThread
    listener: AsgiListener
    up: H11Server

    @property
    def url(self) -> str:
        return self.listener.url

    def quiet(self) -> bool:
        """No request running on the listener, none at the upstream, and none on its way there (a
        request forwarded before its client's connection ended, still unread by the upstream)."""
        return (self.loop.sync(lambda: len(self.listener.tasks)) == 0 and self.rec.inflight == 0
                and self.up.settled())


@pytest.fixture(scope="module")
def fuzz_rig() -> Iterator[FuzzRig]:
    rec = Recorder()
    loop = LoopThread("framing-fuzz")
    loop.start()
    with H11Server(recording_app(rec), keep_alive_s=5) as up:
        ln = AsgiListener(router_proxy(RouterConfig(decode={"d0": up.url})).app, limits=LIMITS,
                          name="shadow router")
        loop.call(ln.start())
        try:
            yield FuzzRig(rec, loop, ln, up)
        finally:
            loop.call(ln.stop(1.0))
            loop.stop()


def _pre(frames: list[Record], got: list[Record]) -> bool:
    return frames[: len(got)] == got


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_the_proxy_forwards_only_what_a_strict_parser_frames(fuzz_rig: FuzzRig, case: Case) -> None:
    rig = fuzz_rig
    assert wait_for(rig.quiet)
    take(rig.rec)
    refused_before = rig.loop.sync(lambda: rig.listener.rejected["bad_framing"])
    out = send_raw(rig.listener.port, case.data, case.cuts, timeout=30)
    assert wait_for(rig.quiet), "a request still running after its connection ended"
    got = take(rig.rec)
    answers = responses(out)
    refused = rig.loop.sync(lambda: rig.listener.rejected["bad_framing"]) - refused_before
    reading = h11_frames(case.data)
    frames, end = reading.frames, reading.end
    ctx = (case, got, answers, out[-300:])
    # the upstream got, in order, a prefix of what h11 frames from these bytes and the proxy forwards
    assert _pre(reading.allowed(), got), (ctx, reading)
    if case.kind == "clean":
        assert [f.path for f in frames] == [
            urllib.parse.urlsplit(p.path.decode()).path for p in case.parts[: len(frames)]
        ] and end in ("close", "end"), (case, reading)
        m = len(answers)
        if m < len(frames):  # the listener answered a request before its body was in (a route that
            # does not read it) and closed there, saying so: nothing after it is read
            assert m > 0 and answers[-1].close and not _generate(frames[m - 1]), ctx
            event("clean: an answer before its body closed the connection")
        assert got == expected(frames[:m]), ctx  # every request answered reached the upstream, once
        assert refused == 0, ctx
        for f, a in zip(frames, answers, strict=False):
            if forwarded(f) is not None:
                assert a.status == 200 and a.body == b"ok " + f.path.encode(), (ctx, f)
    elif case.kind == "trick":
        served = h11_frames(b"".join(serialize(p) for p in case.parts[: case.at]))
        tricked = case.parts[case.at]
        head = Framed(tricked.method.decode(), urllib.parse.urlsplit(tricked.path.decode()).path, b"", True)
        body_trick = case.trick in CHUNK_TRICKS  # its head is valid: it may be answered before its body
        may = Reading(served.frames, served.end, head if body_trick else None)
        assert _pre(may.allowed(), got), ctx  # nothing of the tricked request (but see allowed) or after
        if served.end == "end":  # no request before it closed the connection: it is read
            last = answers[-1] if answers else None
            if last is not None and last.status == 400 and CANNED_400 in last.body:
                assert refused == 1, ctx
                event(f"trick {case.trick}: refused")
            else:  # a request answered before its body was in (the tricked one, when its trick is in
                # its body) closed the connection, saying so
                assert last is not None and last.close and len(answers) <= case.at + body_trick, ctx
                assert not _generate([*served.frames, head][len(answers) - 1]) and refused == 0, ctx
                event("trick: not read (an answer before it closed)")
    if b"GET /v1/models" not in case.data.replace(HIDDEN, b""):
        assert ("GET", "/v1/models", b"") not in got, ctx  # a request hidden in a body is never sent
    event(f"{case.kind}: {len(got)} forwarded, h11 {end}")
    if len(got) < len(expected(frames)):
        event("the proxy forwarded less than h11 frames")
    normal_completion(rig.url, rig.rec, "alive")


# -- the named smuggling shapes, against a real `shadow router` process --------------------------


@dataclass
class RouterRig:
    rec: Recorder
    up: H11Server
    port: int
    url: str

    def direct(self, data: bytes, n: int) -> list[Record]:
        """The same bytes straight to the upstream: what it frames once it framed `n` requests."""
        send_raw(self.up.port, data, half_close=True, timeout=30)
        assert wait_for(lambda: len(self.rec.seen) >= n and self.rec.inflight == 0)
        return take(self.rec)


@pytest.fixture(scope="module")
def router() -> Iterator[RouterRig]:
    rec = Recorder()
    with H11Server(recording_app(rec), keep_alive_s=5) as up, shadow_process(
        ["router", "--decode", f"d0={up.url}", "--port", "0"]
    ) as (_, ready):
        url = ready["url"]
        yield RouterRig(rec, up, int(url.rsplit(":", 1)[1]), url)


COMPLETION = orjson.dumps({"model": "m", "prompt": "smuggler", "max_tokens": 1})
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


def _refused(rig: RouterRig, data: bytes) -> None:
    """The proxy answers `data` with its 400 and closes; the upstream gets nothing from it (a
    normal completion sent after it is all the upstream sees)."""
    assert wait_for(lambda: rig.rec.inflight == 0)
    take(rig.rec)
    out = send_raw(rig.port, data)
    answers = responses(out)
    assert len(answers) == 1 and answers[0].status == 400 and CANNED_400 in answers[0].body, out
    normal_completion(rig.url, rig.rec, "after")  # (take() in it asserts nothing else arrived)


def test_cl_te_is_refused_and_nothing_is_smuggled(router: RouterRig) -> None:
    chunks = b"0\r\n\r\n" + SMUGGLED
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n%s" % (len(chunks), chunks))
    # straight to uvicorn+h11: chunked wins, the GET after the last chunk is a second request
    assert router.direct(data, 2) == [("POST", "/v1/completions", b""), ("GET", "/v1/models", b"")]
    _refused(router, data)


def test_te_cl_is_refused_and_nothing_is_smuggled(router: RouterRig) -> None:
    inner = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
        len(COMPLETION), COMPLETION)
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Length: 4\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(inner), inner))
    # h11 reads the chunks: the inner request is its body (a Content-Length front would not)
    assert router.direct(data, 1) == [("POST", "/v1/completions", inner)]
    _refused(router, data)


@pytest.mark.parametrize("te", [b"Transfer-Encoding: chunked\r\nTransfer-Encoding: x",
                                b"Transfer-Encoding : chunked", b"Transfer-Encoding: xchunked",
                                b"Transfer-Encoding: chunked, identity", b"Transfer-Encoding: chunked\x0b"])
def test_te_te_with_an_obfuscated_transfer_encoding_is_refused(router: RouterRig, te: bytes) -> None:
    body = b"0\r\n\r\n" + SMUGGLED
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n%s\r\nContent-Length: %d\r\n\r\n%s"
            % (te, len(body), body))
    _refused(router, data)


def test_two_content_lengths_are_refused(router: RouterRig) -> None:
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: %d\r\n\r\n%s"
            % (len(COMPLETION), COMPLETION)) + SMUGGLED
    # h11 refuses the conflict too: nothing reaches the upstream either way
    assert h11_frames(data) == Reading([], "error")
    _refused(router, data)


def test_a_pipelined_request_after_a_body_is_forwarded_once_in_order(router: RouterRig) -> None:
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(COMPLETION), COMPLETION)) + SMUGGLED.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    want = [("POST", "/v1/completions", COMPLETION), ("GET", "/v1/models", b"")]
    assert router.direct(data, 2) == want
    out = send_raw(router.port, data)
    assert [a.status for a in responses(out)] == [200, 200], out
    assert wait_for(lambda: router.rec.inflight == 0)
    assert take(router.rec) == want


def test_a_request_hidden_in_a_body_is_not_forwarded(router: RouterRig) -> None:
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (len(SMUGGLED), SMUGGLED))
    assert router.direct(data, 1) == [("POST", "/v1/completions", SMUGGLED)]
    out = send_raw(router.port, data)
    assert [a.status for a in responses(out)] == [400], out  # not JSON: the proxy's own answer
    normal_completion(router.url, router.rec, "after")


def test_a_request_after_a_refused_one_is_not_forwarded(router: RouterRig) -> None:
    data = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n fold\r\n\r\n" + SMUGGLED
    _refused(router, data)


@pytest.mark.parametrize("ender", [b"HTTP/1.1\r\nConnection: close", b"HTTP/1.0"])
def test_bytes_after_a_request_that_ends_its_connection_are_ignored_not_refused(
    router: RouterRig, ender: bytes
) -> None:
    """RFC 9112 9.6: the request asking to close is answered, nothing after it is processed (the
    listener answered 400 instead, dropping the request, when more bytes came with it)."""
    data = (b"POST /v1/completions %s\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (ender, len(COMPLETION), COMPLETION)) + SMUGGLED
    assert wait_for(lambda: router.rec.inflight == 0)
    take(router.rec)
    out = send_raw(router.port, data)
    assert [(a.status, a.body) for a in responses(out)] == [(200, b"ok /v1/completions")], out
    assert wait_for(lambda: router.rec.inflight == 0)
    assert take(router.rec) == [("POST", "/v1/completions", COMPLETION)]


@pytest.mark.parametrize("size", [b"-29", b"zz", b"ffffffffffffffffff"])
def test_a_request_refused_for_its_body_framing_never_reaches_the_app(router: RouterRig, size: bytes) -> None:
    """GET /v1/models (a route that does not read the body) with a bad chunk size, in one write:
    answered 400, and the upstream is not asked (the app ran the request the client was refused)."""
    data = (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%s\r\n%s\r\n0\r\n\r\n"
            % (size, COMPLETION))
    _refused(router, data)
