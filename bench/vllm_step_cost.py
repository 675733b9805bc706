"""What a real vLLM engine's step costs, apart from what its host adds (read only).

    python bench/vllm_step_cost.py                               # 2 tiny servers, 300 requests
    python bench/vllm_step_cost.py --moe --requests 200 --json out.json   # the MoE DP pair
    python bench/vllm_step_cost.py --burners 4 ...               # the same beside 4 CPU burners
    python bench/vllm_step_cost.py --from-dump steps.json        # analyse a run's --dump again

Protocol: real vLLM CPU servers (`shadow.realvllm.launcher`; `--moe`: the MoE model under DP=2, one
API server per rank, rank r on core r, as bench/bench_moe_dp.py runs it), each probe posting its
steps to a collector in this process. The workload: without --moe, `--requests` requests arriving
as a Poisson process at `--rate`/s (prompts of 10-300 words, 16-256 output tokens, ignore_eos),
alternately to the servers; with --moe, bench_moe_dp.py's (all at t=0, prompts 20-60 words, outputs
75 % 16-96 and 25 % 256-640, `--concurrency` streams). `--burners N`: N busy-loop processes
(`while :; do :; done`) started `--burn-after` seconds into the workload and stopped at its end.
Meanwhile every 20 ms the host's CPU pressure (/proc/pressure/cpu); at the end, the busiest threads
of each engine core (CPU and run-queue seconds).

Per worker (the MoE pair: also per group, both ranks' steps against the max of their counts), the
probe's steps carrying the engine's own period (`engine_interval_s`) and its main thread's
scheduler statistics read at each step's record (`engine_run_s`, `engine_wait_s`) are fed to
`shadow.core.stepcost.StepCostFit` exactly as `shadow serve`'s clock feeds it
(`shadow.live.workerclock.host_wait`), twice: with the wait (the engine's work fitted, the host
factor measured: what shadow does now) and without (the period fitted: what it does where no wait
is measured). Printed per fit: basis, form, terms with 95 % intervals, R², out-of-sample error on
`--window`-step windows, the host factor (the last 4 windows, median, 10th-90th percentiles), and
`period_error` (the lanes' clock against each window's period, one window ahead). Beside them: the
engine's CPU time per step (mean and spread over windows), the share of the records' time the
engine thread was runnable (run + wait: 1 when it never sleeps within its steps), how far the
records' span of a window is from the engine's own (the lag's jitter), and the load average before
and after.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from shadow.core.stepcost import CostFit, StepCostFit
from shadow.live.workerclock import StepCounts, host_wait
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


class Pressure(threading.Thread):
    """Every 20 ms: the host's CPU pressure ("some" seconds so far)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.rows: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.rows.append((time.monotonic(), psi_some_s()))
            self.stop.wait(0.02)

    def share(self) -> float | None:
        if len(self.rows) < 2:
            return None
        (t0, a), (t1, b) = self.rows[0], self.rows[-1]
        return (b - a) / (t1 - t0)


def fit_view(fit: CostFit) -> dict[str, Any]:
    ch = fit.chosen
    h = fit.host
    return {
        "basis": fit.basis, "form": ch.label if ch else None, "reason": fit.reason,
        "terms_ms": {t: [round(1e3 * v.low, 6), round(1e3 * v.value, 6), round(1e3 * v.high, 6)]
                     for t, v in ch.terms.items()} if ch else None,
        "r2": ch.r2 if ch else None, "oos_error": ch.oos_error if ch else None, "windows": fit.windows,
        "mean_ms": 1e3 * (fit.mean_s or 0), "window_cv": fit.window_cv, "outliers": fit.outliers,
        "host_factor": None if h is None else {"recent": h.recent, "median": h.median, "low": h.low,
                                               "high": h.high, "wait_share": h.wait_share},
        "period_error": fit.period_error, "period_windows": fit.period_windows,
        "not_identified": fit.not_identified,
        "forms": {f.label: [f.oos_error, f.r2, f.why_not] for f in fit.forms},
    }


def seqs(s: dict[str, Any]) -> int:
    return 0 if s.get("dummy") else int(s.get("decode_requests", 0)) + int(s.get("prefill_requests", 0))


