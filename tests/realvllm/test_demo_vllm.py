"""`shadow demo --fleet vllm`: the live loop on two real vLLM servers, end to end (its own servers:
the demo starts and stops them itself)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shadow.app.vllmshape import MOE_RANKS, SPARE_CORES, machine


@pytest.mark.timeout(1500)
def test_demo_on_real_engines_names_them_and_its_mirror_and_step_model_hold(engine_venv: Path,
                                                                             tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    argv = [sys.executable, "-m", "shadow", "demo", "--fleet", "vllm", "--vllm-venv", str(engine_venv),
            "--vllm-fleet", "independent", "--headless", "--duration", "25", "--report-json", str(report),
            "--record", str(tmp_path / "r.ndjson.gz")]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as demo:
        try:
            out, err = demo.communicate(timeout=1400)
        finally:
            if demo.poll() is None:  # interrupted or timed out: SIGTERM stops its servers, then it exits
                demo.send_signal(signal.SIGTERM)
                demo.communicate(timeout=120)
    assert demo.returncode == 0, out[-3000:] + err[-3000:]
    # the lanes stepped on the measured clock, which the recording does not carry: the demo says its
    # replay will not reproduce them (it said "as the lanes ran")
    said = " ".join(err.split())
    assert "not on the clock the live lanes measured" in said and "as the lanes ran" not in said, said[-2000:]
    doc = json.loads(report.read_text())
    demo = doc["demo"]
    assert demo["fleet"]["engine"].startswith("vllm 0.32.0"), demo["fleet"]
    assert demo["fleet"]["model"]["name"] and demo["fleet"]["workers"] == 2
    assert demo["requests"] > 0 and demo["requests_failed"] == 0, demo
    assert demo["decisions"]["agree"] and demo["decisions"]["phantoms"] == 0, demo["decisions"]
    assert demo["drift_at_end"]["zero"], demo["drift_at_end"]
    sm = doc["step_model"]
    assert sm["samples_from"].startswith("the engine probe"), sm
    # two independent servers: a step model per worker from the probe, the lanes on that clock
    clock = sm["clock"]
    assert sm["model_in_use"] == "per worker" and clock["groups"] == [["d0"], ["d1"]], clock
    assert sm["model_source"] == "probe" and sm["figures_use"] == "measured", sm
    for name, w in clock["workers"].items():
        assert w["source"] == "probe" and w["model"] in ("cost fit", "mean step", "linear fit"), (name, w)
        assert w["steps"] > 0 and w["mean_step_s"] > 0, (name, w)
        assert clock["lane_models"][name]["b_s"] > 0
    assert "lane clock: per worker from probe" in out
    # the step cost per worker from the probe's counts: a form once enough windows are in, each
    # term with its interval, fitted on the engine's work (the probe reads the engine's wait for a
    # CPU on this host); the lanes step on it × the host factor measured over the last windows
    cost = sm["cost"]["groups"]
    assert set(cost) == {"d0", "d1"}, cost
    for name, g in cost.items():
        assert g["windows"] > 0 and g["window_steps"] == 25, (name, g)
        if g["form"] is not None:
            assert "b" in g["terms"] and g["oos_error"] is not None and g["r2"] is not None, (name, g)
            assert all(t["low"] <= t["value"] <= t["high"] for t in g["terms"].values()), (name, g)
            assert g["basis"] == "engine", (name, g["basis_reason"])
            assert g["host_wait_share"] is not None and 0 <= g["host_wait_share"] < 1, (name, g)
            h = g["host_factor"]
            assert 1 <= h["low"] <= h["median"] <= h["high"] and h["recent"] >= 1, (name, h)
            cf = clock["workers"][name]["clock_factor"]  # None: the clock was set before the first form
            assert cf is None or cf > 0, (name, clock["workers"][name])
            assert g["clock_factor"] > 0, (name, g)
            assert g["period_error"] is not None and g["period_windows"] > 0, (name, g)
    assert "step cost: d0 " in out
    print(json.dumps({"clock": clock, "linear_model_holds": sm["linear_model_holds"],
                      "warnings": doc.get("warnings")}))
    assert sm["r2"] is None or 0 <= sm["r2"] <= 1
    assert "R²=" in out and "from the engine probe" in out
    assert sm["sse_check"]["trusted"] is not None and sm["sse_check"]["reason"], sm["sse_check"]
    assert doc["output_counts"]["by_source"].get("chunks", 0) == 0  # shadow load asks for usage
    assert "the mirror recovered every decode decision" in out


@pytest.mark.timeout(900)
def test_demo_says_which_vllm_fleet_it_starts_and_why(engine_venv: Path) -> None:
    """`--vllm-fleet auto` (the default): before any server starts, one line names the fleet and
    the rule's reason; on a machine with fewer usable cores than the pair needs, the fallback to
    independent servers with the cores as the reason (load average aside: it moves). The demo is
    stopped (SIGTERM) once the fleet is starting: the choice is what this test is about."""
    argv = [sys.executable, "-m", "shadow", "demo", "--fleet", "vllm", "--vllm-venv", str(engine_venv),
            "--headless", "--duration", "5"]
    seen: list[str] = []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as demo:
        try:
            assert demo.stderr is not None
            for line in demo.stderr:  # until the fleet starts (the line after the choice), or it exits
                seen.append(line)
                if "fleet: starting" in line:
                    break
        finally:
            demo.send_signal(signal.SIGTERM)  # stops whatever it started, then exits
            _, err = demo.communicate(timeout=300)
    said = " ".join(" ".join(seen).split())
    assert "fleet: starting" in said, said[-3000:] + err[-3000:]
    assert demo.returncode == 128 + signal.SIGTERM, (demo.returncode, err[-3000:])
    cores, _ = machine()
    if cores < MOE_RANKS + SPARE_CORES:
        assert (f"fleet: independent servers, not the MoE DP pair: {cores} usable cores, the pair needs "
                f"{MOE_RANKS + SPARE_CORES}") in said, said
        assert "(--vllm-fleet moe-dp forces it)" in said and "starting 2 real vLLM servers" in said, said
    else:  # the load average decides: either line, with its reason
        assert ("fleet: the MoE DP pair" in said and "rule: cores >=" in said) or \
            ("fleet: independent servers, not the MoE DP pair: load average" in said), said


@pytest.mark.timeout(1500)
def test_demo_on_the_moe_dp_pair_runs_it_and_ends_with_a_verdict_or_the_failed_check(
        engine_venv: Path, tmp_path: Path) -> None:
    """`--vllm-fleet moe-dp` (forced: this machine may not have the cores the rule asks for): the
    two DP ranks of one MoE server are the decode workers, the mirror recovers the router's
    decisions on them, and the last line is a verdict with its interval or names the check that
    failed (which it is depends on the host's load)."""
    report = tmp_path / "r.json"
    argv = [sys.executable, "-m", "shadow", "demo", "--fleet", "vllm", "--vllm-venv", str(engine_venv),
            "--vllm-fleet", "moe-dp", "--headless", "--duration", "20", "--report-json", str(report)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as demo:
        try:
            out, err = demo.communicate(timeout=1400)
        finally:
            if demo.poll() is None:
                demo.send_signal(signal.SIGTERM)
                demo.communicate(timeout=120)
    assert demo.returncode == 0, out[-3000:] + err[-3000:]
    said = " ".join(err.split())
    assert ("fleet: the MoE DP pair (2 ranks of the moe model in lockstep, one API server each): "
            "forced by --vllm-fleet moe-dp") in said, said[-3000:]
    doc = json.loads(report.read_text())
    fleet = doc["demo"]["fleet"]
    assert fleet["shape"] == "moe-dp" and fleet["model"]["path"].rsplit("/", 1)[-1].startswith("moe-"), fleet
    assert doc["demo"]["requests"] > 0 and doc["demo"]["requests_failed"] == 0, doc["demo"]
    assert doc["demo"]["decisions"]["agree"], doc["demo"]["decisions"]
    assert set(doc["step_model"]["cost"]["groups"]) <= {"d0+d1", "d0", "d1"}, doc["step_model"]["cost"]
    last = out.strip().splitlines()[-1]
    cmp = doc["comparison"]
    if cmp["trustworthy"]:
        assert last.startswith(("BR-0 would have", "BR-0's average spread", "too few windows")), last
    else:
        assert last.startswith("figures not trustworthy — ") and cmp["problems"][0][:40] in last, last
