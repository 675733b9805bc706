"""shadow's step probe inside a real vLLM: every step reaches a real `shadow serve` event API (with
its probe token) as a valid `step` event the lanes find plausible, and a probe whose sink never
answers drops (and counts) instead of blocking."""

from __future__ import annotations

import concurrent.futures as cf
import json
import statistics
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from shadow.contracts.events import load_schema
from shadow.realvllm.stepsender import EngineSched
from tests.realvllm.conftest import MODEL_NAME, Tier
from tests.realvllm.helpers import completion_tokens, latest_seq, metric, prompt_tokens, raw_stream, wait_for


def _body(i: int, max_tokens: int) -> dict[str, object]:
    return {"model": MODEL_NAME, "prompt": f"probe request {i} " * (1 + i % 5), "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _steps_after(api: str, seq: int) -> list[dict[str, object]]:
    r = httpx.get(f"{api}/v1/events", params={"after": seq, "limit": 100000}, timeout=10, trust_env=False)
    return [e for e in map(json.loads, r.text.splitlines()) if e["type"] == "step"]


def test_every_engine_step_arrives_as_a_valid_step_event(tier: Tier) -> None:
    seq = latest_seq(tier.api)
    sent_before = metric(tier.probe.decode_urls[0], "shadow_probe_steps_total", outcome="sent")
    n, max_tokens = 8, 24
    with cf.ThreadPoolExecutor(n) as ex:
        results = list(ex.map(lambda i: raw_stream(f"{tier.tap}/v1/completions", _body(i, max_tokens)),
                              range(n)))
    assert [completion_tokens(data) for _, data in results] == [max_tokens] * n
    want = n * max_tokens  # every generated token is in exactly one step's `tokens`

    def tokens_seen() -> int:
        return sum(int(e.get("tokens", 0)) for e in _steps_after(tier.api, seq))  # type: ignore[call-overload]

    wait_for(lambda: tokens_seen() >= want, f"step events carrying {want} generated tokens", timeout=60)
    steps = _steps_after(tier.api, seq)
    assert tokens_seen() == want
    validator = jsonschema.Draft202012Validator(load_schema())
    for e in steps:
        validator.validate(e)
        assert e["worker"] == "d0" and e["engine"] == 0 and e["source"] == "probe"
        assert 0 <= e["duration_s"] < 5 and 0 <= e["kv_usage"] <= 1  # type: ignore[operator]
    assert max(int(e["running"]) for e in steps) >= 2, "concurrent streams ran together"  # type: ignore[call-overload]
    ts = [float(e["t"]) for e in steps]  # type: ignore[arg-type]
    assert ts == sorted(ts), "steps arrive in engine order"
    assert any("interval_s" in e for e in steps), "busy steps carry the time since the previous one"
    _scheduled_and_period(steps, n, sum(prompt_tokens(data) for _, data in results))
    # the lanes find the engine's own steps plausible beside the streams the tap saw (the probe's
    # token admits them: it admits nothing else)
    judged = httpx.get(f"{tier.api}/v1/report", timeout=30, trust_env=False).json()["step_model"]
    assert sum(judged["step_events_rejected"].values()) <= len(steps) // 10, judged
    sent = metric(tier.probe.decode_urls[0], "shadow_probe_steps_total", outcome="sent") - sent_before
    assert sent >= len(steps)
    assert metric(tier.probe.decode_urls[0], "shadow_probe_steps_total", outcome="dropped_full") == 0


def _scheduled_and_period(steps: list[dict[str, object]], requests: int, prompt: int) -> None:
    """What the engine scheduled into its steps, its own step period and the host's times: every
    request was prefilled in some step (its prompt's computed tokens, at most the prompt: prefix
    cache hits are not computed); the engine's step period (vLLM's own inter-token latency) is the
    time between the stat logger's records on average, and longer than the engine's elapsed time of
    a step (which leaves out the forward pass); the engine's CPU and wait times only grow."""
    def total(key: str) -> int:
        return sum(int(e.get(key, 0)) for e in steps)  # type: ignore[call-overload]

    assert requests <= total("prefill_requests"), total("prefill_requests")
    assert 0 < total("prefill_tokens") <= prompt, (total("prefill_tokens"), prompt)
    assert total("decode_requests") > 0 and all("iteration" in e for e in steps)
    its = [int(e["iteration"]) for e in steps]  # type: ignore[call-overload]
    assert its == sorted(its)
    both = [e for e in steps if "engine_interval_s" in e and "interval_s" in e]
    assert len(both) >= len(steps) // 2, "most busy steps carry the engine's own period"
    period = statistics.fmean(float(e["engine_interval_s"]) for e in both)  # type: ignore[arg-type]
    interval = statistics.fmean(float(e["interval_s"]) for e in both)  # type: ignore[arg-type]
    elapsed = statistics.fmean(float(e["duration_s"]) for e in both)  # type: ignore[arg-type]
    assert period == pytest.approx(interval, rel=0.25), (period, interval)
    assert elapsed < period, (elapsed, period)
    hosted = [e for e in steps if "engine_wait_s" in e]
    assert hosted, "the engine's scheduler statistics (it runs on this host)"
    for k in ("engine_run_s", "engine_wait_s"):
        xs = [float(e[k]) for e in hosted]  # type: ignore[arg-type]
        assert xs == sorted(xs) and xs[0] >= 0, k


def test_a_probe_whose_sink_hangs_drops_and_counts_and_the_engine_serves_on(tier: Tier) -> None:
    url = tier.drop.decode_urls[0]
    n, max_tokens = 4, 48
    with cf.ThreadPoolExecutor(n) as ex:
        results = list(ex.map(lambda i: raw_stream(f"{url}/v1/completions", _body(i, max_tokens)), range(n)))
    assert [completion_tokens(data) for _, data in results] == [max_tokens] * n
    # queue of 1 and a sink that accepts but never answers: the sender is stuck in a post (2 s
    # timeout) while the engine steps on, so steps are dropped at the queue and counted.
    wait_for(lambda: metric(url, "shadow_probe_steps_total", outcome="dropped_full") > 0,
             "steps dropped at the full queue", timeout=30)
    wait_for(lambda: metric(url, "shadow_probe_steps_total", outcome="dropped_failed") > 0,
             "a failed post counted", timeout=30)
    assert metric(url, "shadow_probe_steps_total", outcome="sent") == 0


def test_the_probe_reads_the_process_that_runs_the_forward_pass(tier: Tier) -> None:
    # vLLM's CPU build runs each engine's forward pass in a worker process below its engine core
    # (the MP executor); the engine core waits for it in a loop that spins, so the worker's main
    # thread is what the probe reads (a vLLM that lays its processes out otherwise fails here)
    server = tier.probe.servers[0]
    assert server.proc is not None
    pid = EngineSched(root=server.proc.pid).pid(0, time.monotonic())
    assert pid is not None, "the engine's processes below the API server"

    def title(p: int | str) -> bytes:
        return Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0", 1)[0]

    parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    assert title(pid).startswith(b"VLLM::Worker") and title(parent) == b"VLLM::EngineCore", (title(pid),
                                                                                             title(parent))
