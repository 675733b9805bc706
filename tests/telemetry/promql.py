"""PromQL helpers for tests: parse (promql-parser, a Rust PromQL parser) and list metric names."""

from __future__ import annotations

import re
from typing import Any

import promql_parser

# Grafana's variables, replaced before parsing (as Grafana does before sending the query).
_GRAFANA_VARS = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
    "${datasource}": "",
    # the dashboards' Kubernetes scope variables, at "All"
    "$cluster": ".*",
    "$namespace": ".*",
    "$pod": ".*",
}


def substitute(expr: str, variables: dict[str, str] | None = None) -> str:
    """Expression with Grafana's built-ins and the dashboard variables replaced."""
    out = expr
    for k, v in _GRAFANA_VARS.items():
        out = out.replace(k, v)
    for k, v in (variables or {}).items():
        out = out.replace("${" + k + "}", v).replace("$" + k, v)
    if "$" in re.sub(r'"[^"]*"', "", out):
        raise ValueError(f"unsubstituted variable in {out!r}")
    return out


def metric_names(expr: str) -> set[str]:
    """Every metric name a (substituted) PromQL expression selects; raises ValueError if it does not parse."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            if node.name:
                names.add(node.name)
            return
        for attr in ("lhs", "rhs", "expr", "param", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, str | int | float):
                walk(child)
        for arg in getattr(node, "args", None) or ():
            walk(arg)

    walk(promql_parser.parse(expr))
    return names


def family(series: str) -> str:
    """Series name to family name (`x_bucket` → `x`) for catalogue lookups of histograms."""
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series
