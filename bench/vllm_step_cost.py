"""What a real vLLM engine's step costs, and what the rest of its variance is (read only).

    python bench/vllm_step_cost.py                               # 2 tiny servers, 300 requests
    python bench/vllm_step_cost.py --moe --requests 200 --json out.json   # the MoE DP pair

Protocol: real vLLM CPU servers (`shadow.realvllm.launcher`; `--moe`: the MoE model under DP=2, one
API server per rank, rank r on core r, as bench/bench_moe_dp.py runs it), each probe posting its
steps to a collector in this process. The workload: without --moe, `--requests` requests arriving
as a Poisson process at `--rate`/s (prompts of 10-300 words, 16-256 output tokens, ignore_eos),
alternately to the servers; with --moe, bench_moe_dp.py's (all at t=0, prompts 20-60 words, outputs
75 % 16-96 and 25 % 256-640, `--concurrency` streams). Meanwhile every 20 ms: each engine core's
main-thread scheduler statistics (`shadow.realvllm.stepsender.EngineSched`, what the probe reads:
time on a CPU and time runnable but waiting for one) and the host's CPU pressure
(/proc/pressure/cpu); at the end, the busiest threads of each engine core.

Per worker (the MoE pair: per group, both ranks' steps against the max of their counts), windows of
`--window` consecutive steps carrying the engine's own step period (`engine_interval_s`): the mean
period against the mean sequences computed n, KV tokens L (kv_usage × the engine's KV capacity)
and prefill tokens P, and the engine's run-queue wait and CPU time per step in the window.
`shadow.core.stepcost.select` chooses the form three ways: on the period (what shadow does live),
on the period less the engine's run-queue wait (the host's share taken out), and on the engine's
CPU time per step. Printed: each one's form, terms, R², out-of-sample error; the share of the
period's variance over windows the run-queue wait accounts for; the load average before and after.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from shadow.core.stepcost import CostFit, select
from shadow.core.stepmodel import StepTimeModel
from shadow.realvllm.launcher import VllmFleet, VllmFleetConfig, free_port
from shadow.realvllm.stepsender import EngineSched

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_step_period import Collector, emit, one_stream


def threads(pid: int) -> dict[str, tuple[float, float]]:
    """Per thread (name/tid): (seconds on a CPU, seconds waiting for one) so far."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8") as fh:
                name = fh.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as fh:
                a, b, _ = fh.read().split()
            out[f"{name}/{tid}"] = (int(a) / 1e9, int(b) / 1e9)
    return out


