"""Histogram panels and PromQL shared by the dashboards: quantiles and bucket heatmaps."""

from __future__ import annotations

from grafana_foundation_sdk.builders import heatmap, prometheus

from shadow.telemetry.dashboards._kit import RATE, heat, named, q, rate, sel


def quantile(phi: float, hist: str, by: str = "", extra: str = "") -> str:
    """histogram_quantile(phi) of `hist` over the window, summed over everything but `le` and `by`."""
    keys = "le" + (", " + by if by else "")
    return f"histogram_quantile({phi}, sum by ({keys}) (rate({hist}_bucket{sel(extra)}[{RATE}])))"


def quantiles(hist: str, by: str = "", phis: tuple[float, ...] = (0.5, 0.95, 0.99),
              extra: str = "") -> list[prometheus.Dataquery]:
    """One target per quantile, legends `p50 {{by}}` ...."""
    return [q(quantile(phi, hist, by, extra), named(f"p{round(phi * 100)}", by)) for phi in phis]


def bucket_heat(title: str, description: str, unit: str, hist: str) -> heatmap.Panel:
    """A heatmap of a histogram's bucket increases per window (Grafana does not re-bucket)."""
    return heat(title, description, unit, q(rate(f"{hist}_bucket", "le", fn="increase"), "{{le}}", heat=True),
                calculate=False)
