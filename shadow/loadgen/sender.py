"""Send one request with the official openai client and time it.

Timing rules (seconds since the start of the run, ``time.perf_counter`` based):

- ``sent_s``: just before the SDK call; ``done_s``: when the response (or stream, including
  its final usage chunk) has ended.
- ``first_token_s``: arrival of the first chunk with non-empty generated content (completion
  ``text``; chat ``delta.content``, ``reasoning``/``reasoning_content`` or ``tool_calls``). The
  role-only first chat chunk and the usage-only chunk do not count.
- ``last_token_s``: arrival of the last chunk with non-empty content.
- ``output_tokens``: ``usage.completion_tokens`` when the server reports it, else the number of
  content chunks (vLLM sends one chunk per decode step).

Every request carries ``max_tokens`` = the trace's output length (at least 1, which servers
require), ``ignore_eos: true`` in the body (vLLM extension, via ``extra_body``) so the output is
exactly that long, and when streaming ``stream_options: {"include_usage": true}``.
Failures are classified into a small set of error kinds (see ``classify_error``). A stream that
ends without any ``finish_reason`` (cut short, however cleanly its body ended) is a failure of kind
``stream_incomplete``, never a success with a short output.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shadow.loadgen.client import require_openai
from shadow.loadgen.options import LoadOptions
from shadow.loadgen.schedule import PlannedRequest

ERROR_KINDS = (
    "connection", "timeout", "http_<status>", "stream_error", "stream_incomplete", "cancelled",
    "client_error",
)
"""Error kinds a result can carry (``http_<status>`` stands for ``http_500`` and the like)."""


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What happened to one request (times in seconds since the start of the run)."""

    index: int
    scheduled_s: float
    sent_s: float
    done_s: float
    first_token_s: float | None
    last_token_s: float | None
    prompt_tokens: int  # under the counting rule (chat: message text + the builder's chat overhead)
    requested_tokens: int  # max_tokens sent
    output_tokens: int
    content_chunks: int
    server_prompt_tokens: int | None = None  # usage.prompt_tokens, when reported
    finish_reason: str | None = None
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from the send (``None`` without a content chunk)."""
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (t_last − t_first) / (n − 1)."""
        if self.first_token_s is None or self.last_token_s is None or self.output_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float:
        """End-to-end latency, from the send to the end of the response."""
        return self.done_s - self.sent_s

    @property
    def wait_s(self) -> float:
        """Client-side delay between the scheduled arrival and the send (concurrency cap, lag)."""
        return max(0.0, self.sent_s - self.scheduled_s)


class StreamIncomplete(Exception):
    """A streamed response ended without a finish_reason (it was cut short)."""


def classify_error(exc: BaseException) -> tuple[str, str]:
    """``(kind, one-line message)`` for an exception raised while sending a request."""
    openai = require_openai()
    message = " ".join(str(exc).split())[:300] or type(exc).__name__
    if isinstance(exc, StreamIncomplete):
        return "stream_incomplete", message
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", "cancelled before completion"
    if isinstance(exc, TimeoutError | openai.APITimeoutError):
        return "timeout", message
    if isinstance(exc, openai.APIConnectionError):
        inner: BaseException = exc
        while inner.__cause__ is not None:
            inner = inner.__cause__
        detail = " ".join(str(inner).split())[:300] or type(inner).__name__
        return "connection", f"{message} ({detail})" if inner is not exc else message
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}", message
    if isinstance(exc, openai.APIError):
        return "stream_error", message
    return "client_error", f"{type(exc).__name__}: {message}"


def _chunk_has_content(choice: Any, chat: bool) -> bool:
    if not chat:
        return bool(getattr(choice, "text", None))
    delta = getattr(choice, "delta", None)
    if delta is None:
        return False
    return bool(
        getattr(delta, "content", None)
        or getattr(delta, "reasoning", None)
        or getattr(delta, "reasoning_content", None)
        or getattr(delta, "tool_calls", None)
    )