def psi_some_s() -> float:
    try:
        with open("/proc/pressure/cpu", encoding="ascii") as fh:
            return int(fh.readline().split("total=")[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return float("nan")


class Sampler(threading.Thread):
    """Every 20 ms: each engine's main-thread (CPU, run-queue wait) seconds and the host's CPU
    pressure."""

    def __init__(self, engines: list[tuple[EngineSched, int]]) -> None:
        super().__init__(daemon=True)
        self.engines = engines
        self.rows: list[tuple[float, list[tuple[float, float]], float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.monotonic()
            got = [sched.read(engine, now) for sched, engine in self.engines]
            if all(g is not None for g in got):
                self.rows.append((now, [g for g in got if g is not None], psi_some_s()))
            self.stop.wait(0.02)

    def at(self, t: Any, k: int, which: int) -> Any:
        """Engine k's cumulative CPU (which=0) or run-queue wait (1) seconds at times `t`."""
        ts = np.asarray([r[0] for r in self.rows])
        vals = np.asarray([r[1][k][which] for r in self.rows])
        return np.interp(t, ts, vals)


def features(steps: list[dict[str, Any]], capacity: float) -> dict[str, Any]:
    return {
        "t": np.asarray([s["t"] for s in steps]),
        "y": np.asarray([s["engine_interval_s"] for s in steps]),
        "n": np.asarray([s.get("decode_requests", 0) + s.get("prefill_requests", 0) for s in steps], float),
        "L": np.asarray([s.get("kv_usage", 0.0) * capacity for s in steps]),
        "P": np.asarray([s.get("prefill_tokens", 0) for s in steps], float),
    }


def fit_view(fit: CostFit) -> dict[str, Any]:
    ch = fit.chosen
    return {"form": ch.label if ch else None, "reason": fit.reason,
            "terms": {t: [round(v.low, 9), round(v.value, 9), round(v.high, 9)] for t, v in ch.terms.items()}
            if ch else None,
            "r2": ch.r2 if ch else None, "oos_error": ch.oos_error if ch else None, "windows": fit.windows,
            "mean_ms": 1e3 * (fit.mean_s or 0), "window_cv": fit.window_cv, "residual_cv": fit.residual_cv,
            "not_identified": fit.not_identified,
            "forms": {f.label: [f.oos_error, f.r2, f.why_not] for f in fit.forms}}


def predict(model: StepTimeModel, f: dict[str, Any]) -> Any:
    return model.a * f["L"] + model.c * f["n"] + model.p * f["P"] + model.b


def analyse(f: dict[str, Any], waits: Any, cpus: Any, w: int) -> dict[str, Any]:
    """Window means of w steps; `waits`/`cpus`: the engine's cumulative run-queue wait and CPU
    seconds at each step's time."""
    k = len(f["y"]) // w * w
    if k < 20 * w:
        return {"steps": len(f["y"]), "error": "too few steps"}
    mean = {key: f[key][:k].reshape(-1, w).mean(axis=1) for key in ("y", "n", "L", "P")}
    span = f["t"][w - 1:k:w] - np.r_[f["t"][0] - f["y"][0], f["t"][w - 1:k - w:w]]
    edges = np.r_[0, np.arange(w, k + 1, w) - 1]
    wait = np.diff(waits[edges]) / w
    cpu = np.diff(cpus[edges]) / w
    y = mean["y"]
    base = select(y, mean["n"], mean["L"], mean["P"], window_steps=w)
    hostfree = select(np.maximum(y - wait, 1e-6), mean["n"], mean["L"], mean["P"], window_steps=w)
    on_cpu = select(np.maximum(cpu, 1e-6), mean["n"], mean["L"], mean["P"], window_steps=w)
    model = base.model
    resid = y - predict(model, mean) if model else y - y.mean()
    wait_r2 = float(np.corrcoef(resid, wait)[0, 1] ** 2) if np.std(wait) > 0 else None
    per_step = None
    if model is not None:
        ss = float(((f["y"] - f["y"].mean()) ** 2).sum())
        per_step = 1 - float(((f["y"] - predict(model, f)) ** 2).sum()) / ss if ss > 0 else None
    return {
        "steps": len(f["y"]), "windows": len(y), "window_steps": w,
        "period_mean_ms": 1e3 * float(y.mean()), "wall_per_step_ms": 1e3 * float(span.sum() / k),
        "run_queue_wait_per_step_ms": 1e3 * float(wait.mean()), "cpu_per_step_ms": 1e3 * float(cpu.mean()),
        "wait_share_of_period": float(wait.sum() / y.sum()),
        "period": fit_view(base), "per_step_r2": per_step,
        "residual_variance_explained_by_run_queue_wait": wait_r2,
        "period_less_wait": fit_view(hostfree), "cpu_time": fit_view(on_cpu),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe", action="store_true", help="the MoE model under DP=2 (one API server per rank)")
    ap.add_argument("--requests", type=int, default=300, help="requests sent (default 300)")
    ap.add_argument("--rate", type=float, default=5.0, help="arrivals per second, no --moe (default 5)")
    ap.add_argument("--concurrency", type=int, default=24, help="--moe: streams at once (default 24)")
    ap.add_argument("--slots", type=int, default=8, help="each engine's --max-num-seqs (default 8)")
    ap.add_argument("--window", type=int, default=25, help="steps per window mean (default 25)")
    ap.add_argument("--seed", type=int, default=7, help="the workload's seed (default 7)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    ap.add_argument("--dump", type=Path, default=None,
                    help="also write every probe step event and the sampler's rows here (JSON)")
    args = ap.parse_args()
    col = Collector()
    logs = Path(f"/tmp/shadow-bench-cost-{int(time.time())}")
    (logs / "vllm").mkdir(parents=True)
    out: dict[str, Any] = {"moe": args.moe, "requests": args.requests, "load_before": os.getloadavg()}
    if args.moe:
        cfg = VllmFleetConfig(decode=1, data_parallel=2, dp_ports=True, moe_dp_collectives=True,
                              model_size="moe", max_num_seqs=args.slots, cores=(0, 1), probe_url=col.url,
                              log_dir=logs / "vllm")
    else:
        cfg = VllmFleetConfig(decode=2, max_num_seqs=args.slots, ports=(free_port(), free_port()),
                              probe_url=col.url, log_dir=logs / "vllm")
    rng = random.Random(args.seed)
    with VllmFleet(cfg) as fleet:
        urls = fleet.decode_urls
        # each server's engine core: DP rank r of the MoE pair (one API server per rank), else engine 0
        engines = [(EngineSched(root=s.proc.pid), r if args.moe else 0)
                   for r, s in enumerate(fleet.servers) if s.proc is not None]
        pids = [sched.pid(engine, time.monotonic()) or 0 for sched, engine in engines]
        capacity = [kv_capacity(u) for u in urls]
        for u in urls:
            one_stream(u, 0, 8)
        sampler = Sampler(engines)
        sampler.start()
        threads0 = [threads(p) for p in pids]
        before = len(col.steps())
        plan = []
        t = 0.0
        for i in range(args.requests):
            if args.moe:
                words, out_tokens = rng.randint(20, 60), (rng.randint(256, 640) if rng.random() < 0.25
                                                          else rng.randint(16, 96))
            else:
                t += rng.expovariate(args.rate)
                words, out_tokens = rng.randint(10, 300), rng.randint(16, 256)
            plan.append((t, i, out_tokens, words))
        start = time.monotonic()

        def run(item: tuple[float, int, int, int]) -> int:
            at, i, max_tokens, words = item
            time.sleep(max(0.0, start + at - time.monotonic()))
            return sum(n for _, n in one_stream(urls[i % len(urls)], i, max_tokens, words=words))

        with cf.ThreadPoolExecutor(args.concurrency if args.moe else 64) as ex:
            tokens = sum(ex.map(run, plan))
        time.sleep(1.0)
        sampler.stop.set()
        sampler.join()
        out["wall_s"] = time.monotonic() - start
        out["engine_threads"] = []  # per engine core: its busiest threads' CPU and run-queue wait (s)
        for p, before_t in zip(pids, threads0, strict=True):
            after_t = threads(p)
            delta = {k: (v[0] - before_t.get(k, (0.0, 0.0))[0], v[1] - before_t.get(k, (0.0, 0.0))[1])
                     for k, v in after_t.items()}
            top = sorted(delta.items(), key=lambda kv: -kv[1][0] - kv[1][1])[:5]
            out["engine_threads"].append({k: [round(a, 2), round(b, 2)] for k, (a, b) in top})
        out["tokens"] = tokens
        if args.dump is not None:
            args.dump.write_text(json.dumps({"steps": col.steps()[before:], "sampler": sampler.rows,
                                             "capacity": capacity}))
        steps = [s for s in col.steps()[before:] if "engine_interval_s" in s and not s.get("dummy")]
        workers = sorted({s.get("worker", "") for s in steps})
        out["workers"] = {}
        for k, name in enumerate(workers):
            mine = sorted((s for s in steps if s.get("worker") == name), key=lambda s: s["t"])
            f = features(mine, capacity[k])
            out["workers"][name] = analyse(f, sampler.at(f["t"], k, 1), sampler.at(f["t"], k, 0), args.window)
        if args.moe:
            out["group"] = group_analysis(steps, workers, capacity, sampler, args.window)
        psi = [r[2] for r in sampler.rows]
        out["host_cpu_pressure_some"] = (psi[-1] - psi[0]) / (sampler.rows[-1][0] - sampler.rows[0][0])
    return emit(out, args.json)


def kv_capacity(url: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:cache_config_info" and "kv_cache_size_tokens" in s.labels:
                return float(s.labels["kv_cache_size_tokens"])
            if s.name == "vllm:cache_config_info" and "num_gpu_blocks" in s.labels:
                return float(s.labels["num_gpu_blocks"]) * float(s.labels.get("block_size", 16))
    return 1.0


def group_analysis(steps: list[dict[str, Any]], workers: list[str], capacity: list[float], sampler: Sampler,
                   w: int) -> dict[str, Any]:
    """Both ranks' steps in time order, each against the max over the ranks of n, L and P as of
    their latest steps (the group steps at its slower member); run-queue wait: the larger rank's."""
    last: dict[str, tuple[float, float, float]] = {}
    rows = []
    for s in sorted(steps, key=lambda s: s["t"]):
        k = workers.index(s.get("worker", ""))
        last[s.get("worker", "")] = (s.get("decode_requests", 0) + s.get("prefill_requests", 0),
                                     s.get("kv_usage", 0.0) * capacity[k], s.get("prefill_tokens", 0))
        vals = list(last.values())
        rows.append({"t": s["t"], "engine_interval_s": s["engine_interval_s"], "n": max(v[0] for v in vals),
                     "L": max(v[1] for v in vals), "P": max(v[2] for v in vals)})
    f = {"t": np.asarray([r["t"] for r in rows]), "y": np.asarray([r["engine_interval_s"] for r in rows]),
         "n": np.asarray([r["n"] for r in rows], float), "L": np.asarray([r["L"] for r in rows]),
         "P": np.asarray([r["P"] for r in rows], float)}
    # both ranks' cumulative times: a group window of len(workers) × w reports spans w steps, so per
    # report they are the ranks' mean per step
    waits = sum(sampler.at(f["t"], k, 1) for k in range(len(workers)))
    cpus = sum(sampler.at(f["t"], k, 0) for k in range(len(workers)))
    return analyse(f, waits, cpus, w * len(workers))


if __name__ == "__main__":
    sys.exit(main())
