"""``run_load`` against an in-test OpenAI-compatible stub server (vLLM SSE format, loopback)."""

from __future__ import annotations

import asyncio
import io
import time

import pytest
from loadgen_helpers import make_trace
from loadgen_stub import StubConfig, StubServer, free_port
from rich.console import Console

from shadow.loadgen import (
    LoadError,
    LoadOptions,
    LoadReport,
    NullProgress,
    PlainProgress,
    PromptBuilder,
    RichProgress,
    make_progress,
    run_load,
)


def _run(trace: object, stub_url: str, **options: object) -> LoadReport:
    return asyncio.run(run_load(trace, stub_url, LoadOptions(**options)))  # type: ignore[arg-type]


def test_requests_carry_trace_sizes_via_official_client(stub: StubServer) -> None:
    rows = [(0.0, 5, 3, "a"), (0.01, 7, 4, None), (0.02, 5, 6, "a"), (0.03, 5, 2, "b"), (0.04, 9, 1, None)]
    trace = make_trace(rows)
    report = _run(trace, stub.url, request_id_prefix="run1-", headers={"X-Tenant": "t1"})
    assert report.summary.ok == 5 and report.summary.failed == 0
    assert report.model == "stub-model"  # first id of GET /v1/models
    seen = sorted(stub.requests, key=lambda r: r.headers["x-request-id"])
    assert [r.headers["x-request-id"] for r in seen] == [f"run1-{i}" for i in range(5)]
    for rec, (_, prompt, output, _key) in zip(seen, rows, strict=True):
        assert rec.path == "/v1/completions"
        # the sender is the official openai SDK
        assert rec.headers["user-agent"].startswith("AsyncOpenAI/Python")
        assert rec.headers["x-stainless-lang"] == "python"
        assert rec.headers["authorization"] == "Bearer EMPTY"
        assert rec.headers["x-tenant"] == "t1"
        body = rec.body
        assert body["model"] == "stub-model"
        assert body["max_tokens"] == output and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"].split()) == prompt
    prompts = [r.body["prompt"] for r in seen]
    assert prompts[0] == prompts[2]  # same key "a", same length
    assert len({prompts[0], prompts[1], prompts[3], prompts[4]}) == 4  # other keys / unkeyed differ
    for res, (_, prompt, output, _key) in zip(report.results, rows, strict=True):
        assert res.ok and res.output_tokens == output == res.content_chunks and res.requested_tokens == output
        assert res.prompt_tokens == prompt == res.server_prompt_tokens
        assert res.finish_reason == "length"
    assert report.summary.prompt_tokens_sent == sum(r[1] for r in rows)
    assert report.summary.output_tokens == sum(r[2] for r in rows)
    assert report.summary.output_mismatch == 0


def test_summary_figures_match_known_stub_timings(stub: StubServer) -> None:
    stub.config = StubConfig(ttft_s=0.08, itl_s=0.02)
    trace = make_trace([(0.02 * i, 10, 6, None) for i in range(6)])
    report = _run(trace, stub.url)
    s = report.summary
    assert s.ok == 6
    # Lower bounds are exact (nothing can beat the stub's delays); upper bounds only catch unit or
    # formula errors and leave room for a loaded CI machine.
    assert 0.08 <= s.ttft_s["p50"] < 0.08 + 0.3  # type: ignore[operator]
    assert 0.08 <= s.ttft_s["p99"] < 0.08 + 0.5  # type: ignore[operator]
    assert 0.017 <= s.tpot_s["p50"] < 0.02 + 0.04  # type: ignore[operator]
    assert 0.18 <= s.e2e_s["p50"] < 0.18 + 0.5  # ttft + 5 gaps
    assert s.output_tokens == 36
    assert s.output_tokens_per_s == pytest.approx(36 / s.wall_s)
    assert 0.1 + 0.18 <= s.wall_s < 0.1 + 0.18 + 1.5


def test_chat_ttft_skips_the_role_only_chunk(stub: StubServer) -> None:
    stub.config = StubConfig(ttft_s=0.1, itl_s=0.01)
    trace = make_trace([(0.0, 12, 3, "k"), (0.0, 12, 3, "k")])
    report = _run(trace, stub.url, chat=True)
    assert report.summary.ok == 2
    for rec in stub.requests:
        assert rec.path == "/v1/chat/completions"
        msgs = rec.body["messages"]
        assert len(msgs) == 1 and msgs[0]["role"] == "user" and len(msgs[0]["content"].split()) == 12
        assert rec.body["max_tokens"] == 3 and rec.body["ignore_eos"] is True
    assert stub.requests[0].body["messages"] == stub.requests[1].body["messages"]
    for res in report.results:
        assert res.ttft_s is not None and res.ttft_s >= 0.1  # not the immediate role chunk
        assert res.output_tokens == 3 and res.content_chunks == 3


