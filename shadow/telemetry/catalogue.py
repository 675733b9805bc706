"""The metric catalogue: every metric shadow exports (and the worker metrics it reads), one entry each.

`CATALOGUE` names each family as PromQL sees it (counters with `_total`), its type, base unit,
bounded labels, help and exporter. `check_exposition(text)` lists what an exporter's `/metrics`
shows outside the catalogue (unknown family, other type, other labels); tests run it on every
real exporter, and dashboards and alert rules may only name catalogued metrics.
`markdown()` renders the table in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

from shadow.contracts.labels import (
    BACKPRESSURE_REASONS,
    LEGS,
    LOOKUP_RESULTS,
    OUTCOMES,
    POLICY_LABELS,
    PROMPT_BUCKETS,
    ROUND_STAGES,
)
from shadow.contracts.modes import DEGRADE_REASONS, MODES, TRANSITION_REASONS

MetricType = Literal["counter", "gauge", "histogram"]

#: Exporters: `tap` (the mirror, in `shadow tap` and `shadow serve`), `serve` (live lanes, only in
#: `shadow serve`), `fleet` (the simulated fleet's ground truth), `vllm` (read from workers: vLLM
#: exports them, and so does the simulated fleet).
EXPORTERS = ("tap", "serve", "fleet", "vllm")

#: Every label any catalogued metric carries, with what bounds its values.
LABELS: dict[str, str] = {
    "worker": "configured worker or tap names (bounded by fleet size)",
    "lane": "`actual` plus one per configured policy (jsq-bytes, br0, brh-survival, ...)",
    "source": "mirror: tap | api | reaper; step times: events | sse",
    "kind": "event kind: arrive | route | token | finish | cancel | step",
    "reason": "a closed set per metric (e.g. queue_full, record_full, parse_error, ...)",
    "stage": "analysis stage that raised (closed set: analysis, listener, record, housekeeping, ...)",
    "leg": "prefill | decode (taps); prefill | decode | router (active proxy)",
    "engine": "engine index of one simulated or vLLM server",
    "model_name": "served model name (from the worker's configuration)",
    "finished_reason": "stop | length | abort | error",
    "block_size": "KV block size (vLLM cache config info)",
    "enable_prefix_caching": "True | False (vLLM cache config info)",
    "num_gpu_blocks": "KV capacity in blocks (vLLM cache config info)",
    "kv_cache_size_tokens": "KV capacity in tokens (vLLM cache config info)",
    "mode": "operator mode: shadow | canary | active | fallback; per request: shadow | active | fallback",
    "policy": "active policy: br0 | brh | jsq | rr, and `router` (the existing router, shadow mode)",
    "outcome": "ok | client_cancel | upstream_error | rejected",
    "prompt_bucket": "prompt tokens: lt512 | 512-2k | 2k-8k | ge8k",
    "round_stage": "stage1 | stage2 (BalanceRoute's two stages within a routing round)",
    "result": "hit | miss",
}

#: Closed label sets of the active-routing metrics (the exporters may only use these values).
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "mode": MODES,
    "policy": POLICY_LABELS,
    "outcome": OUTCOMES,
    "prompt_bucket": PROMPT_BUCKETS,
    "round_stage": ROUND_STAGES,
    "result": LOOKUP_RESULTS,
}

#: Closed `reason` sets of the active-routing metrics, per family.
REASON_VALUES: dict[str, tuple[str, ...]] = {
    "shadow_mode_transitions_total": TRANSITION_REASONS,
    "shadow_fallback_trips_total": TRANSITION_REASONS,
    "shadow_policy_degraded_total": DEGRADE_REASONS,
    "shadow_router_backpressure_total": BACKPRESSURE_REASONS,
}


def allowed_values(metric: str, label: str) -> tuple[str, ...] | None:
    """The closed set a label of a metric must take its values from (None: bounded otherwise)."""
    if label == "reason":
        return REASON_VALUES.get(metric)
    if label == "leg" and metric.startswith("shadow_router_"):
        return LEGS
    return LABEL_VALUES.get(label)


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: `name` as PromQL sees it (`_total` on counters), base `unit`, bounded labels."""

    name: str
    type: MetricType
    unit: str
    labels: tuple[str, ...]
    help: str
    exporter: str
    #: "" = whenever the exporter runs; "active" = only `shadow serve --active` (the active proxy
    #: and the mode controller), so a shadow-only `shadow serve` need not declare it.
    only: str = ""

    @property
    def grafana_unit(self) -> str:
        """The Grafana unit id for panels showing this metric as it is (rates need their own)."""
        return {"seconds": "s", "ratio": "percentunit", "bytes": "bytes"}.get(self.unit, "short")