def live_fits(steps: list[dict[str, Any]], capacity: dict[str, float], workers: list[str], w: int,
              with_wait: bool) -> CostFit:
    """`steps` (in time order, of `workers`: one, or a barrier group) fed to a StepCostFit as shadow
    serve's clock feeds it: a group's samples are each member's steps against the max over the
    members (stepping within two periods) of n and P, and the max KV load L (kv_usage × the engine's
    capacity, as of each member's latest step); the wait and its span per member (`host_wait`)."""
    fit = StepCostFit(w * len(workers))
    last: dict[str, tuple[float, float, StepCounts]] = {}
    kv: dict[str, float] = {}
    for s in steps:
        name = s.get("worker", "")
        kv[name] = float(s.get("kv_usage", 0.0)) * capacity.get(name, 1.0)
        period = s.get("engine_interval_s")
        if not period or period <= 0:
            continue
        counts = StepCounts(seqs(s), int(s.get("prefill_tokens", 0)),
                            s.get("engine_wait_s") if with_wait else None, s.get("iteration"),
                            s.get("engine_run_s"))
        wait, span = host_wait(last.get(name), s["t"], period, counts) or (None, None)
        last[name] = (s["t"], period, counts)
        near = [c for t, p, c in last.values() if s["t"] - t <= 2 * max(period, p)]
        fit.add(period, max(c.seqs for c in near), max(kv.values()), max(c.prefill_tokens for c in near),
                wait, span, member=workers.index(name))
    return fit.result()


def engine_view(steps: list[dict[str, Any]], w: int) -> dict[str, Any]:
    """One engine's CPU time per step over windows of w consecutive steps (from the probe's reads),
    the share of the records' time its thread was runnable, and the records' span of a window
    against the engine's own."""
    got = [s for s in steps if "engine_run_s" in s and s.get("engine_interval_s")]
    if len(got) < 2 * w:
        return {"steps": len(got)}
    t = np.asarray([s["t"] for s in got])
    run = np.asarray([s["engine_run_s"] for s in got])
    wait = np.asarray([s["engine_wait_s"] for s in got])
    period = np.asarray([s["engine_interval_s"] for s in got])
    its = np.asarray([s.get("iteration", -1) for s in got])
    k = (len(got) - 1) // w * w
    ends = np.arange(0, k + 1, w)
    cpu = np.diff(run[ends]) / w
    pairs = list(itertools.pairwise(ends))
    consecutive = np.asarray([np.all(np.diff(its[a:b + 1]) == 1) for a, b in pairs])
    span = np.diff(t[ends])
    own = np.asarray([period[a + 1:b + 1].sum() for a, b in pairs])
    lag = np.abs(span - own)[consecutive]
    busy = (np.diff(run[ends]) + np.diff(wait[ends])) / span
    return {"steps": len(got), "windows": len(cpu), "cpu_ms_per_step": 1e3 * float(cpu.mean()),
            "cpu_window_cv": float(cpu.std() / cpu.mean()) if cpu.mean() > 0 else None,
            "runnable_share_of_time": float(np.median(busy)),
            "wait_share_of_time": float((wait[ends[-1]] - wait[0]) / (t[ends[-1]] - t[0])),
            "window_span_vs_engine_ms_p50_p90": [1e3 * float(x) for x in np.percentile(lag, [50, 90])]
            if len(lag) else None}


def analyse(steps: list[dict[str, Any]], capacity: dict[str, float], w: int, moe: bool) -> dict[str, Any]:
    steps = sorted((s for s in steps if s.get("type", "step") == "step"), key=lambda s: s["t"])
    workers = sorted({s.get("worker", "") for s in steps})
    out: dict[str, Any] = {}
    for name in workers:
        mine = [s for s in steps if s.get("worker") == name]
        out[name] = {"engine": engine_view([s for s in mine if not s.get("dummy")], w),
                     "engine_fit": fit_view(live_fits(mine, capacity, [name], w, True)),
                     "period_fit": fit_view(live_fits(mine, capacity, [name], w, False))}
    if moe and len(workers) > 1:
        out["+".join(workers)] = {"engine_fit": fit_view(live_fits(steps, capacity, workers, w, True)),
                                  "period_fit": fit_view(live_fits(steps, capacity, workers, w, False))}
    return out


