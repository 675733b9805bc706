"""The metric catalogue against the real exporters: nothing exported outside it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from shadow.app.catalogue import catalogue as build_catalogue
from shadow.telemetry.catalogue import EXPORTERS, LABELS
from tests.telemetry.stack import running_stack, send_traffic, until_step_model

catalogue = build_catalogue()
CATALOGUE = catalogue.entries
check_exposition = catalogue.check_exposition
lookup = catalogue.lookup

ROOT = Path(__file__).resolve().parents[2]


def test_catalogue_entries_follow_the_conventions() -> None:
    names = [m.name for m in CATALOGUE]
    assert len(names) == len(set(names))
    for m in CATALOGUE:
        assert m.exporter in EXPORTERS
        assert m.help.strip(), m.name
        assert set(m.labels) <= set(LABELS), m.name
        if m.exporter == "vllm" or m.name.startswith("process_"):
            continue  # vLLM's names, and the client library's standard process metrics
        assert m.name.startswith("shadow_") and ":" not in m.name, m.name
        assert m.name.endswith("_total") == (m.type == "counter"), m.name
        assert not any(x in m.name for x in ("_ms", "_percent", "request_id")), m.name
        if m.type == "histogram":
            assert "worker" not in m.labels, f"{m.name}: no worker label on histograms"


def test_lookup_maps_series_to_families() -> None:
    assert lookup("shadow_mirror_events_total").name == "shadow_mirror_events_total"  # type: ignore[union-attr]
    assert lookup("shadow_fleet_step_duration_seconds_bucket").type == "histogram"  # type: ignore[union-attr]
    assert lookup("shadow_mirror_events_created").name == "shadow_mirror_events_total"  # type: ignore[union-attr]
    assert lookup("shadow_mirror_kv_tokens_sum") is None  # a gauge has no _sum
    assert lookup("shadow_nonexistent") is None


def test_check_exposition_reports_unknown_type_and_label_problems() -> None:
    text = (
        "# TYPE shadow_mirror_kv_tokens gauge\nshadow_mirror_kv_tokens{worker=\"a\",extra=\"x\"} 1\n"
        "# TYPE shadow_mirror_phantom_requests counter\nshadow_mirror_phantom_requests_total 1\n"
        "# TYPE shadow_made_up gauge\nshadow_made_up 1\n"
    )
    problems = check_exposition(text)
    assert any("shadow_mirror_kv_tokens: labels" in p for p in problems)
    assert any("shadow_mirror_phantom_requests" in p and "not in the catalogue" in p for p in problems)
    assert any("shadow_made_up" in p for p in problems)
    ok = "# TYPE shadow_mirror_kv_tokens gauge\nshadow_mirror_kv_tokens{worker=\"a\"} 1\n"
    assert check_exposition(ok) == []
    assert check_exposition(ok, exporters=["fleet"]) != []  # right name, wrong exporter


def test_active_routing_metrics_are_the_coordinated_table() -> None:
    """The fixed names, types and labels of active routing (COORDINATION.md), exporter `serve`."""
    expected = {
        "shadow_mode": ("gauge", ("mode",)), "shadow_mode_transitions_total": ("counter", ("mode", "reason")),
        "shadow_mode_pinned": ("gauge", ()), "shadow_fallback_active": ("gauge", ()),
        "shadow_fallback_trips_total": ("counter", ("reason",)),
        "shadow_fallback_holddown_seconds": ("gauge", ()), "shadow_policy_active": ("gauge", ("policy",)),
        "shadow_policy_degraded_total": ("counter", ("reason",)),
        "shadow_predictor_calibration_error": ("gauge", ()),
        "shadow_router_requests_total": ("counter", ("mode", "policy", "outcome")),
        "shadow_router_decision_duration_seconds": ("histogram", ("policy",)),
        "shadow_router_upstream_errors_total": ("counter", ("leg", "worker")),
        "shadow_router_retries_total": ("counter", ("leg",)),
        "shadow_router_inflight": ("gauge", ("leg", "worker")),
        "shadow_router_kv_transfers_inflight": ("gauge", ("worker",)),
        "shadow_router_backpressure_total": ("counter", ("reason",)),
        "shadow_pool_requests": ("gauge", ()), "shadow_pool_oldest_seconds": ("gauge", ()),
        "shadow_pool_wait_seconds": ("histogram", ()), "shadow_pool_reaped_total": ("counter", ()),
        "shadow_router_first_token_seconds": ("histogram", ("mode", "prompt_bucket")),
        "shadow_router_tpot_seconds": ("histogram", ("mode", "prompt_bucket")),
        "shadow_router_completion_seconds": ("histogram", ("mode", "prompt_bucket")),
        "shadow_router_round_stage_seconds": ("histogram", ("round_stage",)),
        "shadow_router_kv_transfer_seconds": ("histogram", ()),
        "shadow_router_recomputed_total": ("counter", ()),
        "shadow_router_resume_dropped_total": ("counter", ()),
        "shadow_pool_starvation_guard_total": ("counter", ()),
        "shadow_router_placements_total": ("counter", ("worker", "policy")),
        "shadow_router_worker_up": ("gauge", ("worker",)),
        "shadow_router_streams_cut_total": ("counter", ("leg", "reason")),
        "shadow_predictor_key_lookups_total": ("counter", ("result",)),
        "shadow_predictor_oracle_gap_ratio": ("gauge", ()),
        "shadow_cohort_requests_total": ("counter", ("cohort", "result")),
        "shadow_canary_step_fraction": ("gauge", ()),
        "shadow_canary_verdicts_total": ("counter", ("verdict",)),
        "shadow_canary_p_value": ("gauge", ("metric",)),
    }
    got = {m.name: (m.type, m.labels) for m in CATALOGUE if m.only == "active"}
    assert got == expected
    assert all(m.exporter == "serve" for m in CATALOGUE if m.only == "active")
    assert catalogue.active_only() == set(expected)
    for name in ("shadow_router_first_token_seconds", "shadow_router_tpot_seconds",
                 "shadow_router_completion_seconds"):
        assert catalogue.get(name).family.values["prompt_bucket"] == (  # type: ignore[union-attr]
            "lt512", "512-2k", "2k-8k", "ge8k")


def test_check_exposition_holds_active_labels_to_their_closed_sets() -> None:
    good = (
        "# TYPE shadow_router_requests_total counter\n"
        'shadow_router_requests_total{mode="active",policy="br0",outcome="ok"} 1\n'
        "# TYPE shadow_fallback_trips_total counter\n"
        'shadow_fallback_trips_total{reason="drift"} 1\n'
        "# TYPE shadow_router_round_stage_seconds histogram\n"
        'shadow_router_round_stage_seconds_bucket{round_stage="stage1",le="+Inf"} 1\n'
        'shadow_router_round_stage_seconds_count{round_stage="stage1"} 1\n'
        'shadow_router_round_stage_seconds_sum{round_stage="stage1"} 0.001\n'
    )
    assert check_exposition(good, exporters=["serve"]) == []
    bad = (
        "# TYPE shadow_router_requests_total counter\n"
        'shadow_router_requests_total{mode="canary",policy="br0",outcome="timeout"} 1\n'
        "# TYPE shadow_fallback_trips_total counter\n"
        'shadow_fallback_trips_total{reason="cosmic_rays"} 1\n'
        "# TYPE shadow_router_first_token_seconds histogram\n"
        'shadow_router_first_token_seconds_count{mode="active",prompt_bucket="1k"} 1\n'
    )
    problems = check_exposition(bad, exporters=["serve"])
    assert any("outcome='timeout'" in p for p in problems), problems
    assert any("reason='cosmic_rays'" in p for p in problems), problems
    assert any("prompt_bucket='1k'" in p for p in problems), problems
    assert not any("mode='canary'" in p for p in problems)  # canary is a mode (of the gauge's set)


def test_docs_table_is_generated_from_the_catalogue() -> None:
    assert (ROOT / "docs" / "metrics.md").read_text() == catalogue.markdown(), (
        "docs/metrics.md is stale: run `shadow dashboards build`"
    )


@pytest.mark.integration
@pytest.mark.parametrize("serve", [False, True], ids=["shadow-tap", "shadow-serve"])
def test_real_exporters_export_nothing_outside_the_catalogue(serve: bool) -> None:
    """`shadow tap` exports the `tap` metrics, `shadow serve` the `tap` and `serve` ones, the fleet
    its ground truth and vLLM's; each declares every family catalogued for it and nothing else."""
    exporters = ["mirror", "serve"] if serve else ["mirror"]
    with running_stack(serve=serve, time_scale=1.0 if serve else 0.05) as stack:
        send_traffic(list(stack.tap_urls.values()), per_url=4, max_tokens=30)
        stack.taps.wait_for(lambda: stack.taps.svc.state.live() == 0 and not len(stack.taps.svc.queue))
        # wait for one reconciliation scrape so the drift/scrape families carry samples
        rec = stack.taps.svc.reconciler
        assert rec is not None
        stack.taps.wait_for(lambda: all(w.last_ok is not None for w in rec.workers.values()))
        if serve:
            until_step_model(stack)
        text = httpx.get(stack.api + "/metrics", timeout=5).text
        fleet_texts = [httpx.get(u + "/metrics", timeout=5).text for u in stack.fleet.decode_urls]
    assert check_exposition(text, exporters=exporters) == []
    # Prometheus' own metric lint (naming, units, _total only on counters) accepts what shadow exports
    # (the fleet's vllm:* names are vLLM's, colons included, and are not linted here)
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing (apt-get install -y prometheus)"
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    # promtool reads the `_b_` of the step model's fitted b (T = a·L + b) as the abbreviated unit
    # "b"; the name is the contract with the live lanes and its unit is seconds: that finding alone
    # is accepted.
    accepted = {"shadow_step_model_b_seconds metric names should not contain abbreviated units"}
    findings = {line.strip() for line in (lint.stdout + lint.stderr).splitlines() if line.strip()}
    assert findings <= accepted, findings - accepted
    for fleet_text in fleet_texts:
        assert check_exposition(fleet_text, exporters=["fleet", "vllm"]) == []
    # and the scrape really covered the families, with samples
    exported = {line.split("{")[0].split(" ")[0]
                for line in text.splitlines() if not line.startswith("#")}
    for name in ("shadow_mirror_events_total", "shadow_mirror_requests_finished_total",
                 "shadow_mirror_drift_requests", "shadow_mirror_chunks_total"):
        assert name in exported, name
    if serve:
        for name in ("shadow_lane_steps_total", "shadow_lane_worker_load_tokens",
                     "shadow_step_model_r2", "shadow_fidelity_load_relative_error"):
            assert name in exported, name
    # (the active-routing families are declared only by `shadow serve --active`: tests/active/)
    specs = {m.name for m in catalogue.for_exporter(*exporters, active=False)}
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    families = {s.name for n in declared if (s := lookup(n)) is not None}
    assert specs - families == set(), "catalogued metrics the running exporter does not declare"