class _Timing:
    """Mutable timing state of one request in flight (kept if the request fails midway)."""

    __slots__ = ("chunks", "finish_reason", "first", "last", "usage_out", "usage_prompt")

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.chunks = 0
        self.usage_out: int | None = None
        self.usage_prompt: int | None = None
        self.finish_reason: str | None = None

    def usage(self, usage: Any) -> None:
        if usage is None:
            return
        out = getattr(usage, "completion_tokens", None)
        prompt = getattr(usage, "prompt_tokens", None)
        if isinstance(out, int):
            self.usage_out = out
        if isinstance(prompt, int):
            self.usage_prompt = prompt


class OpenAISender:
    """Sends planned requests through one ``openai.AsyncOpenAI`` client."""

    def __init__(self, client: Any, model: str, options: LoadOptions, clock: Callable[[], float]) -> None:
        self.client = client
        self.model = model
        self.options = options
        self.clock = clock

    def request_headers(self, index: int) -> dict[str, str]:
        """Per-request headers (``X-Request-Id`` when a prefix is configured)."""
        if self.options.request_id_prefix is None:
            return {}
        return {"X-Request-Id": f"{self.options.request_id_prefix}{index}"}

    def _create(self, req: PlannedRequest, prompt: str) -> Any:
        """The SDK coroutine for ``req`` (chat or completions, streaming or not)."""
        opts = self.options
        kwargs: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max(1, req.output_tokens),
            "stream": opts.stream,
            "extra_headers": self.request_headers(req.index) or None,
        }
        if opts.ignore_eos:
            kwargs["extra_body"] = {"ignore_eos": True}
        if opts.stream:
            kwargs["stream_options"] = {"include_usage": True}
        if opts.chat:
            return self.client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **kwargs
            )
        return self.client.completions.create(prompt=prompt, **kwargs)

    async def _run(self, req: PlannedRequest, prompt: str, t: _Timing) -> None:
        chat = self.options.chat
        response = await self._create(req, prompt)
        if not self.options.stream:
            t.usage(getattr(response, "usage", None))
            choices = getattr(response, "choices", None) or []
            if choices:
                t.finish_reason = getattr(choices[0], "finish_reason", None)
            return
        async with response as stream:
            async for chunk in stream:
                now = self.clock()
                t.usage(getattr(chunk, "usage", None))
                for choice in chunk.choices or ():
                    if _chunk_has_content(choice, chat):
                        if t.first is None:
                            t.first = now
                        t.last = now
                        t.chunks += 1
                    if getattr(choice, "finish_reason", None):
                        t.finish_reason = choice.finish_reason
        if t.finish_reason is None:
            raise StreamIncomplete(
                f"the stream ended after {t.chunks} content chunks without a finish_reason"
            )

    async def send(self, req: PlannedRequest, prompt: str, prompt_tokens: int) -> RequestResult:
        """Send ``req`` with ``prompt`` and return its result; never raises except on bugs.

        A cancellation (the run being stopped) is recorded as error kind ``cancelled``.
        """
        t = _Timing()
        kind: str | None = None
        message: str | None = None
        sent = self.clock()
        try:
            async with asyncio.timeout(self.options.request_timeout_s):
                await self._run(req, prompt, t)
        except (Exception, asyncio.CancelledError) as exc:  # classified, never propagated
            kind, message = classify_error(exc)
        done = self.clock()
        output = t.usage_out if t.usage_out is not None else t.chunks
        return RequestResult(
            index=req.index,
            scheduled_s=req.offset_s,
            sent_s=sent,
            done_s=done,
            first_token_s=t.first,
            last_token_s=t.last,
            prompt_tokens=prompt_tokens,
            requested_tokens=max(1, req.output_tokens),
            output_tokens=output,
            content_chunks=t.chunks,
            server_prompt_tokens=t.usage_prompt,
            finish_reason=t.finish_reason,
            error_kind=kind,
            error=message,
        )
