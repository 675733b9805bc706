"""The twin against a real vLLM engine, on the same requests: the lane's per-step running, waiting
and KV series against the engine's own (its step probe's), on the engine's step index.

One server of the tiny model sized so that every rule of vLLM V1's scheduler the lanes model takes
part: 3 slots (--max-num-seqs) with a burst of requests waiting behind them, a token budget of 256
(--max-num-batched-tokens: longer prompts are prefilled in chunks beside decodes) and a KV cache
of a dozen 128-token blocks (requests are preempted and recompute). The engine's steps are
replayed through a lane on the engine's own step index (`shadow.engine.steptwin`): the requests
enter the lane at the step before which the engine's own counts say they reached it, and step k of
the lane is step k of the engine. That is why the bound holds on a loaded machine: nothing in it
depends on how fast the host ran the engine or its HTTP side (those are the wall-time twin's, in
bench/bench_twin_vllm.py); it differs only where the lane's scheduling rules differ from vLLM's.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from pathlib import Path

import httpx
import pytest

from shadow.engine.config import EngineLimits
from shadow.engine.jobs import Job
from shadow.engine.steptwin import EngineStep, arrivals, replay
from shadow.realvllm.eventsink import EventSink
from shadow.realvllm.launcher import VllmFleet, VllmFleetConfig
from tests.realvllm.conftest import MODEL_NAME
from tests.realvllm.helpers import completion_tokens, prompt_tokens, raw_stream, samples, wait_for

SLOTS, BUDGET, BLOCK = 3, 256, 128
KV_BYTES = 12 * BLOCK * 1024  # the tiny model's KV is 1 KiB a token: 12 blocks (one is vLLM's null block)


@dataclass
class Engine:
    fleet: VllmFleet
    sink: EventSink


@pytest.fixture(scope="module")
def engine(engine_venv: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    sink = EventSink()
    fleet = VllmFleet(VllmFleetConfig(
        decode=1, model_path=tiny_model, cores=(1,), max_num_seqs=SLOTS, max_num_batched_tokens=BUDGET,
        max_model_len=768, kv_bytes=KV_BYTES, probe_url=sink.url,
        log_dir=tmp_path_factory.mktemp("twin-vllm")), log=lambda msg: None)
    try:
        fleet.start()
        yield Engine(fleet, sink)
    finally:
        fleet.stop()
        sink.close()


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice('bcdfghjklmnpqrstvwz')}{rng.choice('aeiou')}{rng.randint(0, 999)}"
                    for _ in range(words))


def test_the_twin_schedules_each_step_as_the_engine_did(engine: Engine, tmp_path: Path) -> None:
    url = engine.fleet.decode_urls[0]
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    info = next(labels for (name, labels), _ in samples(text).items() if name == "vllm:cache_config_info")
    blocks = int(dict(info)["num_gpu_blocks"]) - 1  # vLLM's usage leaves out its null block
    assert int(dict(info)["block_size"]) == BLOCK
    rng = random.Random(33)
    n = 14
    # prompts of ~45-270 tokens (some over the budget) and outputs that grow three running requests
    # past the cache (admitted, a request's prompt must fit; its output does not have to)
    words = [rng.randint(15, 50) for _ in range(n)]
    words[3] = words[9] = 90
    bodies = [{"model": MODEL_NAME, "prompt": _prompt(rng, w), "max_tokens": rng.randint(250, 450),
               "ignore_eos": True, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}} for w in words]
    before = len(engine.sink.steps())

    def real_steps() -> list[EngineStep]:
        return [EngineStep(int(s["running"]), int(s["waiting"]), int(s["prefill_requests"]) + int(
            s["decode_requests"]), int(s.get("preemptions", 0)), round(float(s["kv_usage"]) * blocks),
            int(s["prefill_tokens"])) for s in list(engine.sink.steps()[before:]) if not s.get("dummy")]

    # One at a time into the engine, the next once the engine's own counts show the last one in its
    # queue (its API server may otherwise reorder them: the replay needs the order they reached it)
    # — still far faster than 3 slots serve them, so a queue builds behind the slots.
    with cf.ThreadPoolExecutor(n) as ex:
        futures = []
        for i in range(n):
            futures.append(ex.submit(raw_stream, f"{url}/v1/completions", bodies[i], 300))
            wait_for(lambda i=i: sum(arrivals(real_steps())) > i, f"request {i} in the engine", timeout=120,
                     step=0.02)
        results = {i: f.result()[1] for i, f in enumerate(futures)}
    outs = [completion_tokens(results[i]) for i in range(n)]
    assert outs == [b["max_tokens"] for b in bodies]
    wait_for(lambda: sum(int(s.get("tokens", 0)) for s in engine.sink.steps()[before:]) >= sum(outs),
             "the probe's steps carrying every generated token", timeout=60)
    iterations = [int(s["iteration"]) for s in engine.sink.steps()[before:] if not s.get("dummy")]
    assert iterations == list(range(iterations[0], iterations[0] + len(iterations))), "a step was not seen"
    real = real_steps()
    assert sum(arrivals(real)) == n, "the engine's counts account for every request"
    jobs = [Job(f"r{i}", 0.0, prompt_tokens(results[i]), outs[i]) for i in range(n)]
    limits = EngineLimits(max_num_batched_tokens=BUDGET, kv_tokens=blocks * BLOCK, block_tokens=BLOCK)
    pairs = replay(real, jobs, SLOTS, limits)
    preempted = sum(s.preempted for s in real)
    # step by step: what ran, what waited, the KV blocks held and the prefill tokens scheduled
    agree = {k: sum(1 for p in pairs if p.engine[k] == p.twin[k]) / len(pairs) for k in range(4)}
    differ = [(i, p.engine, p.twin) for i, p in enumerate(pairs) if p.engine != p.twin]
    report = {"steps": len(pairs), "preempted": preempted, "max_waiting": max(s.waiting for s in real),
              "max_kv_blocks": max(s.kv_blocks or 0 for s in real), "blocks": blocks, "agree": agree,
              "first_differences": differ[:8]}
    print(report)
    # the engine's steps and the requests, for a failed run's post-mortem (CI keeps its tmp_path):
    # `replay` them again to find the step where the lane's rules part from the engine's
    (tmp_path / "engine_steps.json").write_text(json.dumps({
        "slots": SLOTS, "budget": BUDGET, "block": BLOCK, "blocks": blocks,
        "steps": [astuple(s) for s in real],
        "jobs": [[str(j.request_id), j.prompt_tokens, j.output_tokens] for j in jobs]}))
    # the run exercised every rule the lanes model
    assert report["max_waiting"] >= 2, ("requests waited behind the slots", report)
    assert max(j.prompt_tokens for j in jobs) > BUDGET, ("a prompt was prefilled in chunks", report)
    assert preempted >= 1, ("the KV cache ran out and the engine preempted", report)
    # The scheduler's state is the same at every step (measured: all of them, on a machine at load
    # 2-9); a step's prefill tokens may differ where the engine resumed a preempted request: vLLM's
    # iteration details count a request with output tokens as decoding, so its probe's prefill
    # tokens leave out that recompute, which the twin counts (and prices).
    assert agree[0] == 1.0 and agree[1] == 1.0 and agree[2] == 1.0, report
    assert agree[3] >= 0.98, report
