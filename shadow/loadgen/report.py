"""The result of a load run: per-request results, summary figures, table and JSON forms.

Latencies are measured from the moment a request is sent (after any wait for a concurrency
slot); the client-side wait between a request's scheduled arrival and its send is reported
separately as ``wait_s``. Percentiles use linear interpolation (numpy's default). Throughput is
output tokens of successful requests over the run's wall time (first scheduled arrival to the
end of the last response).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shadow.core.stats import quantile
from shadow.loadgen.sender import RequestResult


def _percentiles(values: Iterable[float | None], qs: Sequence[int]) -> dict[str, float | None]:
    data = np.array([v for v in values if v is not None], dtype=float)
    if data.size == 0:
        empty: dict[str, float | None] = {f"p{q}": None for q in qs}
        empty["mean"] = None
        return empty
    out: dict[str, float | None] = {f"p{q}": quantile(data, q / 100.0) for q in qs}
    out["mean"] = float(data.mean())
    return out


@dataclass(frozen=True)
class LoadSummary:
    """Summary figures of a run (seconds, tokens, per-second rates)."""

    planned: int
    sent: int
    ok: int
    failed: int
    not_sent: int
    errors: dict[str, int]
    wall_s: float
    prompt_tokens_sent: int
    server_prompt_tokens: int | None
    output_tokens: int
    output_mismatch: int  # ok requests whose output length differs from max_tokens
    ttft_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    wait_s: dict[str, float | None]
    max_in_flight: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": {
                "planned": self.planned,
                "sent": self.sent,
                "ok": self.ok,
                "failed": self.failed,
                "not_sent": self.not_sent,
                "errors": dict(sorted(self.errors.items())),
                "output_mismatch": self.output_mismatch,
                "max_in_flight": self.max_in_flight,
            },
            "wall_s": self.wall_s,
            "tokens": {
                "prompt_sent": self.prompt_tokens_sent,
                "prompt_server_reported": self.server_prompt_tokens,
                "output": self.output_tokens,
            },
            "throughput": {
                "output_tokens_per_s": self.output_tokens_per_s,
                "requests_per_s": self.requests_per_s,
            },
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "wait_s": self.wait_s,
        }


def summarize(
    results: Sequence[RequestResult], *, planned: int, wall_s: float, max_in_flight: int = 0
) -> LoadSummary:
    """Summary figures of ``results`` (one per sent request) out of ``planned`` requests."""
    ok = [r for r in results if r.ok]
    errors = Counter(r.error_kind for r in results if r.error_kind is not None)
    server_prompt = [r.server_prompt_tokens for r in results if r.server_prompt_tokens is not None]
    return LoadSummary(
        planned=planned,
        sent=len(results),
        ok=len(ok),
        failed=len(results) - len(ok),
        not_sent=planned - len(results),
        errors={str(k): v for k, v in errors.items()},
        wall_s=wall_s,
        prompt_tokens_sent=sum(r.prompt_tokens for r in results),
        server_prompt_tokens=sum(server_prompt) if server_prompt else None,
        output_tokens=sum(r.output_tokens for r in ok),
        output_mismatch=sum(1 for r in ok if r.output_tokens != r.requested_tokens),
        ttft_s=_percentiles((r.ttft_s for r in ok), (50, 99)),
        tpot_s=_percentiles((r.tpot_s for r in ok), (50, 95)),
        e2e_s=_percentiles((r.e2e_s for r in ok), (50, 99)),
        wait_s=_percentiles((r.wait_s for r in results), (50, 99)),
        max_in_flight=max_in_flight,
    )


@dataclass(frozen=True)
class LoadReport:
    """A finished (or interrupted) load run."""

    target: str
    model: str
    trace: str
    options: dict[str, Any]
    results: tuple[RequestResult, ...]
    summary: LoadSummary
    interrupted: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written by ``shadow load --json``."""
        return {
            "target": self.target,
            "model": self.model,
            "trace": self.trace,
            "interrupted": self.interrupted,
            "options": self.options,
            **self.summary.to_dict(),
        }


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.1f} ms"


def _pair(stats: dict[str, float | None], a: str, b: str) -> str:
    return f"{_ms(stats[a])} / {_ms(stats[b])}"


def render_summary(report: LoadReport) -> Any:
    """A ``rich`` table of the summary (print it with a rich ``Console``)."""
    from rich.markup import escape
    from rich.table import Table

    s = report.summary
    title = f"shadow load — {report.trace} → {report.target} ({report.model})"
    if report.interrupted:
        title += " (interrupted)"
    table = Table(title=escape(title), show_header=True, header_style="bold")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("detail")
    errs = ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())) or "–"
    table.add_row("requests ok", f"{s.ok}/{s.planned}", f"{s.requests_per_s:.2f} req/s")
    table.add_row("requests failed", str(s.failed), errs)
    if s.not_sent:
        table.add_row("requests not sent", str(s.not_sent), "run stopped before their arrival")
    table.add_row("TTFT p50 / p99", _pair(s.ttft_s, "p50", "p99"), "first content chunk")
    table.add_row("TPOT p50 / p95", _pair(s.tpot_s, "p50", "p95"), "(t_last − t_first)/(n − 1)")
    table.add_row("E2E p50 / p99", _pair(s.e2e_s, "p50", "p99"), "send to end of response")
    table.add_row(
        "client wait p50 / p99",
        _pair(s.wait_s, "p50", "p99"),
        f"scheduled arrival to send; max in flight {s.max_in_flight}",
    )
    table.add_row("output throughput", f"{s.output_tokens_per_s:,.1f} tok/s", f"{s.output_tokens:,} tokens")
    server = "" if s.server_prompt_tokens is None else f"server counted {s.server_prompt_tokens:,}"
    table.add_row("prompt tokens sent", f"{s.prompt_tokens_sent:,}", server)
    if s.output_mismatch:
        table.add_row("output ≠ max_tokens", str(s.output_mismatch), "ignore_eos/max_tokens not honoured")
    table.add_row("wall time", f"{s.wall_s:.2f} s", "")
    return table