def _m(name: str, type_: MetricType, unit: str, labels: str, help_: str, exporter: str,
       only: str = "") -> MetricSpec:
    return MetricSpec(name, type_, unit, tuple(labels.split()) if labels else (), help_, exporter, only)


def _a(name: str, type_: MetricType, unit: str, labels: str, help_: str) -> MetricSpec:
    """An active-routing metric: exported by `shadow serve --active` (COORDINATION's fixed table)."""
    return _m(name, type_, unit, labels, help_, _SERVE, "active")


_TAP = "tap"
_SERVE = "serve"
_FLEET = "fleet"
_VLLM = "vllm"

CATALOGUE: tuple[MetricSpec, ...] = (
    # --- the mirror (shadow.mirror.metrics.MirrorCollector) --------------------------------------
    _m("shadow_mirror_requests_active", "gauge", "requests", "worker",
       "Mirrored requests active on each worker.", _TAP),
    _m("shadow_mirror_kv_tokens", "gauge", "tokens", "worker",
       "Mirrored KV tokens (prompt + generated) per worker.", _TAP),
    _m("shadow_mirror_free_slots", "gauge", "slots", "worker",
       "Free decode slots per worker (when slots are configured).", _TAP),
    _m("shadow_mirror_requests_finished_total", "counter", "requests", "worker",
       "Mirrored requests that finished, per worker.", _TAP),
    _m("shadow_mirror_requests_cancelled_total", "counter", "requests", "worker",
       "Mirrored requests cancelled by the client.", _TAP),
    _m("shadow_mirror_requests_reaped_total", "counter", "requests", "worker",
       "Mirrored requests ended by TTL reaping.", _TAP),
    _m("shadow_mirror_phantom_requests", "gauge", "requests", "",
       "Requests not ended and silent for longer than the phantom age.", _TAP),
    _m("shadow_mirror_pending_requests", "gauge", "requests", "",
       "Requests seen but not yet routed to a worker.", _TAP),
    _m("shadow_mirror_oldest_silence_seconds", "gauge", "seconds", "",
       "Longest silence of a live mirrored request.", _TAP),
    _m("shadow_mirror_orphan_events_total", "counter", "events", "",
       "Events for requests never arrived or routed.", _TAP),
    _m("shadow_mirror_events_total", "counter", "events", "source kind",
       "Normalised events applied to the mirror.", _TAP),
    _m("shadow_mirror_events_ignored_total", "counter", "events", "reason",
       "Events applied without effect, by reason.", _TAP),
    _m("shadow_mirror_events_rejected_total", "counter", "events", "reason",
       "Event API lines rejected, by reason.", _TAP),
    _m("shadow_mirror_dropped_total", "counter", "items", "reason",
       "Mirrored data dropped, by reason (never the traffic): the caps that bit.", _TAP),
    _m("shadow_mirror_errors_total", "counter", "errors", "stage",
       "Exceptions in the analysis side, by stage (isolated).", _TAP),
    _m("shadow_mirror_queue_depth", "gauge", "items", "",
       "Items waiting in the tap-to-analysis queue.", _TAP),
    _m("shadow_mirror_queue_capacity", "gauge", "items", "",
       "Capacity of the tap-to-analysis queue.", _TAP),
    _m("shadow_mirror_chunks_total", "counter", "chunks", "worker",
       "Response body pieces analysed, per tap.", _TAP),
    _m("shadow_mirror_legs_total", "counter", "requests", "worker leg",
       "Requests seen by taps, by leg (prefill/decode).", _TAP),
    _m("shadow_mirror_tap_ends_total", "counter", "requests", "worker reason",
       "Ends of proxied requests, by reason.", _TAP),
    _m("shadow_mirror_legs_inflight", "gauge", "requests", "worker",
       "Legs in flight through each tap.", _TAP),
    _m("shadow_mirror_stream_gaps_total", "counter", "gaps", "",
       "Gaps in copied streams after queue drops.", _TAP),
    _m("shadow_mirror_tap_requests_total", "counter", "requests", "worker",
       "HTTP requests relayed by each tap.", _TAP),
    _m("shadow_mirror_upstream_connect_errors_total", "counter", "errors", "worker",
       "Failed connections to upstream workers.", _TAP),
    _m("shadow_mirror_tap_rejected_total", "counter", "requests", "worker reason",
       "Requests or connections a tap refused or cut, by reason (bad_framing, head_too_large, "
       "header_timeout, body_timeout, idle_timeout, path_not_allowed, upgrade, busy, evicted_idle, "
       "not_resent, "
       "bad_upstream_response).", _TAP),
    _m("shadow_mirror_tap_connections", "gauge", "connections", "worker",
       "Client connections open on each tap.", _TAP),
    _m("shadow_mirror_queue_bytes", "gauge", "bytes", "",
       "Payload bytes waiting in the tap-to-analysis queue.", _TAP),
    _m("shadow_mirror_forward_sent_total", "counter", "events", "",
       "Events forwarded (--forward).", _TAP),
    _m("shadow_mirror_forward_dropped_total", "counter", "events", "",
       "Events not forwarded (full buffer or a failed post).", _TAP),
    _m("shadow_mirror_forward_errors_total", "counter", "errors", "",
       "Failed forwarding posts (network errors and HTTP statuses >= 400, e.g. 401).", _TAP),
    _m("shadow_mirror_drift_requests", "gauge", "requests", "worker",
       "Mirrored active minus the worker's running+waiting requests at the last scrape; for a worker "
       "that refuses connections (gone), the slots the mirror still counts there.", _TAP),
    _m("shadow_mirror_drift_kv_ratio", "gauge", "ratio", "worker",
       "Mirrored KV share minus the worker's KV cache usage (when capacity is known).", _TAP),
    _m("shadow_mirror_worker_requests_running", "gauge", "requests", "worker",
       "The worker's vllm:num_requests_running.", _TAP),
    _m("shadow_mirror_worker_requests_waiting", "gauge", "requests", "worker",
       "The worker's vllm:num_requests_waiting.", _TAP),
    _m("shadow_mirror_worker_kv_usage_ratio", "gauge", "ratio", "worker",
       "The worker's KV cache usage (0-1).", _TAP),
    _m("shadow_mirror_scrape_age_seconds", "gauge", "seconds", "worker",
       "Seconds since the last good scrape.", _TAP),
    _m("shadow_mirror_scrape_errors_total", "counter", "errors", "worker",
       "Failed scrapes of worker /metrics.", _TAP),
    # --- live lanes (shadow serve) ---------------------------------------------------------------
    _m("shadow_lane_steps_total", "counter", "steps", "lane",
       "Decode steps the lane has advanced.", _SERVE),
    _m("shadow_lane_spread_tokens", "gauge", "tokens", "lane",
       "max-min KV load over workers at the lane's latest step.", _SERVE),
    _m("shadow_lane_spread_token_steps_total", "counter", "token-steps", "lane",
       "Sum of spread over steps (rate ratio with steps = average spread).", _SERVE),
    _m("shadow_lane_imbalance_tokens", "gauge", "tokens", "lane",
       "I(k) = sum over workers of (max - L_g) at the lane's latest step.", _SERVE),
    _m("shadow_lane_imbalance_token_steps_total", "counter", "token-steps", "lane",
       "Sum of I(k) over steps.", _SERVE),
    _m("shadow_lane_barrier_idle_ratio", "gauge", "ratio", "lane",
       "Barrier-idle fraction over the report window (from the fitted step model).", _SERVE),
    _m("shadow_lane_throughput_tokens_per_second", "gauge", "tokens/s", "lane",
       "Estimated decode throughput of the lane.", _SERVE),
    _m("shadow_lane_tpot_seconds", "gauge", "seconds", "lane",
       "Estimated mean time per output token in the lane.", _SERVE),
    _m("shadow_lane_requests_finished_total", "counter", "requests", "lane",
       "Requests the lane has finished.", _SERVE),
    _m("shadow_lane_lookahead_stalls_total", "counter", "admissions", "lane",
       "Admissions held because a request's end was not yet known.", _SERVE),
    _m("shadow_lane_lag_seconds", "gauge", "seconds", "lane",
       "How far the lane runs behind the live clock.", _SERVE),
    _m("shadow_lane_agreements_total", "counter", "decisions", "lane",
       "Router decisions this lane's policy would have made identically.", _SERVE),
    _m("shadow_lane_decisions_total", "counter", "decisions", "lane",
       "Decisions compared for agreement.", _SERVE),
    _m("shadow_lane_worker_load_tokens", "gauge", "tokens", "lane worker",
       "Per-worker KV load in the lane.", _SERVE),
    _m("shadow_lane_worker_active_requests", "gauge", "requests", "lane worker",
       "Per-worker running requests in the lane.", _SERVE),
    _m("shadow_lane_decision_duration_seconds", "histogram", "seconds", "lane",
       "Routing-round compute time of the lane's policy.", _SERVE),
    _m("shadow_step_model_a_seconds_per_token", "gauge", "seconds/token", "",
       "Fitted a of T = a * max_g L_g + b.", _SERVE),
    _m("shadow_step_model_b_seconds", "gauge", "seconds", "",
       "Fitted b of T = a * max_g L_g + b.", _SERVE),
    _m("shadow_step_model_r2", "gauge", "ratio", "",
       "R² of the step-time fit over its window.", _SERVE),
    _m("shadow_step_model_samples", "gauge", "samples", "",
       "Samples in the step-time fit window.", _SERVE),
    _m("shadow_step_duration_seconds", "histogram", "seconds", "source",
       "Measured decode step times (source = events or sse).", _SERVE),
    _m("shadow_fidelity_load_relative_error", "gauge", "ratio", "",
       "Actual lane's per-worker loads vs the mirrored loads, mean relative error.", _SERVE),
    _m("shadow_live_events_dropped_total", "counter", "events", "reason",
       "Events the lanes could not take (queue_full, ...).", _SERVE),
    # --- active routing (shadow serve --active: the mode controller and the active proxy) -------
    _a("shadow_mode", "gauge", "info", "mode",
       "1 for the operator-set mode (shadow, canary, active, fallback), 0 for the others."),
    _a("shadow_mode_transitions_total", "counter", "transitions", "mode reason",
       "Transitions into `mode`, by reason (operator, flag_file, drift, recovered, ...)."),
    _a("shadow_mode_pinned", "gauge", "info", "",
       "1 when an operator pinned the mode (automatic fallback off)."),
    _a("shadow_fallback_active", "gauge", "info", "",
       "1 while automatic fallback routes round-robin."),
    _a("shadow_fallback_trips_total", "counter", "trips", "reason",
       "Automatic fallbacks, by trigger."),
    _a("shadow_fallback_holddown_seconds", "gauge", "seconds", "",
       "Current hold-down before recovery is tried."),
    _a("shadow_policy_active", "gauge", "info", "policy",
       "1 for the policy active mode runs now (br0, brh, jsq, rr)."),
    _a("shadow_policy_degraded_total", "counter", "degradations", "reason",
       "BR-H to BR-0 degradations, by reason (calibration, oracle_gap, net_gain)."),
    _a("shadow_predictor_calibration_error", "gauge", "ratio", "",
       "BR-H end-probability calibration error on finished requests (window)."),
    _a("shadow_predictor_key_lookups_total", "counter", "lookups", "result",
       "BR-H predictor prompt-key lookups, by result (hit, miss)."),
    _a("shadow_predictor_oracle_gap_ratio", "gauge", "ratio", "",
       "BR-H's live spread over the offline Oracle bound's on the same window, minus 1."),
    _a("shadow_router_requests_total", "counter", "requests", "mode policy outcome",
       "Requests through the active proxy by effective mode, policy and outcome."),
    _a("shadow_router_decision_duration_seconds", "histogram", "seconds", "policy",
       "Compute time of one dispatch round."),
    _a("shadow_router_upstream_errors_total", "counter", "errors", "leg worker",
       "Failed upstream calls, by leg (prefill, decode, router) and worker."),
    _a("shadow_router_retries_total", "counter", "retries", "leg",
       "Retries before the first byte reached a client."),
    _a("shadow_router_inflight", "gauge", "requests", "leg worker",
       "Requests in flight per upstream."),
    _a("shadow_router_kv_transfers_inflight", "gauge", "transfers", "worker",
       "KV transfers in flight per decode worker (capped)."),
    _a("shadow_router_backpressure_total", "counter", "waits", "reason",
       "Waits caused by back-pressure (prefill_kv, transfer_cap, no_slot)."),
    _a("shadow_pool_requests", "gauge", "requests", "",
       "Requests waiting in the Prompt Pool."),
    _a("shadow_pool_oldest_seconds", "gauge", "seconds", "",
       "Age of the oldest Prompt Pool entry."),
    _a("shadow_pool_wait_seconds", "histogram", "seconds", "",
       "Time from prefill done to decode dispatch."),
    _a("shadow_pool_reaped_total", "counter", "requests", "",
       "Pool entries released by the TTL reaper."),
    _a("shadow_pool_starvation_guard_total", "counter", "requests", "",
       "Pool entries dispatched by the age (starvation) guard rather than by score."),
    _a("shadow_router_first_token_seconds", "histogram", "seconds", "mode prompt_bucket",
       "Time to first token the client saw, through the proxy."),
    _a("shadow_router_tpot_seconds", "histogram", "seconds", "mode prompt_bucket",
       "Mean time per output token of a finished stream, as the client saw it."),
    _a("shadow_router_completion_seconds", "histogram", "seconds", "mode prompt_bucket",
       "Request start to last byte, as the client saw it."),
    _a("shadow_router_round_stage_seconds", "histogram", "seconds", "round_stage",
       "Compute time of BR Stage 1 (stage1) and Stage 2 (stage2) within a routing round."),
    _a("shadow_router_kv_transfer_seconds", "histogram", "seconds", "",
       "Decode dispatch to first decode token (KV transfer + queueing on the decode worker)."),
    _a("shadow_router_recomputed_total", "counter", "requests", "",
       "Decode legs that ended with stop_reason recomputed."),
    _a("shadow_router_resume_dropped_total", "counter", "requests", "",
       "Streams that stopped keeping their bytes for a recompute continuation (resume budget)."),
    # --- simulated fleet ground truth (shadow.fleet.metrics.StepCollector) ------------------------
    _m("shadow_fleet_steps_total", "counter", "steps", "",
       "Steps of the simulated fleet's shared decode clock.", _FLEET),
    _m("shadow_fleet_step_duration_seconds", "histogram", "seconds", "",
       "Wall duration of the simulated fleet's decode steps.", _FLEET),
    _m("shadow_fleet_last_step_seconds", "gauge", "seconds", "",
       "Wall duration of the last decode step.", _FLEET),
    _m("shadow_fleet_last_max_load_tokens", "gauge", "tokens", "",
       "max_g L_g of the last decode step.", _FLEET),
    _m("shadow_fleet_spread_token_steps_total", "counter", "token-steps", "",
       "Sum over decode steps of max_g L_g - min_g L_g over live ranks (ground-truth spread).", _FLEET),
    _m("shadow_fleet_load_tokens", "gauge", "tokens", "engine",
       "KV load L_g: prompt + generated tokens of the rank's running requests.", _FLEET),
    # --- worker metrics (vLLM V1 names; the simulated fleet exports the same) --------------------
    _m("vllm:num_requests_running", "gauge", "requests", "model_name engine",
       "Number of requests in model execution batches.", _VLLM),
    _m("vllm:num_requests_waiting", "gauge", "requests", "model_name engine",
       "Number of requests waiting to be processed.", _VLLM),
    _m("vllm:num_requests_waiting_by_reason", "gauge", "requests", "model_name engine reason",
       "Number of requests waiting, by reason.", _VLLM),
    _m("vllm:kv_cache_usage_perc", "gauge", "ratio", "model_name engine",
       "KV-cache usage. 1 means 100 percent usage.", _VLLM),
    _m("vllm:num_preemptions_total", "counter", "requests", "model_name engine",
       "Cumulative number of preemptions from the engine.", _VLLM),
    _m("vllm:prefix_cache_queries_total", "counter", "tokens", "model_name engine",
       "Prefix cache queries, in terms of number of queried tokens.", _VLLM),
    _m("vllm:prefix_cache_hits_total", "counter", "tokens", "model_name engine",
       "Prefix cache hits, in terms of number of cached tokens.", _VLLM),
    _m("vllm:prompt_tokens_total", "counter", "tokens", "model_name engine",
       "Number of prefill tokens processed.", _VLLM),
    _m("vllm:prompt_tokens_by_source_total", "counter", "tokens", "model_name engine source",
       "Number of prompt tokens by source.", _VLLM),
    _m("vllm:generation_tokens_total", "counter", "tokens", "model_name engine",
       "Number of generation tokens processed.", _VLLM),
    _m("vllm:request_success_total", "counter", "requests", "model_name engine finished_reason",
       "Count of successfully processed requests.", _VLLM),
    _m("vllm:time_to_first_token_seconds", "histogram", "seconds", "model_name engine",
       "Time to first token.", _VLLM),
    _m("vllm:inter_token_latency_seconds", "histogram", "seconds", "model_name engine",
       "Inter-token latency.", _VLLM),
    _m("vllm:request_time_per_output_token_seconds", "histogram", "seconds", "model_name engine",
       "Time per output token, per request.", _VLLM),
    _m("vllm:e2e_request_latency_seconds", "histogram", "seconds", "model_name engine",
       "End-to-end request latency.", _VLLM),
    _m("vllm:request_queue_time_seconds", "histogram", "seconds", "model_name engine",
       "Time spent in the WAITING phase.", _VLLM),
    _m("vllm:request_inference_time_seconds", "histogram", "seconds", "model_name engine",
       "Time spent in the RUNNING phase.", _VLLM),
    _m("vllm:request_prefill_time_seconds", "histogram", "seconds", "model_name engine",
       "Time spent in the PREFILL phase.", _VLLM),
    _m("vllm:request_decode_time_seconds", "histogram", "seconds", "model_name engine",
       "Time spent in the DECODE phase.", _VLLM),
    _m("vllm:iteration_tokens_total", "histogram", "tokens", "model_name engine",
       "Tokens per engine step.", _VLLM),
    _m("vllm:request_prompt_tokens", "histogram", "tokens", "model_name engine",
       "Prompt tokens per request.", _VLLM),
    _m("vllm:request_generation_tokens", "histogram", "tokens", "model_name engine",
       "Generated tokens per request.", _VLLM),
    _m("vllm:request_max_num_generation_tokens", "histogram", "tokens", "model_name engine",
       "Maximum requested generation tokens per request.", _VLLM),
    _m("vllm:request_params_max_tokens", "histogram", "tokens", "model_name engine",
       "The max_tokens request parameter.", _VLLM),
    _m("vllm:request_params_n", "histogram", "requests", "model_name engine",
       "The n request parameter.", _VLLM),
    _m("vllm:cache_config_info", "gauge", "info",
       "block_size enable_prefix_caching num_gpu_blocks kv_cache_size_tokens engine",
       "Information of the LLMEngine CacheConfig (value 1; vLLM has ~40 labels, these are the "
       "double's).", _VLLM),
)

_BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOGUE}
_HIST_SUFFIXES = ("_bucket", "_sum", "_count", "_created")


def lookup(series_name: str) -> MetricSpec | None:
    """The spec a series name belongs to (`x_total`, `x_bucket`, `x_created`, ... map to x's family)."""
    spec = _BY_NAME.get(series_name)
    if spec is not None:
        return spec
    for suffix in _HIST_SUFFIXES:
        if series_name.endswith(suffix):
            base = series_name[: -len(suffix)]
            spec = _BY_NAME.get(base) or _BY_NAME.get(base + "_total")
            if spec is not None and (spec.type != "gauge"):
                return spec
    return None


def for_exporter(*exporters: str, active: bool = True) -> tuple[MetricSpec, ...]:
    """Specs of `exporters`; without `active`, only those exported whatever the mode."""
    return tuple(m for m in CATALOGUE if m.exporter in exporters and (active or not m.only))


def active_only() -> frozenset[str]:
    """Names exported only by `shadow serve --active`."""
    return frozenset(m.name for m in CATALOGUE if m.only == "active")


def check_exposition(text: str, exporters: Iterable[str] = EXPORTERS) -> list[str]:
    """Problems with one `/metrics` text against the catalogue (empty when it conforms).

    Each family must be catalogued for one of `exporters`, with the same type and label names.
    """
    allowed = set(exporters)
    problems: list[str] = []
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith("_created") and fam.type == "gauge":
            owner = lookup(fam.name)
            if owner is not None and owner.type != "gauge" and owner.exporter in allowed:
                continue  # the client's `_created` series of a catalogued counter or histogram
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        spec = _BY_NAME.get(name)
        if spec is None and fam.type == "counter":
            spec = _BY_NAME.get(fam.name)
        if spec is None or spec.exporter not in allowed:
            problems.append(f"{name}: not in the catalogue for {sorted(allowed)} "
                            "(shadow/telemetry/catalogue.py)")
            continue
        if spec.type != fam.type:
            problems.append(f"{name}: exported as {fam.type}, catalogued as {spec.type}")
        seen: set[str] = set()
        for sample in fam.samples:
            seen |= set(sample.labels) - {"le", "quantile"}
            for label, value in sample.labels.items():
                closed = allowed_values(spec.name, label)
                if closed is not None and value not in closed:
                    problems.append(f"{name}: {label}={value!r} outside the closed set {list(closed)}")
        if fam.samples and seen != set(spec.labels):
            problems.append(f"{name}: labels {sorted(seen)}, catalogued {sorted(spec.labels)}")
    return problems


