"""Fairness: does routing favour some prompts over others? Time to first token, time per output
token and completion time, as clients saw them through the proxy, by prompt-length bucket."""

from __future__ import annotations

from shadow.contracts.labels import PROMPT_BUCKETS
from shadow.telemetry.dashboards._hist import quantile, quantiles
from shadow.telemetry.dashboards._kit import Board, Layout, q, rates, ts

METRICS = (
    ("Time to first token", "shadow_router_first_token_seconds",
     "from the request reaching the proxy to the first token leaving it"),
    ("Time per output token", "shadow_router_tpot_seconds",
     "mean time per output token of each finished stream"),
    ("Completion time", "shadow_router_completion_seconds",
     "from the request reaching the proxy to its last byte"),
)


def _panels(lay: Layout) -> None:
    for title, hist, what in METRICS:
        lay.row(title)
        lay.add(ts(f"{title}: p50 and p95 by prompt length",
                   f"{title} ({what}) as clients saw it, p50 and p95 by prompt-length bucket.",
                   "s", *quantiles(hist, "prompt_bucket", (0.5, 0.95))), w=12)
        lay.add(ts(f"{title}: p95 by mode and prompt length",
                   f"p95 of {title.lower()} by effective mode (shadow = the existing router, active, "
                   "fallback) and prompt-length bucket: the same bucket across modes shows what "
                   "shadow's routing changed.",
                   "s", q(quantile(0.95, hist, "mode, prompt_bucket"), "{{mode}} {{prompt_bucket}}")), w=12)
    lay.row("Traffic")
    lay.add(ts("Finished requests by prompt length",
               "Requests per second finished through the proxy, by prompt-length bucket and mode (the "
               "weight behind each quantile above).",
               "reqps", rates("shadow_router_completion_seconds_count", "mode, prompt_bucket")), w=24)


BOARD = Board("shadow-fairness", "shadow / Fairness",
              "Are long prompts paying for short ones (or the reverse)? Client-side TTFT, TPOT and "
              f"completion time by prompt-length bucket ({', '.join(PROMPT_BUCKETS)}) and by mode.",
              _panels)
