"""BR-0 vs JSQ on the DP ranks of one real MoE vLLM server (issue 21, item 7): the engine's own
step times and throughput per routing policy, the ranks stepping in lockstep.

    python bench/bench_moe_dp.py                              # 160 requests, 24 streams, 8 slots a rank
    python bench/bench_moe_dp.py --order jsq-bytes,br0,br0,jsq-bytes --requests 200

What runs: the `moe` model (tiny Mixtral, 4 experts, top-2) under `--data-parallel-size 2`, one API
server per DP rank (vLLM's external-LB mode: `VllmFleetConfig(dp_ports=True)`), rank r on core r,
with the CPU collectives vLLM 0.32 lacks for MoE under DP added (`shadow.realvllm.cpumoe`). In every
MoE layer of every step the ranks all-gather their tokens and reduce-scatter the result, and an
idle rank runs dummy batches while the other has work: a rank waits for the slower one at every
layer. Each rank's step probe posts to `shadow serve` (a fixed API port, so a restarted serve gets
them again). Per run: a fresh `shadow serve --active --mode active --pin-mode --active-policy P`
with the two ranks as decode workers d0 and d1, then `shadow load` of the SAME seeded trace
(`--requests` requests at t=0, prompts of 20-60 words, output lengths drawn 75 % short 16-96 and
25 % long 256-640, ignore_eos) through its proxy with `--concurrency` streams (above one rank's
`--slots`). The probe's step events (read from serve's `GET /v1/events` every 0.2 s during the
run) give the engines' own step time (vLLM's iteration elapsed: dispatch of the forward to the
end of sampling, the collectives' waits included), the generated tokens and the running counts
after each step.

Printed per run and per policy (runs of one policy pooled): requests ok/failed, step time
mean/p50/p99 (both ranks' busy steps), decode throughput (the probe's generated tokens, and the
client's, over the load's own wall time), how many of the client's tokens the probe's steps carry
(steps lost between serve restarts show here), the mean |running(rank 0) - running(rank 1)| at
every busy step of either rank (the other rank's count after its latest step), and the wall time;
then the br0/jsq-bytes ratios (`jsq` in `--active-policy` means jsq-bytes, the vllm-ascend proxy's
rule). Order the runs to counter drift (default jsq, br0, br0, jsq).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from shadow.base.procs import Child, shadow_argv
from shadow.realvllm.launcher import VllmFleet, VllmFleetConfig, free_port_run, group_members

TOKEN = "bench-moe-dp-token"
WORKERS = ("d0", "d1")


def write_trace(path: Path, n: int, seed: int) -> dict[str, Any]:
    """The seeded workload as a generic CSV trace (all arrivals at 0: the concurrency paces them)."""
    rng = random.Random(seed)
    rows, outs = [], []
    for i in range(n):
        prompt = rng.randint(20, 60)
        out = rng.randint(256, 640) if rng.random() < 0.25 else rng.randint(16, 96)
        outs.append(out)
        rows.append(f"0.0,{prompt},{out},k{seed}-{i}")
    path.write_text("arrival_s,prompt_tokens,output_tokens,prompt_key\n" + "\n".join(rows) + "\n")
    return {"requests": n, "output_tokens": sum(outs), "long": sum(o >= 256 for o in outs)}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))] if s else float("nan")


@dataclass
class Run:
    policy: str
    ok: int = 0
    failed: int = 0
    wall_s: float = 0.0
    steps: list[dict[str, Any]] = field(default_factory=list)
    load: dict[str, Any] = field(default_factory=dict)
    lost_events: int = 0  # events of serve's ring not read in time (any kind)
    cost: dict[str, Any] = field(default_factory=dict)  # serve's step-cost model at the end (per group)
    twin: dict[str, Any] = field(default_factory=dict)  # serve's twin check at the end (fidelity.twin)

    def durations(self) -> list[float]:
        return [s["duration_s"] for s in self.steps if s.get("tokens", 0) > 0]

    def tokens(self) -> int:
        return sum(int(s.get("tokens", 0)) for s in self.steps)

    def by_max_running(self) -> list[tuple[int, float]]:
        """(max of the ranks' running counts, step duration) at each busy step of either rank."""
        last = {0: 0, 1: 0}
        out = []
        for s in sorted(self.steps, key=lambda s: s["t"]):
            last[int(s.get("engine", 0))] = int(s.get("running", 0))
            if s.get("tokens", 0) > 0:
                out.append((max(last.values()), float(s["duration_s"])))
        return out

    def busy_steps(self, engine: int) -> int:
        return sum(1 for s in self.steps if s.get("engine") == engine and s.get("tokens", 0) > 0)

    def client_tokens(self) -> int:
        return int(self.load["tokens"]["output"]) if self.load else 0

    def spread(self) -> float:
        """Mean |running(rank 0) - running(rank 1)| at each busy step of either rank (the other
        rank's count as of its latest step; 0 before its first)."""
        last = {0: 0, 1: 0}
        gaps = []
        for s in sorted(self.steps, key=lambda s: s["t"]):
            e = int(s.get("engine", 0))
            last[e] = int(s.get("running", 0))
            if s.get("tokens", 0) > 0:
                gaps.append(abs(last[0] - last[1]))
        return statistics.fmean(gaps) if gaps else float("nan")


def read_steps(api: str, after: int) -> tuple[list[dict[str, Any]], int, int]:
    """The step events serve still has after cursor `after`; the new cursor; how many events of
    any kind left serve's ring (the last 10,000) before they were read."""
    out: list[dict[str, Any]] = []
    lost = 0
    with httpx.Client(timeout=30, trust_env=False) as c:
        while True:
            r = c.get(f"{api}/v1/events", params={"after": after, "limit": 100_000})
            r.raise_for_status()
            last = int(r.headers.get("X-Last-Seq", after))
            lines = r.text.splitlines()
            if len(lines) < 100_000:
                lost += max(0, last - after - len(lines))
            out += [ev for ev in map(json.loads, lines) if ev.get("type") == "step"]
            if last == after:
                return out, last, lost
            after = last


class StepReader(threading.Thread):
    """Reads serve's step events every 0.2 s while a run goes: its ring keeps the last 10,000
    events, which the taps' token events would otherwise push the steps out of."""

    def __init__(self, api: str, after: int) -> None:
        super().__init__(daemon=True)
        self.api, self.after = api, after
        self.steps: list[dict[str, Any]] = []
        self.lost = 0
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def poll(self) -> None:
        steps, self.after, lost = read_steps(self.api, self.after)
        self.steps += steps
        self.lost += lost

    def run(self) -> None:
        try:
            while not self._stop_event.wait(0.2):
                self.poll()
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> list[dict[str, Any]]:
        self._stop_event.set()
        self.join()
        if self.error is not None:
            raise RuntimeError(f"reading serve's events failed: {self.error}")
        self.poll()
        return self.steps


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of process group `pgid`."""
    ticks = 0
    for pid in group_members(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def moe_pair(port: int, slots: int, token: str, logs: Path) -> VllmFleet:
    """The MoE DP pair (not started): the `moe` model under `--data-parallel-size 2`, one API
    server per rank, rank r on core r, the CPU collectives added, each rank's step probe posting to
    serve's event API on `port` with `token`; logs in `logs`/vllm."""
    (logs / "vllm").mkdir(parents=True, exist_ok=True)
    return VllmFleet(VllmFleetConfig(
        decode=1, data_parallel=2, dp_ports=True, moe_dp_collectives=True, model_size="moe",
        max_num_seqs=slots, cores=(0, 1), probe_url=f"http://127.0.0.1:{port}", probe_token=token,
        log_dir=logs / "vllm"))


def warm_up(urls: list[str], n: int) -> None:
    """`n` short requests straight to each rank (its first forward passes)."""
    body = {"model": "sim-llm", "prompt": "warm up", "max_tokens": 8, "ignore_eos": True}
    with httpx.Client(timeout=120, trust_env=False) as c:
        for u in urls:
            for _ in range(n):
                c.post(f"{u}/v1/completions", json=body).raise_for_status()


def lockstep_check(fleet: VllmFleet, tokens: int = 300) -> dict[str, float]:
    """CPU of rank 1's process group while one request runs on rank 0 alone, and while idle for
    as long: a rank with no request of its own that still burns CPU is stepping dummy batches
    with the other (vLLM's DPEngineCoreProc keeps every rank's loop running while any has work)."""
    r0, r1 = fleet.servers[0], fleet.servers[1]
    assert r0.proc is not None and r1.proc is not None
    body = {"model": "sim-llm", "prompt": "lockstep", "max_tokens": tokens, "ignore_eos": True}
    with httpx.Client(timeout=300, trust_env=False) as c:
        a, t0 = group_cpu_s(r1.proc.pid), time.monotonic()
        c.post(f"{r0.url}/v1/completions", json=body).raise_for_status()
        busy, wall = group_cpu_s(r1.proc.pid) - a, time.monotonic() - t0
    time.sleep(2.0)  # past the wave's end (the ranks agree to pause at most 16 steps later)
    a = group_cpu_s(r1.proc.pid)
    time.sleep(wall)  # the same span with nothing to do anywhere
    idle = group_cpu_s(r1.proc.pid) - a
    return {"rank0_request_s": wall, "rank1_cpu_s_during_it": busy, "rank1_cpu_s_idle_same_span": idle}


def probe_reaches(api: str, urls: list[str], timeout_s: float = 60.0) -> int:
    """Run a short request on each rank until serve has step events of both engines (the probes'
    senders post again after the restart); the event cursor after them."""
    body = {"model": "sim-llm", "prompt": "probe", "max_tokens": 4, "ignore_eos": True}
    seen: set[int] = set()
    cursor = 0
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=60, trust_env=False) as c:
        while seen != {0, 1}:
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve saw steps of engines {sorted(seen)} only within {timeout_s:.0f} s")
            for u in urls:
                c.post(f"{u}/v1/completions", json=body).raise_for_status()
            time.sleep(0.5)  # the probe posts every 100 ms
            steps, cursor, _ = read_steps(api, cursor)
            seen |= {int(ev.get("engine", -1)) for ev in steps}
    return cursor