def markdown() -> str:
    """The catalogue as the Markdown document docs/metrics.md (generated; do not edit by hand)."""
    out = [
        "# Metrics",
        "",
        "Generated from `shadow/telemetry/catalogue.py` by `shadow dashboards build`; do not edit.",
        "Names are as PromQL sees them (counters end in `_total`, histograms add `_bucket`, `_sum`,",
        "`_count`). Exporters: `tap` = the mirror (`shadow tap`, `shadow serve`); `serve` = the live",
        "lanes (`shadow serve`); `fleet` = the simulated fleet's ground truth; `vllm` = worker metrics",
        "that shadow reads (vLLM exports them; so does the simulated fleet). `serve (--active)`:",
        "exported only when `shadow serve --active` runs the active proxy and the mode controller.",
        "",
        "| name | type | unit | labels | exporter | help |",
        "|---|---|---|---|---|---|",
    ]
    for m in CATALOGUE:
        labels = ", ".join(f"`{x}`" for x in m.labels) or "–"
        exporter = f"{m.exporter} (--{m.only})" if m.only else m.exporter
        out.append(f"| `{m.name}` | {m.type} | {m.unit} | {labels} | {exporter} | {m.help} |")
    out += ["", "## Labels", "", "| label | bounded by |", "|---|---|"]
    out += [f"| `{k}` | {v} |" for k, v in LABELS.items()]
    out += ["", "## Closed `reason` sets of the active-routing metrics", "", "| metric | reasons |",
            "|---|---|"]
    out += [f"| `{k}` | {', '.join(f'`{x}`' for x in v)} |" for k, v in REASON_VALUES.items()]
    return "\n".join(out) + "\n"
