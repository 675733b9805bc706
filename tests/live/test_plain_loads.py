"""Item 5: in plain (non-P/D) mode the mirrored KV load matches the worker's own figure."""

from __future__ import annotations

import re
import threading

import httpx

from shadow.fleet import FleetConfig
from shadow.mirror.config import MirrorConfig
from tests.harness import FleetThread, TapThread


def _fleet_load(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    m = re.search(r"^shadow_fleet_load_tokens(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert m is not None, text[:500]
    return float(m.group(1))


def test_plain_mode_mirrored_load_matches_the_workers_own_figure() -> None:
    # One plain worker (it prefills locally), streams of 1,000-word prompts that the client asks
    # usage for (so the worker's count arrives only at the end): mid-stream, the mirror must hold
    # the prompts (read from the request bodies), not just the generated tokens.
    cfg = FleetConfig(prefill=0, decode=1, slots=8, base_port=0, a=1e-7, b=0.02)
    with FleetThread(cfg) as fleet:
        worker = fleet.decode_urls[0]
        with TapThread(MirrorConfig({"d0": worker}, slots=8, scrape_interval_s=0)) as tap:
            url = tap.ready["taps"]["d0"]
            started = threading.Barrier(7)
            stop = threading.Event()

            def stream(i: int) -> None:
                body = {
                    "model": "sim-llm",
                    "prompt": " ".join(f"w{i}x{k}" for k in range(1000)),
                    "max_tokens": 4000,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    for n, _ in enumerate(r.iter_lines(), start=1):
                        if n == 20:
                            started.wait(30)
                        if stop.is_set():
                            break

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            started.wait(30)
            assert tap.wait_for(lambda: tap.svc.state.active("d0") == 6, timeout=10)
            mirrored = tap.sync(lambda: tap.svc.state.workers["d0"].kv_tokens)
            fleet_load = _fleet_load(worker)
            stop.set()
            for t in threads:
                t.join(30)
    assert fleet_load > 6000  # six 1,000-token prompts plus what they generated
    # a few steps' worth of tokens apart (the two are read a moment apart), never a missing prompt
    assert abs(mirrored - fleet_load) / fleet_load < 0.02, (mirrored, fleet_load)
