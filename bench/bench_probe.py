"""The step probe's cost: engine throughput with and without it, and the cost of one record() call.

    python bench/bench_probe.py                     # tiny model, 16 streams x 64 tokens, 3 rounds each
    python bench/bench_probe.py --model-size mid --rounds 5

Protocol: two real vLLM CPU servers of the same model on the SAME core (so no core is favoured),
one with the probe posting to a real `shadow serve` event API, one without. Rounds alternate
A, B, A, B... so only one server works at a time; each round is `--streams` concurrent openai
streams of exactly `--tokens` tokens (ignore_eos), straight to the engine. Throughput = tokens of
the round / its wall time; the figure is the ratio of the medians (probe on / off). Then, in the
engine venv, `record()` is timed in-process on real vLLM SchedulerStats/IterationStats objects
(ns per call, the engine loop's cost) against a stat logger whose record() does nothing, and the
process CPU per step until the sender has posted them all to the same event API (record + encode +
post, every thread).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from shadow.base.procs import Child, shadow_argv
from shadow.realvllm.launcher import VllmFleet, VllmFleetConfig, find_engine_venv

TOKEN = "bench-probe-token"
MICRO = r"""
import json, os, sys, time
from vllm.v1.metrics.stats import IterationStats, SchedulerStats, SchedulerIterationDetails
from vllm.v1.metrics.loggers import StatLoggerBase
os.environ["SHADOW_PROBE_URL"], os.environ["SHADOW_PROBE_TOKEN"] = sys.argv[2], sys.argv[3]
os.environ["SHADOW_PROBE_QUEUE"] = "1000000000"  # never full: time the append path, not the drop
from shadow.realvllm.probe import ShadowStepProbe
class Nop(StatLoggerBase):
    def __init__(self, vllm_config, engine_index=0): pass
    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0): pass
    def log_engine_initialized(self): pass
s = SchedulerStats(num_running_reqs=16, num_waiting_reqs=2, kv_cache_usage=0.3)
s.iteration_details = SchedulerIterationDetails(1, 0, 0, 16, 16, 5.0)
it = IterationStats(); it.num_generation_tokens = 16
n = int(sys.argv[1])
out = {}
for name, logger in (("nop", Nop(None)), ("probe", ShadowStepProbe(None))):
    c0, t0 = time.process_time_ns(), time.perf_counter_ns()
    for _ in range(n):
        logger.record(s, it, None, 0)
    out[name + "_record_ns"] = (time.perf_counter_ns() - t0) / n
    sender = getattr(logger, "sender", None)
    while sender is not None and sender.counts.sent + sender.counts.dropped_failed < n:
        time.sleep(0.01)
    out[name + "_cpu_ns_per_step"] = (time.process_time_ns() - c0) / n  # record + encode + post, all threads
    if sender is not None:
        out["sent"], out["failed"] = sender.counts.sent, sender.counts.dropped_failed
print(json.dumps(out))
"""


def one(client: OpenAI, tokens: int) -> int:
    n = 0
    for chunk in client.completions.create(model="sim-llm", prompt="measure the probe " * 8,
                                           max_tokens=tokens, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return n


def round_tps(client: OpenAI, streams: int, tokens: int) -> float:
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(streams) as ex:
        got = sum(ex.map(lambda _: one(client, tokens), range(streams)))
    if got != streams * tokens:
        raise RuntimeError(f"expected {streams * tokens} tokens, got {got}")
    return got / (time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", choices=("tiny", "mid"), default="tiny")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--calls", type=int, default=200_000, help="record() calls per timing (default 200k)")
    args = ap.parse_args()

    venv = find_engine_venv()
    logs = Path(f"/tmp/shadow-bench-probe-{int(time.time())}")
    logs.mkdir(parents=True)
    result: dict[str, Any] = {"model_size": args.model_size, "streams": args.streams, "tokens": args.tokens}
    argv = shadow_argv("serve", "--upstream", "d0=http://127.0.0.1:9", "--slots", "64",
                       "--events-token", TOKEN, "--state-dir", str(logs / "state"), "--stop-taps")
    serve = Child("shadow serve", argv, logs / "serve.log")
    fleets = {
        "on": VllmFleet(VllmFleetConfig(decode=1, model_size=args.model_size, cores=(args.core,),
                                        probe_url=serve.ready["api"], probe_token=TOKEN,
                                        log_dir=logs / "on")),
        "off": VllmFleet(VllmFleetConfig(decode=1, model_size=args.model_size, cores=(args.core,),
                                         log_dir=logs / "off")),
    }
    try:
        for name, f in fleets.items():
            (logs / name).mkdir()
            f.start()
        clients = {n: OpenAI(base_url=f.decode_urls[0] + "/v1", api_key="x", max_retries=0)
                   for n, f in fleets.items()}
        for c in clients.values():
            round_tps(c, 2, 8)  # warm up
        tps: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.rounds):
            for name in ("on", "off"):
                tps[name].append(round_tps(clients[name], args.streams, args.tokens))
                print(f"{name}: {tps[name][-1]:.0f} tokens/s", file=sys.stderr, flush=True)
        result["tokens_per_s"] = tps
        result["ratio_on_over_off"] = statistics.median(tps["on"]) / statistics.median(tps["off"])
        for f in fleets.values():
            f.stop()
        argv = [str(venv / "bin" / "python"), "-c", MICRO, str(args.calls), serve.ready["api"], TOKEN]
        micro = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=True)
        ns = json.loads(micro.stdout.strip().splitlines()[-1])
        result["record"] = ns
    finally:
        for f in fleets.values():
            f.stop()
        serve.stop()
    print(json.dumps(result, indent=1))
    print(f"SUMMARY probe on/off throughput {result['ratio_on_over_off']:.3f} "
          f"(median of {args.rounds} rounds, "
          f"{args.streams} streams x {args.tokens} tokens, {args.model_size}); record() "
          f"{ns['probe_record_ns']:.0f} ns on the loop (no-op logger {ns['nop_record_ns']:.0f} ns), "
          f"{ns['probe_cpu_ns_per_step'] / 1e3:.1f} us CPU per step with sending ({ns['sent']} sent)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
