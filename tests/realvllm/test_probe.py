"""shadow's step probe inside a real vLLM: every step reaches a real `shadow serve` event API (with
its probe token) as a valid `step` event the lanes find plausible, and a probe whose sink never
answers drops (and counts) instead of blocking."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import jsonschema

from shadow.contracts.events import load_schema
from tests.realvllm.conftest import MODEL_NAME, Tier
from tests.realvllm.helpers import completion_tokens, latest_seq, metric, raw_stream, wait_for


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
    # the lanes find the engine's own steps plausible beside the streams the tap saw (the probe's
    # token admits them: it admits nothing else)
    judged = httpx.get(f"{tier.api}/v1/report", timeout=30, trust_env=False).json()["step_model"]
    assert sum(judged["step_events_rejected"].values()) <= len(steps) // 10, judged
    sent = metric(tier.probe.decode_urls[0], "shadow_probe_steps_total", outcome="sent") - sent_before
    assert sent >= len(steps)
    assert metric(tier.probe.decode_urls[0], "shadow_probe_steps_total", outcome="dropped_full") == 0


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
