"""The lanes' clock against two independent simulated servers stepping 6x apart (two `shadow
fleet` processes, one decode worker each, plain mode) behind `shadow serve`'s taps: from the SSE
gaps alone the report chooses a step model per worker (no shared barrier), each worker's clock is
its own measured step, and the lanes step on it (not on the configured 20 ms)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from shadow.app.serve import ServeConfig
from shadow.mirror.config import MirrorConfig
from tests.harness import ServeThread
from tests.live.test_live_fleet import _fleet_steps, _start, _stop

SLOTS = 8
STEPS = {"d0": 0.004, "d1": 0.024}  # b of each server's step model (a ≈ 0: steps do not follow load)


def _streams(url: str, stop: threading.Event, done: list[int], i: int) -> None:
    """A closed loop of streams at one tap until `stop`; counts finished requests in done[i]."""
    body = {"model": "sim-llm", "prompt": " ".join(f"w{k}" for k in range(40)), "max_tokens": 60,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():
                    pass
            done[i] += 1


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_two_independent_servers_get_a_measured_clock_each(tmp_path: Path) -> None:
    fleets = {}
    try:
        for name, b in STEPS.items():
            fleets[name] = _start(["fleet", "--prefill", "0", "--decode", "1", "--slots", str(SLOTS),
                                   "--port", "0", "--a", "1e-9", "--b", str(b), "--catch-up", "1"],
                                  tmp_path / f"fleet-{name}.log")
        workers = {name: urls["decode"][0] for name, (_, urls) in fleets.items()}
        tap = MirrorConfig(workers, slots=SLOTS, scrape_interval_s=0)
        with ServeThread(ServeConfig(tap=tap, policies=("jsq-bytes", "br0"), lag_s=1.0)) as serve:
            taps, api = serve.ready["taps"], serve.ready["api"]
            truth0 = {name: _fleet_steps(u) for name, u in workers.items()}
            stop = threading.Event()
            done = [0] * (2 * 4)
            threads = [threading.Thread(target=_streams, args=(taps[name], stop, done, 4 * g + j))
                       for g, name in enumerate(STEPS) for j in range(4)]
            for t in threads:
                t.start()
            # until the slow server has finished 40 requests (about 40 × 60 × 24 ms / 4 ≈ 15 s)
            deadline = time.monotonic() + 150
            while sum(done[4:]) < 40 and time.monotonic() < deadline:
                time.sleep(0.2)
            stop.set()
            for t in threads:
                t.join(60)
            truth1 = {name: _fleet_steps(u) for name, u in workers.items()}
            report = httpx.get(api + "/v1/report", params={"drain": 1}, timeout=120).json()
    finally:
        for proc, _ in fleets.values():
            _stop(proc)
    assert sum(done[4:]) >= 40, done
    truth = {n: (truth1[n][0] - truth0[n][0]) / (truth1[n][1] - truth0[n][1]) for n in STEPS}
    sm = report["step_model"]
    clock = sm["clock"]
    print({"truth_s": truth, "clock": clock, "model_in_use": sm["model_in_use"]})
    assert sm["model_in_use"] == "per worker" and clock["groups"] == [["d0"], ["d1"]], clock
    assert sm["model_source"] == "sse" and sm["figures_use"] == "measured"
    for name in STEPS:
        w = clock["workers"][name]
        assert w["source"] == "sse" and w["model"] in ("mean step", "linear fit"), w
        assert w["mean_step_s"] == pytest.approx(truth[name], rel=0.25), (name, w, truth)
    lane = clock["lane_models"]
    assert lane["d1"]["b_s"] > 3 * lane["d0"]["b_s"], lane  # the slow server's lane steps slower
    assert clock["coincidence"]["d0~d1"] < 0.8
    assert not any("configured model the lanes simulate" in w for w in report["warnings"]), report["warnings"]


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_dp_ranks_of_one_fleet_share_the_fleet_wide_barrier(tmp_path: Path) -> None:
    """Two DP ranks of one simulated fleet step on one barrier: their step ends coincide, and the
    report chooses the fleet-wide model."""
    proc, urls = _start(["fleet", "--prefill", "0", "--decode", "2", "--slots", str(SLOTS), "--port", "0",
                         "--a", "1e-9", "--b", "0.012", "--catch-up", "1"], tmp_path / "fleet.log")
    try:
        workers = {f"d{g}": u for g, u in enumerate(urls["decode"])}
        tap = MirrorConfig(workers, slots=SLOTS, scrape_interval_s=0)
        with ServeThread(ServeConfig(tap=tap, policies=("jsq-bytes",), lag_s=1.0)) as serve:
            taps, api = serve.ready["taps"], serve.ready["api"]
            stop = threading.Event()
            done = [0] * 6
            threads = [threading.Thread(target=_streams, args=(taps[f"d{i % 2}"], stop, done, i))
                       for i in range(6)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 150
            while sum(done) < 40 and time.monotonic() < deadline:
                time.sleep(0.2)
            stop.set()
            for t in threads:
                t.join(60)
            report = httpx.get(api + "/v1/report", params={"drain": 1}, timeout=120).json()
    finally:
        _stop(proc)
    sm = report["step_model"]
    print({"clock": sm["clock"], "model_in_use": sm["model_in_use"]})
    assert sum(done) >= 40, done
    assert sm["model_in_use"] == "fleet-wide barrier" and sm["clock"]["groups"] == [["d0", "d1"]], sm["clock"]
    assert sm["clock"]["coincidence"]["d0~d1"] >= 0.8 and sm["model_source"] == "sse"
