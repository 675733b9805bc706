"""PromQL for histogram quantiles shared by the active-mode dashboards."""

from __future__ import annotations

from grafana_foundation_sdk.builders import prometheus

from shadow.telemetry.dashboards._kit import RATE, q, sel


def quantile(phi: float, hist: str, by: str = "", extra: str = "") -> str:
    """histogram_quantile(phi) of `hist` over the window, summed over everything but `le` and `by`."""
    keys = "le" + (", " + by if by else "")
    return f"histogram_quantile({phi}, sum by ({keys}) (rate({hist}_bucket{sel(extra)}[{RATE}])))"


def quantiles(hist: str, by: str = "", phis: tuple[float, ...] = (0.5, 0.95, 0.99),
              extra: str = "") -> list[prometheus.Dataquery]:
    """One target per quantile, legends `p50 {{by}}` ..., refs A, B, C."""
    suffix = " ".join("{{" + k.strip() + "}}" for k in by.split(",") if k.strip())
    return [q(quantile(phi, hist, by, extra), f"p{round(phi * 100)} {suffix}".strip(), ref=chr(65 + i))
            for i, phi in enumerate(phis)]
