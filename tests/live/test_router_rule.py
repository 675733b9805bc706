"""Which rule the real router is (the live report's `router_rule`): with `shadow router` in its
JSQ-bytes mode as the real router (the demo's loop: simulated fleet, taps, `shadow serve`), the lane
whose choices agree most with its placements is `jsq-bytes`, among the incumbents' rules and the
other baselines: strictly above every rule on another signal; SGLang's total_tokens may tie it (see
below).

The router scores request-body bytes; the taps put each request's body size in its Arrive event
(`body_bytes`) and the `jsq-bytes` lane scores the same bytes, held until the stream ends (the
decode leg's body less the KV handle the router adds to it). Every rule is asked on the router's own
view at the placement (`shadow.engine.routerview`: requests sent and not seen ending at the taps,
their bytes, the mirror's running requests), not on the lanes' modelled fleet. What is left between
them is the hop between the taps and the router: the router releases a request when it relays the
stream's end, after the tap saw it, and places a request before the tap sees it. SGLang's
total_tokens (prompt plus generated tokens) orders the workers otherwise wherever bytes and tokens
disagree; in the demo's prompts they mostly agree, so over a 12 s run (164 placements) it comes
close, and by chance ahead (measured on 1556045 and after, 6 runs: sglang-tokens 0.94-0.98 against
jsq-bytes 0.98-1.0, tied once; CI runs: both 1.0, and 162 against 160 of 164 once): the report ties
the lanes whose misses are not more frequent than the closest lane's beyond chance
(`shadow.live.routerrule`), so `jsq-bytes` is always among the tied, and only `sglang-tokens` may
be beside it. Rules on other signals (request counts, rotation, BalanceRoute) agree less, and
significantly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from shadow.app.demo import DemoOptions, run_demo

pytestmark = pytest.mark.integration

#: The agreement `jsq-bytes` must reach. Not 100 %: the router's ledger moves at the router, the
#: view the lanes rebuild at the taps, one hop away (runs measured 99-100 % at load average 2-4,
#: 75-79 % beside 4 CPU burners, load average 4-5: a starved router relays ends late; on 3886018
#: beside 4 burners, load average 4.3, two runs: 97 %, with trtllm-adp, the closest rule on another
#: signal, at 79-80 %, apart at one-sided Fisher p 1.5e-7 and 1.1e-6).
AGREEMENT_MIN = 0.6
#: the only lanes the placements may not tell apart (tokens order the workers as bytes do on the
#: demo's prompts)
TIE = ["jsq-bytes", "sglang-tokens"]
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
    print("router_rule:", json.dumps(rule, sort_keys=True))
    assert rule["closest_lane"] in TIE and "jsq-bytes" in rule["tied"] and set(rule["tied"]) <= set(TIE), rule
    closest = lanes[rule["closest_lane"]]
    assert rule["agreement_rate"] == closest["agreement_rate"] == max(rule["by_lane"].values())
    assert lanes["jsq-bytes"]["agreement_rate"] >= AGREEMENT_MIN, rule
    for other, rate in rule["by_lane"].items():
        if other not in TIE:
            assert rate < lanes["jsq-bytes"]["agreement_rate"], (other, rule)
