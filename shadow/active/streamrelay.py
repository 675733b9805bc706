"""The one SSE relay loop of the active proxy, and the streaming response it runs in.

`LegRelay.relay(chunks)` forwards one upstream answer's body (an async iterable of the bytes read
off the socket) to the client and has a `StreamTally` account it. It cuts the body into SSE events
with `vllm.sse.EventSplitter` in both of its ways of forwarding:

- `aligned` (the P/D decode stream): event by event, each as soon as its blank line arrived (an
  event over the splitter's cap is forwarded as it comes and counted in `ProxyCounts.oversized_events`);
  a whole event for which `stop(event)` holds is not forwarded and ends this leg (`stopped`), with
  the rest of the body unread; the unfinished end of a body that ends is forwarded last;
- not aligned (the shadow-mode passthrough): every chunk as it came, bytes and boundaries unchanged,
  the splitter only counting.

`on_first(t)` runs when the answer's first byte arrives, `on_sent(out)` before each forward.
Upstream errors (httpx) propagate to the caller, which ends the stream: `cut_event`/`cut_reason`
name an early end, `StreamCut` raised after its last bytes ends the response incomplete
(`RelayResponse`), and `in_span` runs a body in its request's trace context.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from typing import Any

import httpx
from opentelemetry import context as otel_context
from opentelemetry import trace
from starlette.responses import StreamingResponse

from shadow.active.proxycounts import ProxyCounts
from shadow.active.streamtally import StreamTally
from shadow.vllm.errors import cut_event as vllm_cut_event
from shadow.vllm.sse import EventSplitter


class StreamCut(Exception):
    """Raised by a relayed body after its last bytes: end the response without completing it."""


def cut_event(leg: str, reason: str, tail: bytes) -> bytes | None:
    """The SSE error event that ends a cut stream, None when `tail` (the last bytes sent) leaves an
    event open (`vllm.errors.cut_event`: the stream is cut without one)."""
    return vllm_cut_event(f"shadow proxy: the {leg} stream was cut ({reason})", tail)


def cut_reason(exc: httpx.HTTPError) -> str:
    """Why an upstream's answer broke off: it sent nothing for `upstream_idle_s`, or it broke."""
    return "upstream_idle" if isinstance(exc, httpx.ReadTimeout) else "upstream_broke"


class LegRelay:
    """One upstream answer relayed to the client (see module docstring); `split` is None for a body
    that is no event stream (forwarded as it comes, nothing counted)."""

    def __init__(
        self,
        tally: StreamTally,
        split: EventSplitter | None,
        *,
        aligned: bool = False,
        counts: ProxyCounts | None = None,
        on_first: Callable[[float], None] | None = None,
        on_sent: Callable[[bytes], None] | None = None,
        stop: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.tally, self.split, self.counts = tally, split, counts
        self.aligned = aligned and split is not None
        self.on_first, self.on_sent, self.stop = on_first, on_sent, stop
        self.stopped = False  # a `stop` event ended this leg

    async def relay(self, chunks: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
        """The bytes to forward, in order; the tally is fed as they are read and sent."""
        tally, split = self.tally, self.split
        first = True
        async for chunk in chunks:
            if first and chunk:
                first = False
                t = time.perf_counter()
                if self.on_first is not None:
                    self.on_first(t)
                tally.first_byte(t)
            if split is None or not self.aligned:
                for piece, whole in split.feed(chunk) if split is not None else ():
                    tally.event(piece, whole)
                out: bytes | None = chunk
            else:
                out = self._aligned(split.feed(chunk))
            if out:
                before = tally.sending(out)
                yield out
                tally.sent(out, before)
            if self.stopped:
                return
        rest = split.rest() if split is not None and self.aligned else b""
        if rest:
            before = tally.sending(rest)
            yield rest
            tally.sent(rest, before)

    def _aligned(self, pieces: list[tuple[bytes, bool]]) -> bytes | None:
        """The events of one read to forward now (up to a `stop` event), joined."""
        if not pieces:
            return None
        sent: list[bytes] = []
        for piece, whole in pieces:
            if whole and self.stop is not None and self.stop(piece):
                self.stopped = True
                break
            sent.append(piece)
            self.tally.event(piece, whole)
        assert self.split is not None
        if self.counts is not None:
            self.counts.oversized_events += self.split.oversized
        self.split.oversized = 0
        if not sent:
            return None
        out = b"".join(sent) if len(sent) > 1 else sent[0]
        if self.on_sent is not None:
            self.on_sent(out)
        return out


class RelayResponse(StreamingResponse):
    """A streaming response that always closes its body iterator (so reservations are released
    at once, also when the client goes away mid-stream); `StreamCut` from the body ends it
    incomplete (the server closes the connection mid-body)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except StreamCut:
            return  # the response stays incomplete: the server closes the connection mid-body
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def in_span(body: AsyncIterable[Any], span: trace.Span,
                  ctx: otel_context.Context) -> AsyncIterator[Any]:
    """`body`, each step run in `ctx` (continuations, exemplars, log lines see the request's span);
    `span` ends with the last chunk, as an error when the stream was cut."""
    it = aiter(body)
    try:
        while True:
            token = otel_context.attach(ctx)
            try:
                chunk = await anext(it)
            except StopAsyncIteration:
                break
            finally:
                otel_context.detach(token)
            yield chunk
    except BaseException as exc:
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        close = getattr(it, "aclose", None)  # the relay's own accounting runs now, in the span
        if close is not None:
            token = otel_context.attach(ctx)
            try:
                await close()
            finally:
                otel_context.detach(token)
        span.end()
