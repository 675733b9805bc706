"""`shadow demo` as a machine runs it: a real subprocess, headless, with a report and a recording;
the lanes advanced, the report has the promised structure, and the recording replays to the same
figures."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shadow.base.tools import find_executable
from tests.reportschema import check_report

pytestmark = pytest.mark.integration

LANES = {"actual", "jsq-bytes", "br0", "brh-survival"}
LANE_KEYS = {"avg_spread_tokens", "avg_imbalance_tokens", "barrier_idle_fraction", "throughput_tokens_per_s",
             "steps", "requests_finished"}


def _demo(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str], Path]:
    report, record = tmp_path / "report.json", tmp_path / "session.ndjson"
    proc = subprocess.run(
        [sys.executable, "-m", "shadow", "demo", "--headless", "--duration", "8",
         "--report-json", str(report), "--record", str(record), *extra],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(report.read_text()), proc, record


def _check_structure(doc: dict[str, Any], router: str, rolling: bool = False) -> None:
    check_report(doc)  # the report's sections as the published schema says; the demo's block beside
    assert set(doc["lanes"]) == LANES
    for label, lane in doc["lanes"].items():
        assert set(lane) >= LANE_KEYS, label
        assert lane["steps"] > 0 and lane["requests_finished"] > 0, label
    assert set(doc["step_model"]) >= {"a_s_per_token", "b_s", "r2", "samples"}
    assert "load_rel_error" in doc["fidelity"]
    assert doc["slots"] == 16 and len(doc["workers"]) == 4
    demo = doc["demo"]
    assert demo["fleet"] == {"engine": "shadow fleet (simulated)", "step_a_s_per_token": 4e-7,
                             "step_b_s": 0.02, "workers": 4, "slots": 16, "prefill_servers": 2,
                             "time_scale": 1.0}
    assert router in demo["router"]
    assert demo["requests"] > 0 and demo["requests_ok"] == demo["requests"]
    # The router's own per-worker decode counter = what the mirror saw finish, worker by worker.
    dec = demo["decisions"]
    assert dec["agree"] and dec["phantoms"] == 0, dec
    assert sum(dec["router"].values()) == demo["requests_ok"]
    # The mirror's count of running requests came back to the workers' own (their /metrics).
    assert demo["drift_at_end"]["zero"] and set(demo["drift_at_end"]["per_worker"]) == set(doc["workers"])
    # Every request that was sent finished in the router's real lane (rolling: or was taken out by a
    # re-seed after the real fleet had ended it).
    actual = doc["lanes"]["actual"]
    assert actual["requests_finished"] + (actual["requests_dropped"] if rolling else 0) == demo["requests_ok"]


@pytest.mark.timeout(300)
def test_headless_demo_report_and_recording(tmp_path: Path) -> None:
    doc, proc, _ = _demo(tmp_path)
    _check_structure(doc, "shadow router")
    assert "live lanes" in proc.stdout and "BR-0" in proc.stdout
    assert "/metrics" in proc.stdout and "/v1/report" in proc.stdout
    # The replay command the demo prints, run as printed (its JSON written beside): every lane's
    # spread as in the final live report.
    printed = re.search(r"`(shadow replay [^`]+)`", proc.stderr)
    assert printed is not None, proc.stderr[-2000:]
    out = tmp_path / "replay.json"
    argv = shlex.split(printed.group(1))
    replay = subprocess.run([sys.executable, "-m", *argv, "--json", str(out)], capture_output=True,
                            text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr[-2000:]
    assert "what-if" not in replay.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == LANES
    for label in LANES:
        live = doc["lanes"][label]["avg_spread_tokens"]
        assert results[label]["avg_spread_tokens"] == pytest.approx(live, rel=0.01), label


@pytest.mark.timeout(300)
@pytest.mark.skipif(find_executable("vllm-router") is None,
                    reason="vllm-router is not installed (it comes with the test extras)")
def test_headless_demo_behind_the_real_vllm_router(tmp_path: Path) -> None:
    doc, _, _ = _demo(tmp_path, "--router", "vllm-router")
    _check_structure(doc, "vllm-router")


# A terminal's foreground job gets SIGINT with its default action; a job started in the background
# by a non-interactive shell (as CI runners do) inherits SIGINT *ignored*, and Python then installs
# no KeyboardInterrupt handler. Start the demo as a terminal would, whatever the suite inherited.
_AS_FOREGROUND = ("import signal, sys, runpy; signal.signal(signal.SIGINT, signal.default_int_handler); "
                  "sys.argv = ['shadow', *sys.argv[1:]]; runpy.run_module('shadow', run_name='__main__')")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_everything(tmp_path: Path, signum: signal.Signals) -> None:
    import re
    import select
    import time

    import httpx

    proc = subprocess.Popen([sys.executable, "-c", _AS_FOREGROUND, "demo", "--duration", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + 120
    while "router:" not in seen and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stderr], [], [], 1.0)[0]:
            seen += proc.stderr.readline()
    assert "router:" in seen, seen
    api = re.search(r"API (http://\S+)", seen)
    router = re.search(r"at (http://\S+), pointed", seen)
    assert api and router
    assert httpx.get(api.group(1) + "/metrics", timeout=5).status_code == 200
    proc.send_signal(signum)
    _, rest = proc.communicate(timeout=60)  # communicate: a full pipe must not block the demo's exit
    assert proc.returncode == 128 + signum, rest
    assert f"interrupted ({signum.name})" in rest and "Traceback" not in rest, rest
    for url in (api.group(1) + "/metrics", router.group(1) + "/health"):
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=5)


@pytest.mark.timeout(300)
def test_headless_demo_with_rolling_lanes(tmp_path: Path) -> None:
    """`shadow demo --rolling`: the lanes re-seeded every window, the report's per-window figures,
    and the printed replay command giving every complete uncut window the live figures."""
    doc, proc, _ = _demo(tmp_path, "--rolling")
    _check_structure(doc, "shadow router", rolling=True)
    rolling = doc["rolling"]
    assert rolling["window_s"] == doc["comparison"]["window_s"] and rolling["reseeds"] > 0
    assert "last " in proc.stdout  # the table's last-window column
    printed = re.search(r"`(shadow replay [^`]+)`", proc.stderr)
    assert printed is not None, proc.stderr[-2000:]
    out = tmp_path / "replay.json"
    replay = subprocess.run([sys.executable, "-m", *shlex.split(printed.group(1)), "--json", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr[-2000:]
    assert "what-if" not in replay.stderr and "rolling lanes" in replay.stderr
    lanes = json.loads(out.read_text())["lanes"]
    assert set(lanes) == LANES
    compared = 0
    for label in LANES:
        replayed = {w["index"]: w for w in lanes[label]["windows"]}
        for w in doc["windows"]["lanes"][label]:
            if w["cut"] or w["index"] not in replayed:
                continue
            r = replayed[w["index"]]
            # spread and I(k) do not depend on the step model (the live one may be the fitted model)
            assert (r["steps"], r["avg_spread_tokens"], r["avg_imbalance_tokens"]) == (
                w["steps"], w["avg_spread_tokens"], w["avg_imbalance_tokens"]), (label, w["index"])
            compared += 1
        live = doc["lanes"][label]
        if live["windows_cut"] == 0:
            spread = lanes[label]["avg_spread_tokens"]
            assert spread == pytest.approx(live["avg_spread_tokens"], rel=0.01), label
    assert compared >= len(LANES) * 3
