"""Fairness: does routing favour some prompts over others? Time to first token, time per output
token and completion time, as clients saw them through the proxy, by prompt-length bucket."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from shadow.telemetry.dashboards._hist import quantile, quantiles
from shadow.telemetry.dashboards._kit import RATE, Layout, dashboard, q, sel, ts, variables

UID = "shadow-fairness"
METRICS = (
    ("Time to first token", "shadow_router_first_token_seconds",
     "from the request reaching the proxy to the first token leaving it"),
    ("Time per output token", "shadow_router_tpot_seconds",
     "mean time per output token of each finished stream"),
    ("Completion time", "shadow_router_completion_seconds",
     "from the request reaching the proxy to its last byte"),
)


def build() -> db.Dashboard:
    d = variables(dashboard(
        UID, "shadow / Fairness",
        "Are long prompts paying for short ones (or the reverse)? Client-side TTFT, TPOT and "
        "completion time by prompt-length bucket (lt512, 512-2k, 2k-8k, ge8k) and by mode."))
    lay = Layout(d)
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
               "reqps", q(f"sum by (mode, prompt_bucket) "
                          f"(rate(shadow_router_completion_seconds_count{sel()}[{RATE}]))",
                          "{{mode}} {{prompt_bucket}}")), w=24)
    return lay.d
