"""`shadow replay` / `sweep` / `demo` as a user runs them: output, JSON, plot, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shadow.cli import main

REQUIRED = {
    "avg_spread_tokens",
    "avg_imbalance_tokens",
    "barrier_idle_fraction",
    "throughput_tokens_per_s",
    "tpot_p95_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "decision_ms_p50",
    "decision_ms_p99",
}


def test_replay_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "r.json", tmp_path / "loads.png"
    rc = main(
        [
            "replay",
            "paper-azure",
            "--limit",
            "400",
            "--load",
            "1.1",
            "--policies",
            "jsq,jsq-bytes,br0,brh:oracle",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "SYNTHETIC" in text and "br0" in text and "offline bound" in text
    data = json.loads(out.read_text())
    assert set(data) >= {"workload", "config", "results"}
    assert data["workload"]["synthetic"] is True
    assert data["workload"]["rho"] == pytest.approx(1.1, rel=0.02)
    assert list(data["results"]) == ["jsq", "jsq-bytes", "br0", "brh-oracle"]
    for figures in data["results"].values():
        assert set(figures) >= REQUIRED
        assert figures["finished"] == 400
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("arrival_s,prompt_tokens\n0,5\n", "output_tokens"),
        ("arrival_s,prompt_tokens,output_tokens\n0,5,3\n1,-5,3\n", ":3"),
        ("arrival_s,prompt_tokens,output_tokens\n0,5,3\n1,abc,3\n", ":3"),
        ("arrival_s,prompt_tokens,output_tokens\n5,5,3\n1,5,3\n", ":3"),
        ("", "empty"),
    ],
)
def test_bad_trace_gives_one_line_error_naming_file_and_line(
    tmp_path: Path, content: str, message: str
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text(content)
    proc = subprocess.run(
        [sys.executable, "-m", "shadow", "replay", str(bad), "--policies", "jsq"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr
    assert len(err.splitlines()) == 1, err
    assert "bad.csv" in err and message in err


def test_unknown_policy_and_missing_file_are_clear(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "paper-azure", "--policies", "jsq,telepathy"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["replay", "/nonexistent/trace.csv"]) == 2
    assert "trace.csv" in capsys.readouterr().err
    assert main(["replay", "paper-azure", "--beta", "0.5", "--limit", "10"]) == 2
    assert "beta must be greater than alpha" in capsys.readouterr().err


def test_sweep_reports_each_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    rc = main(
        [
            "sweep",
            "paper-azure",
            "--whole-run",
            "--limit",
            "300",
            "--workers",
            "4,8",
            "--loads",
            "0.8,1.1",
            "--policies",
            "jsq,br0",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())
    assert {(r["workers"], r["load"]) for r in rows} == {(4, 0.8), (4, 1.1), (8, 0.8), (8, 1.1)}
    assert all(r["lane"] == "br0" and r["best_baseline"] == "jsq" for r in rows)


def test_help_teaches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = capsys.readouterr().out
    assert "--load" in text and "examples:" in text and "offline upper bound" in text
