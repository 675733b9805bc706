"""Which duration is a real vLLM engine's step period: the probe's `duration_s` (the engine's
elapsed time of the step), its `interval_s` (time between the stat logger's records of consecutive
busy steps), or neither? Measured against the streams' own token times (read only).

    python bench/vllm_step_period.py                        # 1 tiny server, 1/4/16 streams
    python bench/vllm_step_period.py --streams 2,8 --max-tokens 200 --json out.json

Protocol: one real vLLM CPU server (`shadow.realvllm.launcher`, one core, iteration details on) whose
step probe posts to a collector in this process. Per concurrency C: C streams of exactly
`--max-tokens` tokens (ignore_eos, `return_token_ids`: every chunk says how many tokens it carries,
so merged chunks are counted right), started together. The steady window is from the last stream's
first token to the first stream's last token (all C streams decode throughout). In it:
- the streams' period: window / tokens each stream received in it (mean over streams);
- the probe's: window / its steps in it, the mean of their `interval_s` and of their `duration_s`;
- vLLM's own inter-token latency (`vllm:inter_token_latency_seconds`, engine-core timestamps) over
  the whole phase.
Prints one JSON document with the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shadow.realvllm.eventsink import EventSink as Collector
from shadow.realvllm.launcher import VllmFleet, VllmFleetConfig, free_port

MODEL = "sim-llm"


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def one_stream(url: str, i: int, max_tokens: int, words: int | None = None) -> list[tuple[float, int]]:
    """(monotonic time, tokens) per content chunk of one stream."""
    body = {"model": MODEL, "prompt": f"stream {i} " + "word " * (words or 8 + i % 5),
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True}
    out: list[tuple[float, int]] = []
    with httpx.Client(timeout=300, trust_env=False) as c, c.stream("POST", url + "/v1/completions",
                                                                     json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ids = (chunk.get("choices") or [{}])[0].get("token_ids") or []
            if ids:
                out.append((time.monotonic(), len(ids)))
    return out


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def cv(xs: list[float]) -> float | None:
    return statistics.stdev(xs) / statistics.fmean(xs) if len(xs) > 1 and statistics.fmean(xs) > 0 else None


def phase(url: str, col: Collector, c: int, max_tokens: int) -> dict[str, Any]:
    itl = (metric_sum(url, "vllm:inter_token_latency_seconds_sum"),
           metric_sum(url, "vllm:inter_token_latency_seconds_count"))
    with cf.ThreadPoolExecutor(c) as ex:
        streams = list(ex.map(lambda i: one_stream(url, i, max_tokens), range(c)))
    time.sleep(1.0)  # the probe's sender posts what it holds
    itl_n = metric_sum(url, "vllm:inter_token_latency_seconds_count") - itl[1]
    itl_s = metric_sum(url, "vllm:inter_token_latency_seconds_sum") - itl[0]
    lo = max(s[0][0] for s in streams)
    hi = min(s[-1][0] for s in streams)
    window = hi - lo
    got = [sum(n for t, n in s if lo < t <= hi) for s in streams]
    steps = [e for e in col.steps() if lo < e["t"] <= hi and not e.get("dummy")]
    busy = [e for e in steps if e.get("tokens", 0) > 0]
    return {
        "streams": c, "max_tokens": max_tokens, "tokens_exact": all(sum(n for _, n in s) == max_tokens
                                                                    for s in streams),
        "window_s": window,
        "stream_period_ms": 1e3 * window / statistics.fmean(got) if window > 0 and min(got) > 0 else None,
        "probe_steps": len(steps), "probe_steps_with_tokens": len(busy),
        "probe_step_period_ms": 1e3 * window / len(steps) if steps else None,
        "probe_interval_mean_ms": 1e3 * (mean([e["interval_s"] for e in steps if "interval_s" in e]) or 0),
        "probe_duration_mean_ms": 1e3 * (mean([e["duration_s"] for e in steps]) or 0),
        "probe_engine_interval_mean_ms": 1e3 * (mean([e["engine_interval_s"] for e in steps
                                                       if "engine_interval_s" in e]) or 0),
        "probe_tokens_per_step": mean([float(e.get("tokens", 0)) for e in steps]),
        "probe_running_mean": mean([float(e.get("running", 0)) for e in steps]),
        "probe_prefill_tokens": sum(int(e.get("prefill_tokens", 0)) for e in steps),
        "engine_itl_mean_ms": 1e3 * itl_s / itl_n if itl_n else None,
        "chunks_per_token": sum(len(s) for s in streams) / max(1, sum(sum(n for _, n in s) for s in streams)),
    }


def mixed(url: str, col: Collector, requests: int, rate: float, seed: int) -> dict[str, Any]:
    """Requests arriving over time (Poisson at `rate`/s, prompts 10-300 words, 16-256 tokens): the
    probe's periods weighted per step and per token, against vLLM's inter-token latency (one per
    token of a running stream) and the streams' own per-token gaps."""
    import random

    rng = random.Random(seed)
    itl0 = (metric_sum(url, "vllm:inter_token_latency_seconds_sum"),
            metric_sum(url, "vllm:inter_token_latency_seconds_count"))
    before = len(col.steps())
    plan = []
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(rate)
        plan.append((t, i, rng.randint(16, 256), rng.randint(10, 300)))

    def run(item: tuple[float, int, int, int]) -> list[tuple[float, int]]:
        at, i, max_tokens, words = item
        time.sleep(max(0.0, start + at - time.monotonic()))
        body_words = words
        return one_stream(url, i, max_tokens, words=body_words)

    start = time.monotonic()
    with cf.ThreadPoolExecutor(64) as ex:
        streams = list(ex.map(run, plan))
    time.sleep(1.0)
    itl_n = metric_sum(url, "vllm:inter_token_latency_seconds_count") - itl0[1]
    itl_s = metric_sum(url, "vllm:inter_token_latency_seconds_sum") - itl0[0]
    steps = [e for e in col.steps()[before:] if not e.get("dummy")]
    busy = [e for e in steps if "interval_s" in e]
    eng = [e for e in steps if "engine_interval_s" in e]
    per_token = [(e["interval_s"], e.get("tokens", 0)) for e in busy]
    gaps = [(b[0] - a[0]) / b[1] for s in streams for a, b in itertools.pairwise(s)]
    return {
        "requests": requests, "rate_per_s": rate, "steps": len(steps), "busy_steps": len(busy),
        "probe_interval_mean_ms": 1e3 * (mean([i for i, _ in per_token]) or 0),
        "probe_interval_token_weighted_ms": 1e3 * sum(i * k for i, k in per_token)
        / max(1, sum(k for _, k in per_token)),
        "probe_interval_decode_weighted_ms": 1e3 * sum(e["interval_s"] * e.get("decode_requests", 0)
                                                       for e in busy)
        / max(1, sum(e.get("decode_requests", 0) for e in busy)),
        "probe_duration_mean_ms": 1e3 * (mean([e["duration_s"] for e in busy]) or 0),
        "probe_engine_interval_mean_ms": 1e3 * (mean([e["engine_interval_s"] for e in eng]) or 0),
        "probe_engine_interval_decode_weighted_ms": 1e3 * sum(
            e["engine_interval_s"] * e.get("decode_requests", 0) for e in eng)
        / max(1, sum(e.get("decode_requests", 0) for e in eng)),
        "steps_with_engine_interval": len(eng),
        "interval_cv": cv([e["interval_s"] for e in busy]),
        "engine_interval_cv": cv([e["engine_interval_s"] for e in eng]),
        "engine_itl_mean_ms": 1e3 * itl_s / itl_n if itl_n else None,
        "stream_gap_mean_ms": 1e3 * (mean(gaps) or 0),
        "prefill_tokens": sum(int(e.get("prefill_tokens", 0)) for e in steps),
        "steps_with_prefill": sum(1 for e in steps if e.get("prefill_tokens", 0) > 0),
        "running_mean": mean([float(e.get("running", 0)) for e in busy]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", choices=("tiny", "mid"), default="tiny")
    ap.add_argument("--streams", default="1,4,16", help="concurrencies (default 1,4,16)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--mixed", type=int, default=0, help="then N requests arriving over time (default 0)")
    ap.add_argument("--rate", type=float, default=4.0, help="their arrival rate per second (default 4)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    col = Collector()
    logs = Path(f"/tmp/shadow-bench-period-{int(time.time())}")
    logs.mkdir(parents=True)
    out: dict[str, Any] = {"model_size": args.model_size, "load_before": os.getloadavg()}
    port = free_port()
    fleet = VllmFleet(VllmFleetConfig(decode=1, model_size=args.model_size, ports=(port,), cores=(0,),
                                      probe_url=col.url, log_dir=logs / "vllm"))
    (logs / "vllm").mkdir()
    with fleet:
        url = fleet.decode_urls[0]
        one_stream(url, 0, 8)  # warm-up
        out["phases"] = []
        for c in (int(x) for x in args.streams.split(",") if x):
            out["phases"].append(phase(url, col, c, args.max_tokens))
            print(json.dumps(out["phases"][-1]), file=sys.stderr, flush=True)
        if args.mixed:
            out["mixed"] = mixed(url, col, args.mixed, args.rate, 7)
    return emit(out, args.json)


def emit(out: dict[str, Any], path: Path | None) -> int:
    """Print `out` (and write it to `path`) as JSON with the load average now beside it."""
    out["load_after"] = os.getloadavg()
    text = json.dumps(out, indent=1, default=str)
    if path is not None:
        path.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
