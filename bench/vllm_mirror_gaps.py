"""What shadow's mirror sees of real vLLM servers, against what the engines did (read only).

    python bench/vllm_mirror_gaps.py                       # 2 tiny servers, 1/4/16 streams
    python bench/vllm_mirror_gaps.py --model-size mid --json out.json

Protocol: G real vLLM CPU servers (`shadow fleet --engine vllm`'s launcher, one core each, the step
probe posting to `shadow serve`), `shadow serve` with a tap in front of each, the official openai
client. Phase 1, for each concurrency C: C streams of exactly `--max-tokens` tokens (ignore_eos,
include_usage) through the tap of d0; per stream the content chunks it carried, its client TTFT
and inter-chunk gaps; the probe's step events of d0 in the same window; the mirror's running count
of d0 (/v1/state) beside the engine's `vllm:num_requests_running`, sampled every 0.05 s. Phase 2:
`--requests` streams WITHOUT include_usage over all taps, and the tokens the mirror recorded for
them (its finish events) against the tokens sent. Also the mirror's prompt-size estimate (its
route events) against the engine's usage.prompt_tokens, and the engine's own TTFT histogram.
Prints one JSON document (and writes it with --json).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from shadow.base.procs import Child, shadow_argv
from shadow.loadgen.prompts import PromptBuilder
from shadow.realvllm.launcher import VllmFleet, VllmFleetConfig, free_port

TOKEN = "bench-events-token"
MODEL = "sim-llm"


def metric_sum(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def events_after(api: str, seq: int) -> tuple[list[dict[str, Any]], int]:
    out: list[dict[str, Any]] = []
    while True:
        r = httpx.get(f"{api}/v1/events", params={"after": seq, "limit": 100000}, timeout=30, trust_env=False)
        last = int(r.headers["X-Last-Seq"])
        out += [json.loads(line) for line in r.text.splitlines()]
        if last <= seq:
            return out, seq
        seq = last


PROMPTS = PromptBuilder()  # the prompts `shadow load` sends (pseudo-words, N words = N "tokens")


def prompt_of(i: int) -> str:
    return PROMPTS.build_for(i, 20 + (i % 8) * 30, None)


def one_stream(client: OpenAI, i: int, max_tokens: int, usage: bool, rid: str) -> dict[str, Any]:
    t0 = time.monotonic()
    times: list[float] = []
    completion = prompt = None
    kwargs: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
    stream = client.completions.create(
        model=MODEL, prompt=prompt_of(i),
        max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": rid}, **kwargs)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.monotonic())
        if chunk.usage is not None:
            completion, prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {"rid": rid, "chunks": len(times), "completion_tokens": completion, "prompt_tokens": prompt,
            "ttft_s": times[0] - t0 if times else None, "gaps": gaps, "t0": t0, "t1": time.monotonic()}


class Sampler(threading.Thread):
    """The mirror's active count of one worker beside the engine's num_requests_running."""

    def __init__(self, api: str, engine_url: str, worker: str) -> None:
        super().__init__(daemon=True)
        self.api, self.engine_url, self.worker = api, engine_url, worker
        self.pairs: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5, trust_env=False) as c:
            while not self.stop.is_set():
                try:
                    mirror = c.get(self.api + "/v1/state").json()["workers"][self.worker]["active"]
                    text = c.get(self.engine_url + "/metrics").text
                    real = sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                               if s.name == "vllm:num_requests_running")
                    self.pairs.append((float(mirror), real))
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                self.stop.wait(0.05)


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def span(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "min": min(xs, default=None), "max": max(xs, default=None), "mean": mean(xs)}


def summarize(c: int, runs: list[dict[str, Any]], evs: list[dict[str, Any]], t0: float, t1: float,
              pairs: list[tuple[float, float]], engine_ttft: float | None, max_tokens: int) -> dict[str, Any]:
    """Phase-1 figures of one concurrency."""
    steps = [e for e in evs if e["type"] == "step" and e.get("worker") == "d0" and t0 <= e["t"] <= t1 + 0.05]
    busy = [e for e in steps if "interval_s" in e]
    gaps = [g for r in runs for g in r["gaps"]]
    routes = {e["request_id"]: e for e in evs if e["type"] == "route"}  # the last: learnt from usage
    arrives = {e["request_id"]: e for e in evs if e["type"] == "arrive"}  # the body's estimate
    ratio = [routes[r["rid"]]["prompt_tokens"] / r["prompt_tokens"] for r in runs
             if routes.get(r["rid"], {}).get("prompt_tokens") and r["prompt_tokens"]]
    est = [arrives[r["rid"]]["prompt_tokens"] / r["prompt_tokens"] for r in runs
           if arrives.get(r["rid"], {}).get("prompt_tokens") and r["prompt_tokens"]]
    chunks = [r["chunks"] for r in runs]
    usage = sum(r["completion_tokens"] for r in runs)
    intervals = [e["interval_s"] for e in busy]
    return {
        "streams": c,
        "chunks_per_token": sum(chunks) / usage,
        "chunks_per_stream": span([float(x) for x in chunks]),
        "usage_tokens_exact": all(r["completion_tokens"] == max_tokens for r in runs),
        "sse_gap_mean_ms": 1e3 * (mean(gaps) or 0),
        "sse_gap_p50_ms": 1e3 * (pct(gaps, 0.5) or 0),
        "probe_steps": len(steps), "probe_tokens": sum(e.get("tokens", 0) for e in steps),
        "usage_tokens": usage,
        "probe_elapsed_mean_ms": 1e3 * (mean([e["duration_s"] for e in steps]) or 0),
        "probe_interval_mean_ms": 1e3 * (mean(intervals) or 0),
        "probe_interval_p50_ms": 1e3 * (pct(intervals, 0.5) or 0),
        "tokens_per_busy_step": mean([float(e.get("tokens", 0)) for e in busy]),
        "client_ttft_p50_ms": 1e3 * (pct([r["ttft_s"] for r in runs], 0.5) or 0),
        "engine_ttft_mean_ms": 1e3 * engine_ttft if engine_ttft is not None else None,
        "mirror_minus_engine_running": span([m - v for m, v in pairs]),
        "mirror_prompt_final_over_engine": {**span(ratio), "exact": sum(1 for x in ratio if x == 1.0)},
        "mirror_prompt_estimate_over_engine": {**span(est), "exact": sum(1 for x in est if x == 1.0)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--model-size", choices=("tiny", "mid"), default="tiny")
    ap.add_argument("--streams", default="1,4,16", help="concurrencies of phase 1 (default 1,4,16)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=40, help="phase 2: streams without include_usage")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    ports = [free_port() for _ in range(args.decode)]
    upstreams = [a for g, p in enumerate(ports) for a in ("--upstream", f"d{g}=http://127.0.0.1:{p}")]
    logs = Path(f"/tmp/shadow-bench-vllm-{int(time.time())}")
    logs.mkdir(parents=True)
    argv = shadow_argv("serve", *upstreams, "--slots", "64", "--events-token", TOKEN,
                       "--scrape-interval", "0.5", "--state-dir", str(logs / "state"), "--stop-taps")
    serve = Child("shadow serve", argv, logs / "serve.log")
    out: dict[str, Any] = {"model_size": args.model_size, "decode": args.decode,
                           "max_tokens": args.max_tokens}
    try:
        api = serve.ready["api"]
        taps = [serve.ready["taps"][f"d{g}"] for g in range(args.decode)]
        fleet = VllmFleet(VllmFleetConfig(decode=args.decode, model_size=args.model_size, ports=tuple(ports),
                                          probe_url=api, probe_token=TOKEN, log_dir=logs / "vllm"))
        (logs / "vllm").mkdir()
        with fleet:
            engines = fleet.decode_urls
            clients = [OpenAI(base_url=t + "/v1", api_key="x", max_retries=0) for t in taps]
            one_stream(clients[0], 0, 4, True, "warmup-0")  # first request: compile/warm caches
            _, seq = events_after(api, 0)
            phase1 = []
            for c in [int(x) for x in args.streams.split(",")]:
                ttft_sum0 = metric_sum(engines[0], "vllm:time_to_first_token_seconds_sum")
                ttft_n0 = metric_sum(engines[0], "vllm:time_to_first_token_seconds_count")
                sampler = Sampler(api, engines[0], "d0")
                sampler.start()
                with cf.ThreadPoolExecutor(c) as ex:
                    runs = list(ex.map(lambda i, c=c: one_stream(clients[0], i, args.max_tokens, True,
                                                                 f"c{c}-{i}"), range(c)))
                sampler.stop.set()
                sampler.join()
                time.sleep(1.0)  # the probe's sender and the mirror catch up
                evs, seq = events_after(api, seq)
                t0, t1 = min(r["t0"] for r in runs), max(r["t1"] for r in runs)
                n = metric_sum(engines[0], "vllm:time_to_first_token_seconds_count") - ttft_n0
                ttft_sum = metric_sum(engines[0], "vllm:time_to_first_token_seconds_sum") - ttft_sum0
                phase1.append(summarize(c, runs, evs, t0, t1, sampler.pairs, ttft_sum / n if n else None,
                                        args.max_tokens))
                print(json.dumps(phase1[-1]), file=sys.stderr, flush=True)
            out["phase1"] = phase1

            _, seq = events_after(api, seq)
            sampler = Sampler(api, engines[0], "d0")
            sampler.start()
            with cf.ThreadPoolExecutor(16) as ex:
                runs = list(ex.map(lambda i: one_stream(clients[i % len(clients)], i, args.max_tokens, False,
                                                        f"nousage-{i}"), range(args.requests)))
            sampler.stop.set()
            sampler.join()
            time.sleep(1.5)
            evs, seq = events_after(api, seq)
            finishes = {e["request_id"]: e for e in evs if e["type"] == "finish"}
            arrives = {e["request_id"]: e for e in evs if e["type"] == "arrive"}
            routes = {e["request_id"]: e for e in evs if e["type"] == "route"}
            got = [finishes.get(r["rid"], {}).get("generated") for r in runs]
            ratio: list[float] = []
            finals: list[float] = []
            for i, r in enumerate(runs):  # the engine's own count of each prompt (vLLM's /tokenize)
                real = httpx.post(engines[0] + "/tokenize", json={"model": MODEL, "prompt": prompt_of(i)},
                                  timeout=30, trust_env=False).json()["count"]
                est = arrives.get(r["rid"], {}).get("prompt_tokens")
                final = routes.get(r["rid"], {}).get("prompt_tokens")
                if est:
                    ratio.append(est / real)
                if final:
                    finals.append(final / real)
            out["no_usage"] = {
                "requests": len(runs), "tokens_sent": args.max_tokens * len(runs),
                "mirror_tokens": sum(g or 0 for g in got),
                "requests_wrong": sum(1 for g in got if g != args.max_tokens),
                "requests_unseen": sum(1 for g in got if g is None),
                "client_chunks": sum(r["chunks"] for r in runs),
                "mirror_prompt_estimate_over_engine": {**span(ratio),
                                                       "exact": sum(1 for x in ratio if x == 1.0)},
                "mirror_prompt_final_over_engine": span(finals),
                "mirror_minus_engine_running": span([m - v for m, v in sampler.pairs]),
            }
            report = httpx.get(api + "/v1/report", timeout=30, trust_env=False).json()
            out["report_keys"] = sorted(report)[:40]
            out["report"] = report
    finally:
        serve.stop()
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
