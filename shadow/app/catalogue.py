"""The metric catalogue of the whole house: every exporter's declared families, by exporter."""

from __future__ import annotations

from shadow.active import metrics as active_metrics
from shadow.active import mode_metrics, standin
from shadow.base import listener_metrics, procinfo
from shadow.dataplane import relay_metrics
from shadow.fleet import metrics as fleet_metrics
from shadow.live import metrics as live_metrics
from shadow.mirror import metrics as mirror_metrics
from shadow.realvllm import probe_metrics
from shadow.telemetry.catalogue import Catalogue, Exported


def catalogue() -> Catalogue:
    """The catalogue, in the order docs/metrics.md lists it."""
    return Catalogue((
        Exported("mirror", mirror_metrics.FAMILIES + listener_metrics.FAMILIES + procinfo.FAMILIES),
        Exported("capture", mirror_metrics.CAPTURE_FAMILIES),
        Exported("dataplane", relay_metrics.FAMILIES),
        Exported("serve", live_metrics.FAMILIES),
        Exported("serve", mode_metrics.FAMILIES + active_metrics.FAMILIES, only="active"),
        Exported("router", standin.FAMILIES),
        Exported("fleet", fleet_metrics.FLEET_FAMILIES),
        Exported("vllm", fleet_metrics.VLLM_FAMILIES),
        Exported("probe", probe_metrics.FAMILIES),
    ))
