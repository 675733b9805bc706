"""Replay a trace against an OpenAI-compatible endpoint: ``run_load``.

The dispatcher walks the send plan in arrival order. For each request it builds the prompt
first (off the timing path), sleeps until the request's scheduled offset, waits for a
concurrency slot if a cap is set (so requests beyond the cap wait, in arrival order), then
starts the request as its own task. Results are collected as tasks finish.

Stopping: when the optional ``stop`` event is set (the CLI sets it on Ctrl-C), no further
request is sent, requests in flight are cancelled and recorded as ``cancelled``, and the
report (marked ``interrupted``) covers what finished. If ``run_load`` itself is cancelled, it
cancels its requests and re-raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict
from typing import Any

from shadow.contracts.traces import TraceLike
from shadow.loadgen.client import make_client, normalize_base_url, resolve_model
from shadow.loadgen.options import LoadOptions
from shadow.loadgen.progress import NullProgress, ProgressSink
from shadow.loadgen.report import LoadReport, summarize
from shadow.loadgen.schedule import PlannedRequest, plan
from shadow.loadgen.sender import OpenAISender, RequestResult


class _Dispatch:
    """State of one run's dispatch: tasks in flight, results, counters."""

    def __init__(self, sender: OpenAISender, options: LoadOptions, progress: ProgressSink) -> None:
        self.sender = sender
        self.options = options
        self.progress = progress
        self.results: list[RequestResult] = []
        self.tasks: dict[asyncio.Task[RequestResult], PlannedRequest] = {}
        self.failed = 0
        self.max_in_flight = 0
        self.slots = asyncio.Semaphore(options.concurrency) if options.concurrency else None

    def _finished(self, task: asyncio.Task[RequestResult]) -> None:
        req = self.tasks.pop(task)
        if self.slots is not None:
            self.slots.release()
        if task.cancelled():  # cancelled before it started: nothing was sent, it counts as not sent
            return
        exc = task.exception()
        if exc is not None:  # the sender classifies failures itself; this is a bug, kept visible
            now = self.sender.clock()
            result = RequestResult(
                index=req.index,
                scheduled_s=req.offset_s,
                sent_s=now,
                done_s=now,
                first_token_s=None,
                last_token_s=None,
                prompt_tokens=0,
                requested_tokens=max(1, req.output_tokens),
                output_tokens=0,
                content_chunks=0,
                error_kind="client_error",
                error=f"{type(exc).__name__}: {exc}",
            )
        else:
            result = task.result()
        self.results.append(result)
        self.failed += 0 if result.ok else 1
        self.progress.update(len(self.results), self.failed, len(self.tasks))

    def cancel_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()

    async def run(self, planned: list[PlannedRequest], stop: asyncio.Event) -> None:
        builder = self.options.builder()
        clock = self.sender.clock
        for req in planned:
            n_prompt = max(1, req.prompt_tokens)
            if self.options.chat:  # the text of one user message; the server adds its overhead
                n_text = builder.chat_content_tokens(n_prompt)
                n_prompt = n_text + builder.chat_overhead
            else:
                n_text = n_prompt
            prompt = builder.build_for(req.index, n_text, req.prompt_key)
            delay = req.offset_s - clock()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
            if stop.is_set():
                break
            if self.slots is not None:
                await self.slots.acquire()
                if stop.is_set():
                    self.slots.release()
                    break
            task = asyncio.create_task(self.sender.send(req, prompt, n_prompt))
            self.tasks[task] = req
            task.add_done_callback(self._finished)
            self.max_in_flight = max(self.max_in_flight, len(self.tasks))
        while self.tasks:
            await asyncio.wait(list(self.tasks))


async def _watch(stop: asyncio.Event, dispatch: _Dispatch) -> None:
    await stop.wait()
    dispatch.cancel_all()


async def run_load(
    trace: TraceLike,
    target: str,
    options: LoadOptions | None = None,
    *,
    progress: ProgressSink | None = None,
    stop: asyncio.Event | None = None,
) -> LoadReport:
    """Replay ``trace`` against the OpenAI-compatible server at ``target``; return the report.

    Raises ``LoadError`` when the target is unreachable (or lists no model and none is given),
    ``ValueError`` on bad options. Request failures do not raise: they are in the report.
    """
    options = options if options is not None else LoadOptions()
    progress = progress if progress is not None else NullProgress()
    stop = stop if stop is not None else asyncio.Event()
    planned = plan(trace, time_scale=options.time_scale, limit=options.limit)
    base_url = normalize_base_url(target)
    client = make_client(
        base_url,
        api_key=options.api_key,
        headers=options.headers,
        timeout_s=options.request_timeout_s,
        concurrency=options.concurrency,
    )
    try:
        model = await resolve_model(client, base_url, options.model)
        t0 = time.perf_counter()
        sender = OpenAISender(client, model, options, clock=lambda: time.perf_counter() - t0)
        dispatch = _Dispatch(sender, options, progress)
        watcher = asyncio.create_task(_watch(stop, dispatch))
        progress.start(len(planned))
        try:
            await dispatch.run(planned, stop)
        except asyncio.CancelledError:
            dispatch.cancel_all()
            if dispatch.tasks:
                await asyncio.wait(list(dispatch.tasks))
            raise
        finally:
            watcher.cancel()
            progress.close()
        wall_s = sender.clock()
    finally:
        await client.close()
    results = tuple(sorted(dispatch.results, key=lambda r: r.index))
    return LoadReport(
        target=base_url,
        model=model,
        trace=str(getattr(trace, "name", "trace")),
        options=_options_dict(options),
        results=results,
        summary=summarize(results, planned=len(planned), wall_s=wall_s, max_in_flight=dispatch.max_in_flight),
        interrupted=stop.is_set(),
    )


def _options_dict(options: LoadOptions) -> dict[str, Any]:
    """The JSON-safe options of a run (headers by name only: values may be secrets)."""
    raw = asdict(options)
    raw.pop("prompt_builder", None)
    raw.pop("api_key", None)
    raw["headers"] = sorted(options.headers)
    builder = options.builder()
    raw["prompt_seed"] = builder.seed
    raw["counting_rule"] = getattr(builder.counter, "__name__", type(builder.counter).__name__)
    raw["chat_overhead"] = builder.chat_overhead
    return raw
