"""What a new user ran into: crashes without a baseline, wording of ratios, help without examples
or defaults, no --version, errors that do not name the port, the rank or the flag."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

import pytest
from rich.console import Console

from shadow.cli import build_parser, main
from shadow.replay.experiment import ReplaySetup, run_replay
from shadow.replay.render import pct, ratio_phrase, render_report
from shadow.traces import resolve


def _shadow(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shadow", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_replay_without_a_baseline_writes_json_and_plot(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    rc = main(["replay", "paper-azure", "--policies", "br0", "--limit", "200", "--json", str(out),
               "--plot", str(png)])
    assert rc == 0
    assert "no baseline lane" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["br0"] and data["comparison"]["best_baseline_spread"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worse_is_called_higher_never_a_fraction_lower(capsys: pytest.CaptureFixture[str]) -> None:
    # Well below saturation BR-0 trails JSQ-bytes on this workload (see README): the line must say so.
    assert main(["replay", "paper-azure", "--limit", "300", "--load", "0.6",
                 "--policies", "jsq-bytes,br0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("br0:"))
    assert "× higher (worse)" in line and "× lower" not in line
    assert ratio_phrase(0.5, "spread") == "spread 2.00× higher (worse)"
    assert ratio_phrase(2.0, "spread") == "spread 2.00× lower"
    assert "–×" not in ratio_phrase(None, "spread")
    assert pct(-0.04) == "±0.0%" and pct(0.04) == "±0.0%" and pct(-1.26) == "-1.3%" and pct(2.0) == "+2.0%"
    assert pct(None) == "–"


def test_actual_lane_has_no_decision_time() -> None:
    base = resolve("paper-azure", seed=0, limit=120)
    trace = replace(base, requests=tuple(replace(r, worker=f"d{i % 2}") for i, r in enumerate(base.requests)))
    report = run_replay(trace, ReplaySetup(slots=16, policies=("jsq", "br0")))
    assert "actual" in report.results
    console = Console(width=200, record=True)
    render_report(report, console)
    lines = console.export_text().splitlines()
    row = next(x for x in lines if x.startswith("│ actual"))
    assert row.rstrip().rstrip("│").rstrip().endswith("–")
    jsq = next(x for x in lines if x.startswith("│ jsq"))
    assert "/" in jsq.split("│")[-2]  # baselines keep their P50/P99 decision time


@pytest.mark.parametrize("command", ["fleet", "tap", "demo", "router", "replay", "sweep", "load"])
def test_help_has_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "examples:" in text and f"shadow {command}" in text.split("examples:", 1)[1]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no sub-commands")


def test_every_default_is_shown() -> None:
    parser = build_parser()
    missing = []
    for name, sub in _subparsers(parser).items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS, []):
                continue
            shown = formatter._get_help_string(action) or ""
            if "default" not in shown.lower():
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing
    # And the rendered text carries the value (a sample):
    # (router's --port is a knob: its help states the field's default, "(default 8000)")
    assert "(default 8000)" in _subparsers(parser)["router"].format_help()


def test_version() -> None:
    proc = _shadow("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"shadow {version('shadow')}"


def test_port_in_use_names_the_port() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = _shadow("fleet", "--prefill", "1", "--decode", "1", "--port", str(port))
    assert proc.returncode == 1
    assert f"127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr
    started, failed = proc.stderr.strip().splitlines()  # the start-up log line, then the error's
    assert "shadow fleet started" in started and " ERROR " in failed and f"127.0.0.1:{port}" in failed


@pytest.mark.parametrize(("fault", "named"), [("decode/2:stall_s=1", "decode/2"),
                                              ("prefill/1:slow=2", "prefill/1")])
def test_fault_on_a_missing_rank_is_an_error(fault: str, named: str) -> None:
    proc = _shadow("fleet", "--prefill", "1", "--decode", "2", "--port", "0", "--fault", fault)
    assert proc.returncode == 2
    assert named in proc.stderr and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", ["0", "-5", "x"])
def test_demo_requests_must_be_positive(value: str) -> None:
    proc = _shadow("demo", "--requests", value)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("shadow demo: error: argument --requests:"), last
    assert "Traceback" not in proc.stderr


def test_demo_duration_must_be_positive() -> None:
    proc = _shadow("demo", "--duration", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("shadow demo: error: argument --duration:")


def test_offline_table_stays_one_flag_away(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--offline", "--requests", "300"]) == 0
    out = capsys.readouterr().out
    assert "300 requests" in out and "SYNTHETIC" in out
    assert any(line.startswith("br0: spread ") for line in out.splitlines())
