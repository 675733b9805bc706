"""Summary figures from known per-request results, and their JSON and table forms."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from shadow.loadgen import LoadReport, RequestResult, render_summary, summarize


def _ok(i: int, ttft: float, n: int, step: float, wait: float = 0.0) -> RequestResult:
    sent = float(i) + wait
    first = sent + ttft
    last = first + step * (n - 1)
    return RequestResult(
        index=i,
        scheduled_s=float(i),
        sent_s=sent,
        done_s=last + 0.001,
        first_token_s=first,
        last_token_s=last,
        prompt_tokens=10 * (i + 1),
        requested_tokens=n,
        output_tokens=n,
        content_chunks=n,
        server_prompt_tokens=10,
        finish_reason="length",
    )


def _failed(i: int, kind: str) -> RequestResult:
    return RequestResult(
        index=i,
        scheduled_s=float(i),
        sent_s=float(i),
        done_s=float(i) + 0.01,
        first_token_s=None,
        last_token_s=None,
        prompt_tokens=5,
        requested_tokens=4,
        output_tokens=0,
        content_chunks=0,
        error_kind=kind,
        error="boom",
    )


def test_summary_figures() -> None:
    results = [_ok(i, ttft=0.1 * (i + 1), n=11, step=0.02) for i in range(5)]
    results += [_failed(5, "http_500"), _failed(6, "http_500"), _failed(7, "timeout")]
    s = summarize(results, planned=10, wall_s=10.0, max_in_flight=3)
    assert (s.planned, s.sent, s.ok, s.failed, s.not_sent) == (10, 8, 5, 3, 2)
    assert s.errors == {"http_500": 2, "timeout": 1}
    assert s.ttft_s["p50"] == pytest.approx(0.3)
    assert s.ttft_s["p99"] == pytest.approx(0.1 + 0.4 * 0.99 * 4 / 4, rel=1e-3)  # linear interpolation
    assert s.tpot_s["p50"] == pytest.approx(0.02) and s.tpot_s["p95"] == pytest.approx(0.02)
    assert s.e2e_s["p50"] == pytest.approx(0.3 + 0.2 + 0.001)
    assert s.output_tokens == 55 and s.output_tokens_per_s == pytest.approx(5.5)
    assert s.prompt_tokens_sent == 10 + 20 + 30 + 40 + 50 + 3 * 5
    assert s.server_prompt_tokens == 50
    assert s.output_mismatch == 0
    assert s.requests_per_s == pytest.approx(0.5)


def test_tpot_uses_token_count_not_chunks() -> None:
    r = _ok(0, ttft=0.1, n=5, step=0.05)
    assert r.tpot_s == pytest.approx(0.05)
    assert r.ttft_s == pytest.approx(0.1) and r.wait_s == 0.0
    one = _ok(1, ttft=0.1, n=1, step=0.0)
    assert one.tpot_s is None


def test_empty_summary_has_no_percentiles() -> None:
    s = summarize([], planned=3, wall_s=0.0)
    assert s.ttft_s["p50"] is None and s.output_tokens_per_s == 0.0 and s.not_sent == 3


def test_report_json_and_table() -> None:
    results = (_ok(0, 0.1, 4, 0.01), _failed(1, "connection"))
    report = LoadReport(
        target="http://127.0.0.1:1/v1",
        model="m",
        trace="t",
        options={"chat": False},
        results=results,
        summary=summarize(results, planned=2, wall_s=1.0),
        interrupted=True,
    )
    data = json.loads(json.dumps(report.to_dict()))
    assert data["requests"]["errors"] == {"connection": 1}
    assert data["interrupted"] is True and data["ttft_s"]["p50"] == pytest.approx(0.1)
    console = Console(width=140, record=True, force_terminal=False)
    console.print(render_summary(report))
    text = console.export_text()
    assert "TTFT p50 / p99" in text and "connection: 1" in text and "interrupted" in text