class Burners:
    """`n` busy-loop processes (`sh -c 'while :; do :; done'`), started and stopped by their PIDs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started: float | None = None

    def start(self) -> None:
        self.started = time.monotonic()
        self.procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(self.n)]

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGKILL)
            p.wait()
        self.procs = []


def run_fleet(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, float], dict[str, Any]]:
    """Start the fleet, run the workload (with the burners), return the probe's steps, each worker's
    KV capacity in tokens, and what was measured beside them."""
    col = Collector()
    logs = Path(f"/tmp/shadow-bench-cost-{int(time.time())}")
    (logs / "vllm").mkdir(parents=True)
    side: dict[str, Any] = {}
    if args.moe:
        cfg = VllmFleetConfig(decode=1, data_parallel=2, dp_ports=True, moe_dp_collectives=True,
                              model_size="moe", max_num_seqs=args.slots, cores=(0, 1), probe_url=col.url,
                              log_dir=logs / "vllm")
    else:
        cfg = VllmFleetConfig(decode=2, max_num_seqs=args.slots, ports=(free_port(), free_port()),
                              probe_url=col.url, log_dir=logs / "vllm")
    rng = random.Random(args.seed)
    burners = Burners(args.burners)
    with VllmFleet(cfg) as fleet:
        urls = fleet.decode_urls
        # each server's engine core: DP rank r of the MoE pair (one API server per rank), else engine 0
        engines = [(EngineSched(root=s.proc.pid), r if args.moe else 0)
                   for r, s in enumerate(fleet.servers) if s.proc is not None]
        pids = [sched.pid(engine, time.monotonic()) or 0 for sched, engine in engines]
        capacity = {s.worker: kv_capacity(s.url) for s in fleet.servers}
        for u in urls:
            one_stream(u, 0, 8)
        pressure = Pressure()
        pressure.start()
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
        timer = threading.Timer(args.burn_after, burners.start) if args.burners else None
        if timer is not None:
            timer.start()

        def run(item: tuple[float, int, int, int]) -> int:
            at, i, max_tokens, words = item
            time.sleep(max(0.0, start + at - time.monotonic()))
            return sum(n for _, n in one_stream(urls[i % len(urls)], i, max_tokens, words=words))

        try:
            with cf.ThreadPoolExecutor(args.concurrency if args.moe else 64) as ex:
                side["tokens"] = sum(ex.map(run, plan))
        finally:
            if timer is not None:
                timer.cancel()
            burners.stop()
        side["wall_s"] = time.monotonic() - start
        if burners.started is not None:
            side["burners_from_s"] = burners.started - start
        time.sleep(1.0)
        pressure.stop.set()
        pressure.join()
        side["host_cpu_pressure_some"] = pressure.share()
        side["engine_threads"] = []  # per engine core: its busiest threads' CPU and run-queue wait (s)
        for p, before_t in zip(pids, threads0, strict=True):
            after_t = threads(p)
            delta = {k: (v[0] - before_t.get(k, (0.0, 0.0))[0], v[1] - before_t.get(k, (0.0, 0.0))[1])
                     for k, v in after_t.items()}
            top = sorted(delta.items(), key=lambda kv: -kv[1][0] - kv[1][1])[:5]
            side["engine_threads"].append({k: [round(a, 2), round(b, 2)] for k, (a, b) in top})
        steps = col.steps()[before:]
    return steps, capacity, side


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe", action="store_true", help="the MoE model under DP=2 (one API server per rank)")
    ap.add_argument("--requests", type=int, default=300, help="requests sent (default 300)")
    ap.add_argument("--rate", type=float, default=5.0, help="arrivals per second, no --moe (default 5)")
    ap.add_argument("--concurrency", type=int, default=24, help="--moe: streams at once (default 24)")
    ap.add_argument("--slots", type=int, default=8, help="each engine's --max-num-seqs (default 8)")
    ap.add_argument("--window", type=int, default=25, help="steps per window mean (default 25)")
    ap.add_argument("--seed", type=int, default=7, help="the workload's seed (default 7)")
    ap.add_argument("--burners", type=int, default=0, help="CPU burner processes beside the run (default 0)")
    ap.add_argument("--burn-after", type=float, default=10.0,
                    help="seconds into the workload the burners start (default 10)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    ap.add_argument("--dump", type=Path, default=None, help="also write the probe's steps here (JSON)")
    ap.add_argument("--from-dump", type=Path, default=None, help="analyse a --dump instead of running")
    args = ap.parse_args()
    out: dict[str, Any] = {"moe": args.moe, "load_before": os.getloadavg()}
    if args.from_dump is not None:
        doc = json.loads(args.from_dump.read_text())
        steps, capacity = doc["steps"], doc["capacity"]
        out.update(doc.get("side", {}))
        out["moe"] = doc.get("moe", args.moe)
    else:
        out.update({"requests": args.requests, "burners": args.burners})
        steps, capacity, side = run_fleet(args)
        out.update(side)
        if args.dump is not None:
            doc = {"steps": steps, "capacity": capacity, "side": out, "moe": args.moe}
            args.dump.write_text(json.dumps(doc))
    out["workers"] = analyse(steps, capacity, args.window, bool(out["moe"]))
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


if __name__ == "__main__":
    sys.exit(main())
