"""The demo's last line carries BR-0's interval and verdict, and never a ratio its own checks
contradict: an untrustworthy report (a poor fit, a twin out of bounds, a host that could not keep
up) says so and why; the table and the last line print one estimate."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from rich.console import Console

from shadow.app.demo import Demo, DemoOptions, headline, lanes_table, spread_ratio, with_host
from shadow.live.lanes import LiveLanes
from shadow.loadgen import LoadReport
from tests.reportschema import check_report


def _report(trustworthy: bool, low: float | None, ratio: float, high: float | None,
            verdict: str) -> dict[str, Any]:
    """A whole report (a fresh lanes' one, as the demo reads it through its types) with BR-0's
    spread against actual as given."""
    report: dict[str, Any] = dict(LiveLanes(workers=["d0", "d1"], slots=4, policies=["br0"]).report())
    iv = {"ratio": ratio, "low": low, "high": high, "windows": 7, "skipped": 0, "verdict": verdict,
          "interval_verdict": verdict}
    report["comparison"] = {**report["comparison"], "trustworthy": trustworthy, "window_s": 10.0,
                            "problems": [] if trustworthy else ["twin fidelity 16.6% (needs < 2%)"],
                            "lanes": {"br0": {"spread": iv}}}
    check_report(report)
    return report


def _spreads(report: dict[str, Any], actual: float, br0: float) -> None:
    for label, spread in (("actual", actual), ("br0", br0)):
        report["lanes"][label] = {**report["lanes"][label], "avg_spread_tokens": spread}


def test_a_trusted_better_lane_is_said_with_its_interval() -> None:
    line = headline(_report(True, 1.8, 2.0, 2.2, "better"))
    assert line == ("BR-0 would have kept the average spread 2.00× lower than the router did "
                    "(1.80–2.20×, 95% CI over 7 windows of 10 s)")


def test_no_difference_and_worse_say_so() -> None:
    assert "no significant difference" in headline(_report(True, 0.9, 1.05, 1.2, "no significant difference"))
    assert headline(_report(True, 0.4, 0.5, 0.6, "worse")).startswith(
        "BR-0's average spread is 2.00× higher than the router's here (1.67–2.50×")


def test_an_untrustworthy_report_never_gets_a_bare_ratio() -> None:
    line = headline(_report(False, 1.5, 1.67, 1.8, "not trustworthy"))
    assert line.startswith("figures not trustworthy — twin fidelity 16.6%")
    assert "1.67" not in line and "lower than the router" not in line


def test_a_host_that_fell_behind_makes_the_report_untrustworthy() -> None:
    rep = with_host(_report(True, 1.8, 2.0, 2.2, "better"), {"behind_dropped_s": 18.6, "catch_up_s": 5.0})
    cmp = rep["comparison"]
    assert cmp["trustworthy"] is False
    assert cmp["lanes"]["br0"]["spread"]["verdict"] == "not trustworthy"
    assert "the host could not keep up" in headline(rep) and "18.6 s behind" in headline(rep)
    kept = _report(True, 1.8, 2.0, 2.2, "better")
    assert with_host(kept, {"behind_dropped_s": 0.0, "requests_failed": 0, "requests_sent": 9}) is kept


def test_failed_requests_make_the_report_untrustworthy() -> None:
    rep = with_host(_report(True, 1.8, 2.0, 2.2, "better"),
                    {"behind_dropped_s": 0.0, "requests_failed": 997, "requests_sent": 1015})
    assert rep["comparison"]["trustworthy"] is False
    assert "997 of 1015 requests failed" in headline(rep)


def _table_text(report: dict[str, Any]) -> str:
    console = Console(width=240, record=True)
    console.print(lanes_table(report))
    return console.export_text()


def test_the_table_and_the_last_line_print_the_same_estimate() -> None:
    # The lanes' cumulative spreads (1,000 vs 450: 2.22x by totals) differ from the comparison's
    # estimate over windows (3.65x): both the table and the last line print the comparison's.
    report = _report(True, 1.87, 3.65, 5.43, "better")
    _spreads(report, 1000.0, 450.0)
    line = headline(report)
    row = next(x for x in _table_text(report).splitlines() if x.lstrip().startswith("br0"))
    assert "3.65× lower" in line and "1.87–5.43×" in line
    assert "3.65× lower" in row and "1.87–5.43×" in row
    assert "2.22" not in row
    # worse: "higher", the interval read the same way round in both
    report = _report(True, 0.4, 0.5, 0.6, "worse")
    _spreads(report, 1000.0, 1900.0)
    ratio, ci = spread_ratio(report["comparison"]["lanes"]["br0"]["spread"])
    assert (ratio, ci) == ("2.00× higher", "1.67–2.50×")
    row = next(x for x in _table_text(report).splitlines() if x.lstrip().startswith("br0"))
    assert ratio in row and ci in row and ratio in headline(report) and ci in headline(report)


def test_a_real_fleets_failed_requests_reach_its_last_line(tmp_path: Path) -> None:
    """On the vLLM fleet (no simulated clock to check) the host check is the requests: failed
    ones make the figures untrustworthy and the last line names them, as on the simulated fleet."""
    demo = Demo(DemoOptions(fleet="vllm", workers=2, slots=8, prompt_divisor=24, requests=4), tmp_path)
    assert demo.request_counts() == {"requests_sent": 0, "requests_failed": 0}  # before the load ran
    demo.load = cast(LoadReport, SimpleNamespace(summary=SimpleNamespace(sent=12, failed=3)))
    line = headline(with_host(_report(True, 1.8, 2.0, 2.2, "better"), demo.request_counts()))
    assert line.startswith("figures not trustworthy — 3 of 12 requests failed"), line