def test_concurrency_cap_is_respected(stub: StubServer) -> None:
    stub.config = StubConfig(ttft_s=0.05, itl_s=0.01)
    trace = make_trace([(0.0, 4, 4, None)] * 12)
    report = _run(trace, stub.url, concurrency=3)
    assert report.summary.ok == 12
    assert stub.max_in_flight == 3 and report.summary.max_in_flight == 3
    # 12 requests of ~80 ms, 3 at a time: four waves, and later requests waited for a slot
    assert report.summary.wall_s >= 4 * 0.08
    assert report.summary.wait_s["p99"] >= 0.2  # type: ignore[operator]


def test_time_scaling_respected(stub: StubServer) -> None:
    """The plan is the trace's arrivals / time_scale exactly and nothing is sent before its scheduled
    time. (How late the sender runs behind the plan depends on the machine's load: it was asserted
    to be < 50 ms and failed under load average 8-12; it is reported as the wait, not asserted.)"""
    stub.config = StubConfig(ttft_s=0.005, itl_s=0.001)
    arrivals = [0.0, 0.4, 0.8, 1.6, 2.4]
    trace = make_trace([(a, 3, 2, None) for a in arrivals])
    report = _run(trace, stub.url, time_scale=4.0, request_id_prefix="r")
    assert report.summary.ok == 5
    results = sorted(report.results, key=lambda r: r.scheduled_s)
    assert [r.scheduled_s for r in results] == [pytest.approx(a / 4.0) for a in arrivals]
    for res in results:
        assert res.sent_s >= res.scheduled_s - 1e-3, f"sent {res.scheduled_s - res.sent_s:.4f} s early"
    # A sender that ignored time_scale could not send the last request before its unscaled arrival.
    assert results[-1].sent_s < arrivals[-1]
    at = {r.headers["x-request-id"]: r.arrived for r in stub.requests}
    assert set(at) == {f"r{i}" for i in range(len(arrivals))}


def test_limit_and_no_stream(stub: StubServer) -> None:
    trace = make_trace([(0.0, 6, 5, None)] * 4)
    report = _run(trace, stub.url, stream=False, limit=2, model="explicit-model")
    assert report.summary.planned == 2 and report.summary.ok == 2 and len(stub.requests) == 2
    for rec in stub.requests:
        assert rec.body["stream"] is False and "stream_options" not in rec.body
        assert rec.body["model"] == "explicit-model"
    for res in report.results:
        assert res.output_tokens == 5 and res.ttft_s is None and res.e2e_s > 0


def test_without_ignore_eos_mismatch_is_counted(stub: StubServer) -> None:
    trace = make_trace([(0.0, 6, 5, None), (0.0, 6, 2, None)])
    report = _run(trace, stub.url, ignore_eos=False)
    assert all("ignore_eos" not in r.body for r in stub.requests)
    assert report.summary.ok == 2 and report.summary.output_mismatch == 1  # stub stops after 3 tokens


def test_errors_are_counted_by_kind(stub: StubServer) -> None:
    stub.config = StubConfig(ttft_s=0.01, itl_s=0.005, fail_ids={"e1", "e3"}, midstream_fail_ids={"e2"})
    trace = make_trace([(0.0, 4, 4, None)] * 5)
    report = _run(trace, stub.url, request_id_prefix="e")
    s = report.summary
    assert (s.ok, s.failed) == (2, 3)
    assert s.errors == {"http_500": 2, "stream_error": 1}
    broken = report.results[2]
    assert broken.error_kind == "stream_error" and broken.first_token_s is not None
    assert "injected" in (broken.error or "")
    assert s.output_tokens == 8  # only ok requests count


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_that_ends_without_a_finish_reason_is_a_failure(stub: StubServer, chat: bool) -> None:
    """A body that ends cleanly after one of four tokens, with neither a finish reason nor [DONE]
    (a cut the server did not flag): failed as `stream_incomplete`, not an output mismatch."""
    stub.config = StubConfig(ttft_s=0.01, itl_s=0.005, short_ids={"s1"})
    report = _run(make_trace([(0.0, 4, 4, None)] * 3), stub.url, request_id_prefix="s", chat=chat)
    s = report.summary
    assert (s.ok, s.failed) == (2, 1) and s.errors == {"stream_incomplete": 1}
    short = report.results[1]
    assert short.error_kind == "stream_incomplete" and short.finish_reason is None
    assert "1 content chunks" in (short.error or "")
    assert s.output_mismatch == 0  # not taken for a server that ignored max_tokens


