"""`shadow serve` beside a real router on a real (simulated) fleet, end to end on loopback.

A P/D fleet (2 prefill, 4 decode ranks × 16 slots) → `shadow serve` taps in front of every worker →
a real vllm-router (PyPI) in P/D mode → 220 requests of the paper-like trace (outputs / 4, so that
a request lives ≈ 13 s) sent with the official openai client at ρ = 1.1. Checked against the
fleet's own ground truth (twin fidelity, SSE-measured step times, the fitted step model) and
against `shadow replay` of the session's recording.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from shadow.fleet import FleetConfig, FleetThread
from shadow.live import ServeConfig
from shadow.live.thread import ServeThread
from shadow.loadgen import LoadOptions, run_load
from shadow.mirror.service import TapConfig
from shadow.replay.experiment import ReplaySetup, run_replay
from shadow.traces import at_load, estimate_capacity_rps, load_trace, resolve

G, B = 4, 16
# Step model of the fleet: KV load dominates (T from 10 ms idle to ≈ 55 ms at 75 k tokens), so that
# the fit has a slope to find.
A, B_S = 6.0e-7, 0.010
POLICIES = ("jsq-bytes", "br0", "brh:survival")


def _router_exe() -> str:
    here = Path(sys.executable).parent / "vllm-router"
    exe = str(here) if here.exists() else shutil.which("vllm-router")
    if exe is None:
        pytest.fail("vllm-router is not installed (scripts/test.sh installs it with the test extras)")
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fleet_steps(url: str) -> tuple[float, float]:
    """(sum, count) of the fleet's ground-truth step durations (shadow_fleet_* on /metrics)."""
    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("shadow_fleet_step_duration_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("shadow_fleet_step_duration_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total, count


@pytest.mark.integration
@pytest.mark.timeout(280)
def test_live_lanes_beside_vllm_router_match_the_fleet_and_the_replay(tmp_path: Path) -> None:
    fleet_cfg = FleetConfig(prefill=2, decode=G, slots=B, base_port=0, a=A, b=B_S)
    base = resolve("paper-azure", seed=0, limit=220)
    trace = replace(
        base, requests=tuple(replace(r, output_tokens=max(2, r.output_tokens // 4)) for r in base.requests)
    )
    cap = estimate_capacity_rps(trace, workers=G, slots=B, step_a=A, step_b=B_S)
    trace = at_load(trace, 1.1, cap)
    record = tmp_path / "session.ndjson"
    with FleetThread(fleet_cfg) as fleet:
        decode = {f"d{g}": u for g, u in enumerate(fleet.decode_urls)}
        prefill = {f"p{i}": u for i, u in enumerate(fleet.prefill_urls)}
        tap = TapConfig(decode, prefill=prefill, slots=B, record=str(record), scrape_interval_s=0)
        config = ServeConfig(tap=tap, policies=POLICIES, step_a=A, step_b=B_S, lag_s=2.0)
        with ServeThread(config) as serve:
            taps, api = serve.ready["taps"], serve.ready["api"]
            port, mport = _free_port(), _free_port()
            args = [_router_exe(), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
            for p in prefill:
                args += ["--prefill", taps[p]]
            for d in decode:
                args += ["--decode", taps[d]]
            args += [
                "--policy",
                "round_robin",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(mport),
            ]
            args += ["--worker-startup-check-interval", "1"]
            with (tmp_path / "router.log").open("wb") as log:
                router = subprocess.Popen(
                    args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
                try:
                    url = f"http://127.0.0.1:{port}"
                    deadline = time.monotonic() + 60
                    while True:
                        assert router.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
                        try:
                            if httpx.get(url + "/health", timeout=1).status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        assert time.monotonic() < deadline, "vllm-router not healthy"
                        time.sleep(0.1)
                    steps0 = _fleet_steps(decode["d0"])
                    load = asyncio.run(run_load(trace, url, LoadOptions(concurrency=None)))
                    steps1 = _fleet_steps(decode["d0"])
                finally:
                    router.terminate()
                    router.wait(10)
            assert load.summary.ok == len(trace)
            report = httpx.get(api + "/v1/report", params={"drain": 1}, timeout=120).json()
            metrics = httpx.get(api + "/metrics", timeout=10).text

    lanes = report["lanes"]
    assert report["workers"] == list(decode) and report["slots"] == B
    assert report["events"]["dropped"]["queue_full"] == 0
    assert all(lane["requests_finished"] == len(trace) for lane in lanes.values()), {
        k: v["requests_finished"] for k, v in lanes.items()
    }
    # Twin fidelity: the actual lane's per-worker loads follow the mirrored ones.
    fid = report["fidelity"]
    assert fid["samples"] > 20 and fid["load_rel_error"] < 0.02, fid
    # Step times from SSE gaps alone against the fleet's own step durations over the same run (the
    # fleet's durations include its event loop's lateness; the gaps between tokens do not).
    truth = (steps1[0] - steps0[0]) / (steps1[1] - steps0[1])
    sm = report["step_model"]
    assert sm["samples_by_source"]["events"] == 0 and sm["samples_by_source"]["sse"] > 20
    assert sm["measured_step_mean_s"]["sse"] == pytest.approx(truth, rel=0.05), (sm, truth)
    # The fit recovers the fleet's step model.
    assert sm["r2"] > 0.9 and sm["quality"] == "good", sm
    assert sm["a_s_per_token"] == pytest.approx(A, rel=0.10), sm
    assert sm["b_s"] == pytest.approx(B_S, rel=0.10), sm
    assert "shadow_fidelity_load_relative_error " in metrics
    # Consistency: the recording replayed offline gives the lanes' average spread within 1%.
    replay = run_replay(
        load_trace(record),
        ReplaySetup(workers=G, slots=B, policies=POLICIES, step=fleet_cfg.step_model),
    )
    for label, lane in lanes.items():
        offline = replay.results[label]
        assert offline.finished == lane["requests_finished"], label
        assert lane["avg_spread_tokens"] == pytest.approx(offline.avg_spread_tokens, rel=0.01), label
