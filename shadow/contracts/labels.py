"""Closed label value sets that exporters and the metric catalogue share (one home per set)."""

from __future__ import annotations

#: Prompt-length buckets of the active proxy's per-request metrics (see `prompt_bucket`).
PROMPT_BUCKETS: tuple[str, ...] = ("lt512", "512-2k", "2k-8k", "ge8k")
#: A stream that ended cleanly with neither a `finish_reason` nor `data: [DONE]`: cut short by its
#: upstream, however cleanly it ended the body (`shadow load` names this failure the same).
STREAM_INCOMPLETE = "stream_incomplete"
#: How an actively routed request ended.
OUTCOMES: tuple[str, ...] = ("ok", "client_cancel", "upstream_error", "rejected", STREAM_INCOMPLETE)
#: The outcomes that failed the client (the client's own 4xx aside: `active.cohorts.client_fault`).
FAILED_OUTCOMES: tuple[str, ...] = ("upstream_error", "rejected", STREAM_INCOMPLETE)
#: Why the active proxy held or refused a request.
BACKPRESSURE_REASONS: tuple[str, ...] = ("prefill_kv", "transfer_cap", "no_slot")
#: Upstream legs of the active proxy.
LEGS: tuple[str, ...] = ("prefill", "decode", "router")
#: BalanceRoute's two stages within a routing round.
ROUND_STAGES: tuple[str, ...] = ("stage1", "stage2")
#: Prefix-cache lookups of the calibration: the prompt key was seen before or not.
LOOKUP_RESULTS: tuple[str, ...] = ("hit", "miss")


def prompt_bucket(tokens: int) -> str:
    """`lt512`, `512-2k`, `2k-8k` or `ge8k` for a prompt of `tokens` tokens."""
    if tokens < 512:
        return "lt512"
    if tokens < 2048:
        return "512-2k"
    if tokens < 8192:
        return "2k-8k"
    return "ge8k"
