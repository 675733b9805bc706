"""The metric families running exporters declare (name, type, help, label names), as recorded in
`exported_families.json`: the contract that metric names, types, labels and help texts stay put.

`python -m tests.telemetry.families` records them again from running processes (tap, serve, serve
--active, the fleet, `shadow router`) and prints the JSON; commit it only for an intended change.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

RECORDED = Path(__file__).with_name("exported_families.json")


def families(text: str) -> dict[str, dict[str, Any]]:
    """{family name as PromQL sees it: {type, help, labels}} of one `/metrics` text; `labels` is
    None for a family without samples (its label names are not on the wire)."""
    out: dict[str, dict[str, Any]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith("_created") and fam.type == "gauge":
            continue  # the client's `_created` series of a counter or histogram
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = sorted({k for s in fam.samples for k in s.labels} - {"le", "quantile"})
        out[name] = {"type": fam.type, "help": fam.documentation,
                     "labels": labels if fam.samples else None}
    return out


def recorded() -> dict[str, dict[str, dict[str, Any]]]:
    """The recorded families by scenario (tap, serve, serve-active, fleet, router)."""
    data: dict[str, dict[str, dict[str, Any]]] = json.loads(RECORDED.read_text(encoding="utf-8"))
    return data


def differences(scenario: str, text: str) -> list[str]:
    """How a running exporter's families differ from the recorded ones of `scenario` (empty: the
    same names, types, help texts, and label names wherever both have samples)."""
    want = recorded()[scenario]
    got = families(text)
    out = [f"{n}: recorded, not exported" for n in sorted(set(want) - set(got))]
    out += [f"{n}: exported, not recorded" for n in sorted(set(got) - set(want))]
    for name in sorted(set(want) & set(got)):
        w, g = want[name], got[name]
        for key in ("type", "help"):
            if w[key] != g[key]:
                out.append(f"{name}: {key} {g[key]!r}, recorded {w[key]!r}")
        if w["labels"] is not None and g["labels"] is not None and w["labels"] != g["labels"]:
            out.append(f"{name}: labels {g['labels']}, recorded {w['labels']}")
    return out


def scrape() -> dict[str, str]:
    """The `/metrics` text of every scenario, scraped from running processes after some traffic."""
    from tests.telemetry.active_stack import active_stack
    from tests.telemetry.stack import running_stack, send_traffic, until_step_model

    out: dict[str, str] = {}
    with running_stack(serve=False, time_scale=0.05) as stack:
        send_traffic(list(stack.tap_urls.values()), per_url=4, max_tokens=30)
        rec = stack.taps.svc.reconciler
        assert rec is not None
        stack.taps.wait_for(lambda: all(w.last_ok is not None for w in rec.workers.values()))
        out["tap"] = httpx.get(stack.api + "/metrics", timeout=5).text
    with running_stack(serve=True, time_scale=1.0) as stack:
        until_step_model(stack)
        out["serve"] = httpx.get(stack.api + "/metrics", timeout=5).text
        out["fleet"] = httpx.get(stack.fleet.decode_urls[0] + "/metrics", timeout=5).text
    with tempfile.TemporaryDirectory() as tmp, active_stack(Path(tmp)) as astack:
        send_traffic([astack.front], per_url=12, max_tokens=30)
        out["serve-active"] = httpx.get(astack.api + "/metrics", timeout=5).text
        out["router"] = httpx.get(astack.router_url + "/metrics", timeout=5).text
    return out


if __name__ == "__main__":
    scraped = {scenario: families(text) for scenario, text in scrape().items()}
    json.dump(scraped, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