def load_with_steps(api: str, urls: list[str], target: str, trace: Path, args: argparse.Namespace,
                    out: Path) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """`shadow load` of `trace` at `target` (`args.seed`, `args.concurrency` streams; its summary in
    `out`) while serve's step events are read (once both ranks' probes reach it): the load's
    summary, the step events from its start to `args.settle` s after its end, the events missed."""
    reader = StepReader(api, probe_reaches(api, urls))
    reader.start()
    t0 = time.monotonic()
    done = subprocess.run(
        shadow_argv("load", str(trace), "--target", target, "--model", "sim-llm",
                    "--seed", str(args.seed), "--concurrency", str(args.concurrency),
                    "--json", str(out), "--quiet"),
        capture_output=True, text=True, check=False, timeout=3600)
    t1 = time.monotonic()
    if not out.exists():
        raise RuntimeError(f"shadow load wrote no summary (exit {done.returncode}): "
                           f"{done.stderr[-2000:]}")
    time.sleep(args.settle)  # the probe posts every 100 ms: let the last steps arrive
    steps = [ev for ev in reader.finish() if t0 <= ev["t"] <= t1 + args.settle]
    return json.loads(out.read_text()), steps, reader.lost


def one_run(policy: str, urls: list[str], port: int, trace: Path, args: argparse.Namespace,
            logs: Path, k: int) -> Run:
    argv = ["serve", "--port", str(port), "--slots", str(args.slots), "--events-token", TOKEN,
            "--active", "--mode", "active", "--pin-mode", "--active-policy", policy, "--policies", "br0",
            "--scrape-interval", "0.5", "--ring-bytes", str(512 << 20),
            "--state-dir", str(logs / f"state-{k}"), "--stop-taps"]
    for w, u in zip(WORKERS, urls, strict=True):
        argv += ["--upstream", f"{w}={u}"]
    serve = Child(f"shadow serve ({policy})", shadow_argv(*argv), logs / f"serve-{k}-{policy}.log",
                  timeout_s=120)
    run = Run(policy)
    try:
        api, active = serve.ready["api"], serve.ready["active"]
        run.load, run.steps, run.lost_events = load_with_steps(api, urls, active, trace, args,
                                                               logs / f"load-{k}-{policy}.json")
        run.wall_s = float(run.load["wall_s"])  # the load's own: first request sent to last one done
        req = run.load["requests"]
        run.ok = int(req["ok"])
        run.failed = int(req["failed"]) + int(req["not_sent"]) + int(req["output_mismatch"])
        report = httpx.get(f"{api}/v1/report", timeout=30, trust_env=False).json()
        run.cost = report.get("step_model", {}).get("cost", {}).get("groups", {})
        run.twin = report.get("fidelity", {}).get("twin") or {}
    finally:
        serve.stop()
    return run


