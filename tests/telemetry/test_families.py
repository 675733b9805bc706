"""Metric families declared once: the declaration type, collectors that describe what they collect,
and the catalogue made of the declarations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shadow.active import metrics as active_metrics
from shadow.active import mode_metrics, standin
from shadow.app.catalogue import catalogue
from shadow.base import listener_metrics, procinfo
from shadow.base.families import DeclaredCollector, Family
from shadow.dataplane import relay_metrics
from shadow.fleet import metrics as fleet_metrics
from shadow.live import metrics as live_metrics
from shadow.mirror import metrics as mirror_metrics
from shadow.realvllm import probe_metrics
from shadow.realvllm.probe_metrics import ProbeCollector
from shadow.realvllm.stepsender import SenderCounts, StepSample
from shadow.telemetry.catalogue import Catalogue, Exported

CATALOGUE = catalogue()


def test_a_declaration_checks_itself() -> None:
    with pytest.raises(ValueError, match="_total"):
        Family("shadow_x", "counter", "h", "events")
    with pytest.raises(ValueError, match="_total"):
        Family("shadow_x_total", "gauge", "h", "events")
    with pytest.raises(ValueError, match="labels it does not have"):
        Family("shadow_x", "gauge", "h", "events", ("a",), {"b": ("1",)})
    with pytest.raises(ValueError, match="increasing"):
        Family("shadow_x_seconds", "histogram", "h", "seconds", buckets=(0.2, 0.1))
    with pytest.raises(ValueError, match="histograms"):
        Family("shadow_x", "gauge", "h", "events", buckets=(0.1,))
    # vLLM's names are vLLM's: a colon name keeps its `_total` on a histogram
    assert Family("vllm:iteration_tokens_total", "histogram", "h", "tokens").type == "histogram"


def test_a_declaration_builds_families_and_instruments() -> None:
    fam = Family("shadow_x_total", "counter", "Things.", "things", ("worker", "lane"))
    out = fam.sampled({("1", "2"): 3, ("4", "5"): None})
    assert out.name == "shadow_x" and out.documentation == "Things."
    assert [(s.name, s.labels, s.value) for s in out.samples] == [
        ("shadow_x_total", {"worker": "1", "lane": "2"}, 3)]
    gauge = Family("shadow_g", "gauge", "G.", "items")
    assert [s.value for s in gauge.value(2.5).samples] == [2.5]
    assert gauge.value(None).samples == []
    with pytest.raises(TypeError):
        gauge.counter(CollectorRegistry())
    hist = Family("shadow_h_seconds", "histogram", "H.", "seconds", buckets=(0.1, 1.0))
    assert hist.cumulative([2, 5], 7) == [("0.1", 2.0), ("1.0", 5.0), ("+Inf", 7.0)]
    with pytest.raises(ValueError):
        hist.cumulative([1], 1)  # one count per declared bound
    with pytest.raises(TypeError):
        hist.sampled({(): 1})
    registry = CollectorRegistry()
    hist.histogram(registry).observe(0.5)
    fam.counter(registry).labels("x", "y").inc()
    text = generate_latest(registry).decode()
    assert '# HELP shadow_h_seconds H.\n' in text and 'shadow_h_seconds_bucket{le="1.0"} 1.0' in text
    assert [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "shadow_x_total"] == [({"worker": "x", "lane": "y"}, 1.0)]
    assert CATALOGUE.check_exposition(text, ["mirror"]) != []  # not catalogued
    assert Catalogue([Exported("mirror", (fam, hist, gauge))]).check_exposition(text, ["mirror"]) == []


class _Queue:
    dropped = 0
    maxsize = 8
    bytes = 0

    def __len__(self) -> int:
        return 0


def _collectors() -> list[tuple[DeclaredCollector, tuple[Family, ...]]]:
    """Each custom collector with every part it reads present, and the families it declares."""
    ws = {"a": SimpleNamespace(active=1, kv_tokens=2, slots=4, finished=1, cancelled=0, reaped=0)}
    state = SimpleNamespace(workers=ws, orphans=0, phantoms=lambda now: 0, pending=lambda: 0,
                            oldest_silence=lambda now: None)
    mirror = SimpleNamespace(state=state, events={}, ignored={}, dropped={}, recorder=None, errors={},
                             listener_errors=0, hold=None)
    queue = _Queue()
    analyzer = SimpleNamespace(chunks={}, legs={}, ends={}, inflight={}, gaps=0, output_counts={})
    tap = SimpleNamespace(name="a", requests=0, connect_errors=0, rejected={}, cut={}, connections=0)
    rec = SimpleNamespace(workers={"a": SimpleNamespace(drift_requests=0, drift_kv_ratio=None, draining=None,
                                                        load=None, last_ok=None, errors=0)},
                          unsettled=0)
    mc = mirror_metrics.MirrorCollector(mirror, analyzer=analyzer, queue=queue,  # type: ignore[arg-type]
                                        taps=[tap], reconciler=rec)  # type: ignore[list-item,arg-type]
    live = SimpleNamespace(report=lambda: {"lanes": {}, "step_model": {}, "step_histogram": {}})
    ctrl = SimpleNamespace(metrics=lambda: {
        "mode": "shadow", "transitions": {}, "pinned": False, "fallback": False, "trips": {}, "holddown_s": 0,
        "policy": "router", "degraded": {}, "calibration_error": None, "oracle_gap": None,
        "canary_fraction": 0.0, "canary_verdicts": {}, "canary_p": {}, "cohorts": {}})
    proxy = SimpleNamespace(prefill=SimpleNamespace(prefillers=[]), decode_names=[], errors={})
    relay_tap = SimpleNamespace(name="a", requests=0, connect_errors=0, rejected={}, cut={}, connections=0,
                                inflight=lambda: 0)
    sink = SimpleNamespace(attached=None, attaches=0, dropped_total=0, kept_bytes=0, kept_requests=0,
                           unkept=0, missed=0, detached={}, pending_bytes=0, clamped=0)
    relay = SimpleNamespace(taps=[relay_tap], sink=sink, refused={}, spec=SimpleNamespace(restarts=0),
                            started=0.0)
    capture = SimpleNamespace(byte_counts=lambda: {"to_server": 0, "to_client": 0, "gap": 0}, segments=0,
                              requests=0, seen_ratio=lambda: 1.0, kernel_drops=0, parse_errors=0, flows={})
    clock = SimpleNamespace(steps=0, last_step_s=0.0, last_max_load=0, sum_spread=0,
                            step_hist=fleet_metrics.Hist(()))
    return [
        (mc, mirror_metrics.FAMILIES),
        (live_metrics.LiveCollector(live), live_metrics.FAMILIES),  # type: ignore[arg-type]
        (mode_metrics.ModeCollector(ctrl), mode_metrics.FAMILIES),  # type: ignore[arg-type]
        (standin.StandInCollector(proxy), standin.FAMILIES),  # type: ignore[arg-type]
        (fleet_metrics.VllmCollector("m", lambda: [], 16, 1024), fleet_metrics.VLLM_FAMILIES),
        (fleet_metrics.StepCollector(lambda: clock, lambda: [], lambda s: 0),
         fleet_metrics.FLEET_FAMILIES),
        (relay_metrics.RelayCollector(relay), relay_metrics.FAMILIES),
        (mirror_metrics.CaptureCollector(capture), mirror_metrics.CAPTURE_FAMILIES),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize(
    "index", range(8), ids=["mirror", "live", "mode", "standin", "vllm", "fleet", "relay", "capture"])
def test_collectors_describe_what_they_collect_in_order(index: int) -> None:
    collector, families = _collectors()[index]
    described = [(m.name, m.type, m.documentation) for m in collector.describe()]
    collected = [(m.name, m.type, m.documentation) for m in collector.collect()]
    assert described == collected
    assert [f.name.removesuffix("_total") if f.type == "counter" else f.name for f in families] == \
        [name for name, _, _ in described]


def test_active_metrics_register_their_declared_families() -> None:
    registry = CollectorRegistry()
    active_metrics.ActiveMetrics(registry)
    text = generate_latest(registry).decode()
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    names = {e.name for n in declared if (e := CATALOGUE.lookup(n)) is not None}
    assert names == {f.name for f in active_metrics.FAMILIES}
    assert CATALOGUE.check_exposition(text, ["serve"]) == []


def test_one_probe_collector_exposes_every_engine_of_an_api_server_once() -> None:
    """The engines of one vLLM API server (DP ranks) share one collector: the family is on the
    page once (Prometheus refuses a page with it twice), with every engine's outcomes, also those
    of an engine that has not stepped yet."""
    registry = CollectorRegistry(auto_describe=True)
    counts = SenderCounts()
    counts.add("sent", [StepSample(0.0, 0, None, 1, 0, 0.0, 1, 0)] * 5)
    counts.add("sent", [StepSample(0.0, 1, None, 1, 0, 0.0, 1, 0)] * 7)
    counts.engine(1).dropped_full += 1
    registry.register(ProbeCollector(SimpleNamespace(counts=counts), [0, 1, 2]))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'shadow_probe_steps_total{engine="0",outcome="sent"} 5.0' in text
    assert 'shadow_probe_steps_total{engine="1",outcome="sent"} 7.0' in text
    assert 'shadow_probe_steps_total{engine="1",outcome="dropped_full"} 1.0' in text
    assert 'shadow_probe_steps_total{engine="2",outcome="sent"} 0.0' in text
    assert CATALOGUE.check_exposition(text, ["probe"]) == []
    # what two collectors on one registry (one per engine, as before) put on the page: refused
    twice = text + text
    assert CATALOGUE.check_exposition(twice, ["probe"]) == [
        "shadow_probe_steps_total: exposed 2 times on one page (Prometheus' parser refuses it)"]


def test_catalogue_is_every_declaration_once() -> None:
    groups = (mirror_metrics.FAMILIES, listener_metrics.FAMILIES, procinfo.FAMILIES, live_metrics.FAMILIES,
              mode_metrics.FAMILIES, active_metrics.FAMILIES, standin.FAMILIES, fleet_metrics.FLEET_FAMILIES,
              fleet_metrics.VLLM_FAMILIES, probe_metrics.FAMILIES,
              relay_metrics.FAMILIES, mirror_metrics.CAPTURE_FAMILIES)
    declared = [f for group in groups for f in group]
    assert sorted(e.family.name for e in CATALOGUE) == sorted(f.name for f in declared)
    assert all(CATALOGUE.get(f.name).family is f for f in declared)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="declared twice"):
        Catalogue([Exported("mirror", mirror_metrics.FAMILIES),
                   Exported("serve", mirror_metrics.FAMILIES[:1])])
    with pytest.raises(ValueError, match="unknown exporter"):
        Catalogue([Exported("nowhere", ())])
    with pytest.raises(ValueError, match="not in LABELS"):
        Catalogue([Exported("mirror", (Family("shadow_x", "gauge", "h", "x", ("colour",)),))])


def test_check_exposition_reports_help_and_bucket_drift() -> None:
    name = "shadow_router_round_stage_seconds"
    text = (f"# HELP {name} another text\n# TYPE {name} histogram\n"
            f'{name}_bucket{{round_stage="stage1",le="0.3"}} 1\n'
            f'{name}_bucket{{round_stage="stage1",le="+Inf"}} 1\n'
            f'{name}_count{{round_stage="stage1"}} 1\n{name}_sum{{round_stage="stage1"}} 0.1\n')
    problems = CATALOGUE.check_exposition(text, ["serve"])
    assert any(p.startswith(f"{name}: help 'another text'") for p in problems), problems
    assert any(p.startswith(f"{name}: buckets ['0.3']") for p in problems), problems