@pytest.mark.integration
def test_shadow_serve_active_declares_every_catalogued_family_and_nothing_else(tmp_path: Path) -> None:
    """`shadow serve --active` (canary: requests routed by shadow and by the router) exports the
    tap, lane and active-routing families of the catalogue, with their closed label sets, and
    nothing outside it; promtool's metric lint accepts the active families too."""
    from tests.telemetry.active_stack import active_stack

    with active_stack(tmp_path) as stack:
        send_traffic([stack.front], per_url=12, max_tokens=30)
        text = httpx.get(stack.api + "/metrics", timeout=5).text
    assert check_exposition(text, exporters=["mirror", "serve"]) == []
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    families = {s.name for n in declared if (s := lookup(n)) is not None}
    assert catalogue.active_only() - families == set(), "active families the exporter does not declare"
    assert {m.name for m in catalogue.for_exporter("mirror", "serve")} - families == set()
    modes = {line.split('mode="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("shadow_router_requests_total{") and 'outcome="ok"' in line}
    assert {"active", "shadow"} <= modes, modes  # canary routed both ways
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing (apt-get install -y prometheus)"
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    findings = {line.strip() for line in (lint.stdout + lint.stderr).splitlines() if line.strip()}
    findings.discard("shadow_step_model_b_seconds metric names should not contain abbreviated units")
    assert findings == set(), findings