def summary(runs: list[Run]) -> dict[str, float]:
    durs = [d for r in runs for d in r.durations()]
    wall = sum(r.wall_s for r in runs)
    return {
        "runs": len(runs), "ok": sum(r.ok for r in runs), "failed": sum(r.failed for r in runs),
        "steps": len(durs), "step_mean_ms": statistics.fmean(durs) * 1e3 if durs else float("nan"),
        "step_p50_ms": pct(durs, 50) * 1e3, "step_p99_ms": pct(durs, 99) * 1e3,
        "tokens": sum(r.tokens() for r in runs), "tokens_per_s": sum(r.tokens() for r in runs) / wall,
        "client_tokens_per_s": sum(r.client_tokens() for r in runs) / wall,
        "probe_coverage": sum(r.tokens() for r in runs) / max(1, sum(r.client_tokens() for r in runs)),
        "steps_rank0": sum(r.busy_steps(0) for r in runs), "steps_rank1": sum(r.busy_steps(1) for r in runs),
        "spread": statistics.fmean(r.spread() for r in runs), "wall_s": wall / len(runs),
        "events_missed": sum(r.lost_events for r in runs),
    }


def row(name: str, s: dict[str, float]) -> str:
    return (f"| {name} | {s['ok']:.0f}/{s['failed']:.0f} | {s['steps_rank0']:.0f}+{s['steps_rank1']:.0f} | "
            f"{s['step_mean_ms']:.2f} | {s['step_p50_ms']:.2f} | {s['step_p99_ms']:.2f} | "
            f"{s['tokens_per_s']:.0f} ({s['client_tokens_per_s']:.0f}) | {s['probe_coverage']:.3f} | "
            f"{s['spread']:.2f} | {s['wall_s']:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--slots", type=int, default=8, help="max_num_seqs of each rank (= serve --slots)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--order", default="jsq-bytes,br0,br0,jsq-bytes")
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--warmup", type=int, default=8, help="requests straight to each rank first")
    args = ap.parse_args()
    order = args.order.split(",")

    logs = Path(f"/tmp/shadow-bench-moe-dp-{int(time.time())}")
    logs.mkdir(parents=True)
    trace = logs / "workload.csv"
    shape = write_trace(trace, args.requests, args.seed)
    port = free_port_run(1 + len(WORKERS))  # serve's API, then its two taps: the same every run
    fleet = moe_pair(port, args.slots, TOKEN, logs)
    print(f"logs in {logs}; workload {shape}; load average {os.getloadavg()}", file=sys.stderr, flush=True)
    runs: list[Run] = []
    lock: dict[str, float] = {}
    try:
        fleet.start()
        urls = fleet.decode_urls
        warm_up(urls, args.warmup)
        lock = lockstep_check(fleet)
        print(f"lockstep: {lock}", file=sys.stderr, flush=True)
        for k, policy in enumerate(order):
            r = one_run(policy, urls, port, trace, args, logs, k)
            runs.append(r)
            print(f"run {k} {policy}: ok {r.ok} failed {r.failed}, {len(r.durations())} steps, "
                  f"wall {r.wall_s:.1f} s, spread {r.spread():.2f}, {r.tokens()} probe tokens of "
                  f"{r.client_tokens()} ({r.lost_events} events missed), "
                  f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
            for group, g in r.cost.items():  # serve's own step-cost model of the run
                print(f"  step cost {group} (on {g.get('basis')}): {g.get('form')} {g.get('terms')}, R² "
                      f"{g.get('r2')}, out-of-sample {g.get('oos_error')} on {g.get('windows')} windows of "
                      f"{g.get('window_steps')} steps; host factor {g.get('host_factor')}, clock factor "
                      f"{g.get('clock_factor')}, window periods {g.get('period_error')} off one window ahead",
                      file=sys.stderr, flush=True)
            t = r.twin  # the twin (the lane of shadow's own placements) against the ranks' own steps
            print(f"  twin: KV vs engine {t.get('kv_vs_engine')}, running vs engine "
                  f"{t.get('running_vs_engine')}, placed vs mirror {t.get('placed_vs_mirror')} on "
                  f"{t.get('windows')} windows of {t.get('window_s')} s; per worker {t.get('workers')}",
                  file=sys.stderr, flush=True)
    finally:
        fleet.stop()
    header = ("| policy | ok/failed | busy steps rank 0+1 | step mean ms | p50 ms | p99 ms | "
              "decode tokens/s probe (client) | probe/client tokens | mean running spread | "
              "wall s (per run) |"
              "\n|---|---|---|---|---|---|---|---|---|---|")
    print(header)
    for k, r in enumerate(runs):
        print(row(f"run {k} {r.policy}", summary([r])))
    pooled = {p: summary([r for r in runs if r.policy == p]) for p in dict.fromkeys(order)}
    for p, s in pooled.items():
        print(row(f"**{p}** (pooled)", s))
    if "br0" in pooled and "jsq-bytes" in pooled:
        b, j = pooled["br0"], pooled["jsq-bytes"]
        print(f"\nbr0/jsq-bytes: step mean {b['step_mean_ms'] / j['step_mean_ms']:.3f}, "
              f"step p99 {b['step_p99_ms'] / j['step_p99_ms']:.3f}, "
              f"throughput {b['tokens_per_s'] / j['tokens_per_s']:.3f}, "
              f"spread {b['spread'] / j['spread']:.3f}, wall {b['wall_s'] / j['wall_s']:.3f}")
    pairs = [p for r in runs for p in r.by_max_running()]
    print("\nstep time by the larger rank's running count (all runs): "
          + ", ".join(f"{lo}-{hi}: {statistics.fmean(d for m, d in pairs if lo <= m <= hi) * 1e3:.2f} ms "
                      f"({sum(1 for m, _ in pairs if lo <= m <= hi)})"
                      for lo, hi in ((1, 2), (3, 4), (5, 8), (9, 12), (13, 1000))
                      if any(lo <= m <= hi for m, _ in pairs)))
    print(f"\nlockstep check (one 300-token request on rank 0 alone): rank 1's CPU "
          f"{lock['rank1_cpu_s_during_it']:.2f} s during its {lock['rank0_request_s']:.2f} s, "
          f"{lock['rank1_cpu_s_idle_same_span']:.2f} s idle for as long")
    print(json.dumps({"workload": shape, "args": vars(args), "pooled": pooled, "lockstep": lock,
                      "runs": [{"policy": r.policy, **summary([r]), "step_cost": r.cost} for r in runs],
                      "load_summaries": [r.load for r in runs]}, default=str))
    return 0 if all(r.failed == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
