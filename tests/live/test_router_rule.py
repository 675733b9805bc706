"""Which rule the real router is (the live report's `router_rule`): with `shadow router` in its
JSQ-bytes mode as the real router (the demo's loop: simulated fleet, taps, `shadow serve`), the lane
whose choices agree most with its placements is `jsq-bytes`, among the incumbents' rules and the
other baselines.

The router scores request-body bytes / 4, the lanes the mirrored prompt tokens (the events carry no
body size): where the two orders differ they both miss, and SGLang's total_tokens (prompt plus the
few generated tokens, ties alike) then misses on the same placements — it may tie, never lead.
Rules on other signals (request counts, rotation, BalanceRoute) agree less."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from shadow.app.demo import DemoOptions, run_demo

pytestmark = pytest.mark.integration

POLICIES = ("jsq-bytes", "vllm-dp", "vllm-dp-legacy", "sglang-tokens", "sglang-requests", "smg-min-tokens",
            "trtllm-adp", "rr", "br0")


@pytest.mark.timeout(420)
def test_the_report_names_jsq_bytes_behind_the_jsq_bytes_router(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    opts = DemoOptions(headless=True, duration_s=12, policies=POLICIES, report_json=str(report))
    quiet = Console(file=(tmp_path / "out.txt").open("w"), width=160)
    assert run_demo(opts, quiet, quiet) == 0
    doc = json.loads(report.read_text())
    rule = doc["router_rule"]
    lanes = doc["lanes"]
    compared = {label for label, lane in lanes.items() if lane.get("agreement_rate") is not None}
    assert compared == {"jsq-bytes", "vllm-dp", "vllm-dp-legacy", "sglang-tokens", "sglang-requests",
                        "smg-min-tokens", "trtllm-adp", "rr", "br0"}
    assert rule["decisions"] == lanes["jsq-bytes"]["decisions"] == doc["demo"]["requests_ok"]
    assert rule["closest_lane"] == "jsq-bytes" and set(rule["tied"]) <= {"jsq-bytes", "sglang-tokens"}, rule
    assert rule["agreement_rate"] == lanes["jsq-bytes"]["agreement_rate"] == max(rule["by_lane"].values())
    for other in ("rr", "vllm-dp", "vllm-dp-legacy", "sglang-requests", "br0"):
        assert rule["by_lane"][other] < rule["agreement_rate"], (other, rule)
