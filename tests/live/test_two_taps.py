"""Two real `shadow tap` processes attached to by one `shadow serve` see what one tap service sees.

Topology, all real processes or real HTTP on loopback: `shadow load` (openai client) → `shadow
router` (the vllm-ascend JSQ stand-in, plain mode) → two `shadow tap` processes (A in front of d0,
d1; B in front of d2, d3), both attached to by serve S2 (`attach`: the data plane split, each tap
group its own process as on its own node) → serve S1's own taps in front of all four workers → a
`shadow fleet` of four decode ranks. S1 and S2 therefore observe the same streams, S1 through one
tap service and S2 only through the two tap processes it pulls from. Both run with a lag longer
than the session, so their lanes advance only at the final drain, over complete event sets. What
must be equal is what the lanes are fed: every request, its worker, its prompt and output tokens
and how it ended, read from both sessions' recordings; arrival stamps differ by the relay hop
between the two observation points (the outer tap's comes first; both are the machine's monotonic
clock). Each serve's lanes are then exactly the offline replay of its own recording, and S1's
requests with S2's stamps replay to exactly S2's lanes: the stamps are the only difference. The
lanes of the two sessions are not compared with each other: the hop is the machine's (p90 9-52 ms,
max 125 ms at load average 14-18 on two cores), and the lanes follow the stamps (`actual`'s
imbalance moved by 1.9% with that 125 ms hop; the counterfactual lanes are chaotic in them: a
sub-millisecond shift moves an arrival across a step boundary and changes which pool a round sees).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.app.serve import ServeConfig
from shadow.core.stepmodel import StepTimeModel
from shadow.live.lanes import DEFAULT_POLICIES
from shadow.mirror.config import MirrorConfig
from shadow.replay.experiment import ReplaySetup, run_replay
from shadow.traces import load_trace
from tests.harness import ServeThread
from tests.live.test_live_fleet import _start, _stop, saturated_workload, start_fleet

G, B = 4, 16
A, B_S = 4.0e-7, 0.010
N = 120
POLICIES = DEFAULT_POLICIES  # what both serves run (ServeConfig's default)


def _finished(api: str) -> int:
    state = httpx.get(api + "/v1/state", timeout=5).json()
    return sum(int(w.get("finished", 0)) for w in state["workers"].values())


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_two_tap_processes_attached_to_give_the_lanes_of_one_tap(tmp_path: Path) -> None:
    workload = tmp_path / "trace.jsonl"
    saturated_workload(workload, limit=N, seed=3, divide=10, step_a=A, step_b=B_S)
    names = [f"d{g}" for g in range(G)]
    procs = []
    fleet, urls = start_fleet(tmp_path, prefill=0, step_a=A, step_b=B_S)
    procs.append(fleet)
    try:
        lag = 3600.0
        one = ServeConfig(
            tap=MirrorConfig(
                dict(zip(names, urls["decode"], strict=True)),
                slots=B,
                scrape_interval_s=0,
                record=str(tmp_path / "one.ndjson"),
            ),
            step_a=A,
            step_b=B_S,
            lag_s=lag,
            lane_clock="configured",  # the same lanes from both: on the configured model
        )
        with ServeThread(one) as s1:
            inner, api1 = s1.ready["taps"], s1.ready["api"]
            outer: dict[str, str] = {}
            dirs = []
            for i, pair in enumerate((names[:2], names[2:])):
                args = ["tap", "--name", f"tap{i}"]
                for n in pair:
                    args += ["--upstream", f"{n}={inner[n]}"]
                tap, ready = _start(args, tmp_path / f"tap{i}.log")
                procs.append(tap)
                outer.update(ready["taps"])
                dirs.append(ready["dir"])
            two = ServeConfig(  # S2 has no taps of its own: it attaches to the two tap processes
                tap=MirrorConfig(
                    upstreams={n: inner[n] for n in names},
                    slots=B,
                    scrape_interval_s=0,
                    record=str(tmp_path / "two.ndjson"),
                    relay="process",
                    attach=tuple(dirs),
                ),
                step_a=A,
                step_b=B_S,
                lag_s=lag,
                lane_clock="configured",
            )
            with ServeThread(two) as s2:
                api2 = s2.ready["api"]
                router_args = ["router", "--port", "0"]
                for n in names:
                    router_args += ["--decode", f"{n}={outer[n]}"]
                router, rready = _start(router_args, tmp_path / "router.log")
                procs.append(router)
                out = tmp_path / "load.json"
                res = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "shadow",
                        "load",
                        str(workload),
                        "--target",
                        rready["url"],
                        "--quiet",
                        "--json",
                        str(out),
                    ],
                    capture_output=True,
                    timeout=180,
                )
                assert res.returncode == 0, res.stderr[-2000:]
                summary = json.loads(out.read_text())
                assert summary["requests"]["ok"] == N, summary["requests"]
                _wait(lambda: _finished(api1) == N, 30, "serve S1 to see every finish")
                _wait(lambda: _finished(api2) == N, 30, "serve S2 to mirror every finish from the tap "
                                                        "processes")
                r1 = httpx.get(api1 + "/v1/report", params={"drain": 1}, timeout=120).json()
                r2 = httpx.get(api2 + "/v1/report", params={"drain": 1}, timeout=120).json()
    finally:
        for p in reversed(procs):
            _stop(p)

    assert r1["workers"] == r2["workers"] == names and r1["slots"] == r2["slots"] == B
    assert set(r1["lanes"]) == set(r2["lanes"]) and "actual" in r1["lanes"]
    seen = [_requests(tmp_path / "one.ndjson"), _requests(tmp_path / "two.ndjson")]
    assert len(seen[0]) == N and seen[0].keys() == seen[1].keys()
    for rid, (t1, fields) in seen[0].items():
        t2, fields2 = seen[1][rid]
        assert fields2 == fields, (rid, fields, fields2)
        assert t2 <= t1, (rid, t1, t2)  # the outer tap sees the request before it is relayed inward
    for label in r1["lanes"]:
        assert r1["lanes"][label]["requests_finished"] == r2["lanes"][label]["requests_finished"] == N, label
    # The lanes are a function of what they are fed: each serve's lanes are the offline replay of its
    # own recording, and S1's requests with S2's arrival stamps replay to S2's lanes — so the only
    # difference between the two sessions' lanes is the stamps' relay hop (its length is the
    # machine's: a loaded host delays the inner tap by tens of ms, several decode steps).
    stamps2 = {rid: t for rid, (t, _) in seen[1].items()}
    restamped = tmp_path / "one-with-two-stamps.ndjson"
    lines = []
    for line in (tmp_path / "one.ndjson").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "request":
            rec["arrival_t"] = stamps2[rec["request_id"]]
        lines.append(json.dumps(rec))
    restamped.write_text("\n".join(lines) + "\n")
    for report, recording in ((r1, tmp_path / "one.ndjson"), (r2, tmp_path / "two.ndjson"), (r2, restamped)):
        offline = run_replay(
            load_trace(recording),
            ReplaySetup(workers=G, slots=B, policies=POLICIES, step=StepTimeModel(A, B_S)),
        ).results
        assert set(offline) == set(report["lanes"]), recording
        for label, lane in report["lanes"].items():
            off = offline[label]
            keys = ("requests_finished", "steps", "avg_spread_tokens", "avg_imbalance_tokens")
            got = [lane[k] for k in keys]
            want = [off.finished, off.steps, off.avg_spread_tokens, off.avg_imbalance_tokens]
            assert got == want, (recording.name, label, got, want)


def _requests(path: Path) -> dict[str, tuple[float, tuple[Any, ...]]]:
    """request_id -> (arrival stamp, (worker, prompt, output, end)) from a compact recording."""
    out: dict[str, tuple[float, tuple[Any, ...]]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "request":
            key = (rec["worker"], rec["prompt_tokens"], rec["output_tokens"], rec["end"])
            out[rec["request_id"]] = (rec["arrival_t"], key)
    return out