def test_custom_prompt_builder_and_seed(stub: StubServer) -> None:
    trace = make_trace([(0.0, 8, 1, "same")])
    _run(trace, stub.url, prompt_builder=PromptBuilder(seed=1))
    _run(trace, stub.url, prompt_builder=PromptBuilder(seed=2))
    a, b = (r.body["prompt"] for r in stub.requests)
    assert a != b and len(a.split()) == len(b.split()) == 8


def test_unreachable_target_raises_one_line_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LoadError, match="target unreachable") as err:
        _run(make_trace([(0.0, 1, 1, None)]), url)
    assert "\n" not in str(err.value) and url in str(err.value)


def test_target_url_forms(stub: StubServer) -> None:
    trace = make_trace([(0.0, 2, 1, None)])
    for url in (stub.url, stub.url + "/", stub.url + "/v1", stub.url + "/v1/"):
        assert _run(trace, url).summary.ok == 1
    with pytest.raises(LoadError, match="http"):
        _run(trace, "127.0.0.1:8000")


def test_models_endpoint_missing(stub: StubServer) -> None:
    stub.config = StubConfig(models_status=404)
    trace = make_trace([(0.0, 2, 1, None)])
    with pytest.raises(LoadError, match="--model"):
        _run(trace, stub.url)
    assert _run(trace, stub.url, model="m").summary.ok == 1


def test_stop_event_interrupts_and_reports_what_finished(stub: StubServer) -> None:
    stub.config = StubConfig(ttft_s=0.02, itl_s=0.02)
    # two quick requests, one long one in flight at the stop, two never sent
    trace = make_trace(
        [(0.0, 2, 2, None), (0.0, 2, 2, None), (0.05, 2, 200, None), (5.0, 2, 2, None), (6.0, 2, 2, None)]
    )

    async def go() -> LoadReport:
        # Stop once the long stream is well under way (50 of its 200 tokens sent, ~1 s), whatever the
        # machine's load: a condition on the server, not a fixed delay.
        stop = asyncio.Event()

        async def watch() -> None:
            while stub.max_chunks < 50:
                await asyncio.sleep(0.01)
            stop.set()

        watcher = asyncio.create_task(watch())
        try:
            return await run_load(trace, stub.url, LoadOptions(), stop=stop)
        finally:
            watcher.cancel()

    report = asyncio.run(go())
    s = report.summary
    assert report.interrupted
    assert (s.planned, s.sent, s.ok, s.not_sent) == (5, 3, 2, 2)
    assert s.errors == {"cancelled": 1}
    cancelled = report.results[2]
    assert cancelled.first_token_s is not None and cancelled.output_tokens < 200
    assert stub.in_flight == 0 or _eventually(lambda: stub.in_flight == 0)


def _eventually(cond: object, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_progress_sink_sees_every_request(stub: StubServer) -> None:
    events: list[tuple[str, int, int, int]] = []

    class Sink:
        def start(self, total: int) -> None:
            events.append(("start", total, 0, 0))

        def update(self, done: int, failed: int, in_flight: int) -> None:
            events.append(("update", done, failed, in_flight))

        def close(self) -> None:
            events.append(("close", 0, 0, 0))

    trace = make_trace([(0.0, 2, 2, None)] * 3)
    asyncio.run(run_load(trace, stub.url, LoadOptions(), progress=Sink()))
    assert events[0] == ("start", 3, 0, 0) and events[-1][0] == "close"
    assert [e[1] for e in events if e[0] == "update"] == [1, 2, 3]


def test_request_timeout_is_an_error_kind(stub: StubServer) -> None:
    stub.config = StubConfig(ttft_s=2.0)
    started = time.monotonic()
    report = _run(make_trace([(0.0, 2, 2, None)]), stub.url, request_timeout_s=0.2)
    assert time.monotonic() - started < 1.5
    assert report.summary.errors == {"timeout": 1}


def test_rich_progress_on_a_terminal_and_plain_lines_otherwise(stub: StubServer) -> None:
    trace = make_trace([(0.0, 2, 2, None)] * 4)
    tty = Console(file=io.StringIO(), force_terminal=True, width=100)
    bar = make_progress(tty)
    assert isinstance(bar, RichProgress)
    assert asyncio.run(run_load(trace, stub.url, LoadOptions(), progress=bar)).summary.ok == 4
    assert "4/4" in tty.file.getvalue()  # type: ignore[attr-defined]
    pipe = Console(file=io.StringIO(), force_terminal=False)
    plain = make_progress(pipe)
    assert isinstance(plain, PlainProgress)
    asyncio.run(run_load(trace, stub.url, LoadOptions(), progress=plain))
    lines = pipe.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert lines[0] == "load: sending 4 requests" and lines[-1] == "load: 4/4 done, 0 failed, 0 in flight"
    assert isinstance(make_progress(tty, quiet=True), NullProgress)
