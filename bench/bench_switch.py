"""Prediction confirmed by switching (issue 33, item 5): on the real MoE DP pair, what shadow
predicts in shadow mode for the cost-aware BR-0 against what BR-0 then does when it routes.

    python bench/bench_switch.py                                  # both workloads, A/B/A/B/A/B each
    python bench/bench_switch.py --workloads misplacing --rounds 4 --requests 100

The fleet: the `moe` model (tiny Mixtral) under `--data-parallel-size 2`, one API server per rank,
rank r on core r, the ranks stepping in lockstep (as `bench/bench_moe_dp.py`), their step probes
posting to `shadow serve` on a fixed API port. The same seeded trace per workload in every run,
`--concurrency` streams (below the ranks' 2 × `--slots`, so where a request goes decides how many
sequences each rank runs):

- `misplacing`: half "heavy-byte" requests (prompts of `--heavy-words` words, 48-96 output
  tokens: many body bytes, but on this engine a sequence costs the same whatever its context) and
  half "light-byte" ones (4-12 words, 160-320 output tokens: few bytes, held for many steps).
  JSQ-bytes (least outstanding request-body bytes) sends the light ones to whichever rank holds
  fewer heavy ones, so one rank runs many more sequences than the other, and the lockstep step
  is paced by the larger.
- `neutral`: every request alike (20-40 words, 100-200 output tokens): bytes track sequences, so
  JSQ-bytes and BR-0 should place alike.

Arms, alternated A, B, A, B, ... (`--rounds` pairs), each a fresh `shadow serve`:
- A: `shadow router` (JSQ-bytes, the vllm-ascend proxy's rule) routes through serve's taps; serve
  runs in shadow mode with a `br0` lane on the measured clock (the step cost fitted per barrier
  group from the probe: BR-0 scores that cost, `shadow.core.cost.RouteCost`). Its prediction is
  read from `/v1/report?drain=1` at the end: throughput and spread of the br0 lane against the
  `actual` lane with the report's interval over its `--compare-window` windows, and the mean step
  (the lanes' `tpot_s`) of br0 over actual.
- B: `shadow serve --active --mode active --active-policy br0` routes the same trace itself (no
  --pin-mode: its guard falls back to round-robin when a check trips; the mode's transitions are
  printed).

Realized, per pair k: B_k over A_k of the engines' mean busy step (the probe's own step times),
of the decode throughput (the client's output tokens over the load's wall time) and of the KV
spread (mean |KV usage rank 0 - rank 1| at each busy step of either rank, the other rank's as of
its latest step: the engines' own KV, the twin of the lanes' token spread); the interval over the
pairs is `shadow.core.intervals.ratio_interval` (geometric mean, t-interval of the log ratios).
Predicted, beside it: the same ratio interval over the A runs' predictions (one per run), and the
last A run's own interval over its windows. The load average is printed before, during (each
run) and after; the machine's other jobs move step times between runs, which is why the arms
alternate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe_dp import load_with_steps, moe_pair, warm_up

from shadow.base.procs import Child, shadow_argv
from shadow.core.intervals import RatioInterval, ratio_interval
from shadow.realvllm.launcher import free_port_run

TOKEN = "bench-switch-token"
WORKERS = ("d0", "d1")
WORKLOADS = ("misplacing", "neutral")
FIGURES = ("step", "throughput", "spread")  # realized and predicted, each as B over A


def write_trace(path: Path, kind: str, n: int, seed: int, heavy_words: int) -> dict[str, Any]:
    """The seeded workload as a generic CSV trace (all arrivals at 0: the concurrency paces them)."""
    rng = random.Random(f"{kind}-{seed}")
    rows, outs, words = [], [], []
    for i in range(n):
        if kind == "misplacing":
            heavy = i % 2 == 0
            prompt = rng.randint(heavy_words - 40, heavy_words) if heavy else rng.randint(4, 12)
            out = rng.randint(48, 96) if heavy else rng.randint(160, 320)
        else:
            prompt, out = rng.randint(20, 40), rng.randint(100, 200)
        outs.append(out)
        words.append(prompt)
        rows.append(f"0.0,{prompt},{out},{kind}{seed}-{i}")
    rng.shuffle(rows)
    path.write_text("arrival_s,prompt_tokens,output_tokens,prompt_key\n" + "\n".join(rows) + "\n")
    return {"kind": kind, "requests": n, "output_tokens": sum(outs), "prompt_words": sum(words)}


@dataclass
class Run:
    """One arm's run: the load's outcome (`load`: ok, failed, output tokens, wall s), the probe's
    steps, serve's report at the end, the mode controller's state (B) and the load average."""

    arm: str  # "A" (JSQ-bytes routes, shadow predicts) or "B" (shadow routes with br0)
    load_before: float
    load_after: float = float("nan")
    load: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    modes: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return int(self.load["requests"]["ok"])

    @property
    def failed(self) -> int:
        req = self.load["requests"]
        return int(req["failed"]) + int(req["not_sent"]) + int(req["output_mismatch"])

    @property
    def wall_s(self) -> float:
        return float(self.load["wall_s"])

    def busy(self) -> list[dict[str, Any]]:
        return [s for s in self.steps if s.get("tokens", 0) > 0 and not s.get("dummy")]

    def step_mean_s(self) -> float:
        durs = [float(s["duration_s"]) for s in self.busy()]
        return statistics.fmean(durs) if durs else float("nan")

    def throughput(self) -> float:
        return int(self.load["tokens"]["output"]) / self.wall_s if self.wall_s > 0 else float("nan")

    def _gaps(self, key: str) -> list[float]:
        last: dict[int, float] = {0: 0.0, 1: 0.0}
        gaps = []
        for s in sorted(self.steps, key=lambda s: s["t"]):
            last[int(s.get("engine", 0))] = float(s.get(key, 0))
            if s.get("tokens", 0) > 0:
                gaps.append(abs(last[0] - last[1]))
        return gaps

    def kv_spread(self) -> float:
        """Mean |KV usage rank 0 - rank 1| (fraction of a rank's KV cache) at busy steps."""
        gaps = self._gaps("kv_usage")
        return statistics.fmean(gaps) if gaps else float("nan")

    def running_spread(self) -> float:
        gaps = self._gaps("running")
        return statistics.fmean(gaps) if gaps else float("nan")

    def realized(self) -> dict[str, float]:
        return {"step": self.step_mean_s(), "throughput": self.throughput(), "spread": self.kv_spread()}

    def predicted(self) -> dict[str, tuple[float | None, float | None, float | None]]:
        """A: the br0 lane over the actual lane (B over A) per figure: (estimate, low, high); step
        from the lanes' mean step (no interval in the report), throughput and spread from the
        comparison's window intervals (spread's ratio there is actual over lane: inverted)."""
        lanes = self.report.get("lanes", {})
        br0, act = lanes.get("br0", {}), lanes.get("actual", {})
        step = (br0["tpot_s"] / act["tpot_s"]) if br0.get("tpot_s") and act.get("tpot_s") else None
        cmp = self.report.get("comparison", {}).get("lanes", {}).get("br0", {})
        tp, sp = cmp.get("throughput", {}), cmp.get("spread", {})
        inv = (1 / sp["ratio"] if sp.get("ratio") else None,
               1 / sp["high"] if sp.get("high") else None, 1 / sp["low"] if sp.get("low") else None)
        return {"step": (step, None, None), "throughput": (tp.get("ratio"), tp.get("low"), tp.get("high")),
                "spread": inv}


def fmt_iv(iv: RatioInterval) -> str:
    """A B-over-A ratio with its interval and which side of 1 the interval is on: "B higher" or
    "B lower" (whether that is better depends on the figure: throughput up, step and spread down)."""
    if iv.low is None or iv.high is None:
        return f"{iv.ratio:.3f} (n={iv.n}, no interval)" if iv.ratio else "–"
    side = "B higher" if iv.low > 1 else "B lower" if iv.high < 1 else "no significant difference"
    return f"{iv.ratio:.3f} [{iv.low:.3f}–{iv.high:.3f}] (n={iv.n}, {side})"


def serve_argv(port: int, slots: int, window: float, state: Path, active: bool) -> list[str]:
    argv = ["serve", "--port", str(port), "--slots", str(slots), "--events-token", TOKEN,
            "--policies", "br0", "--compare-window", str(window), "--scrape-interval", "0.5",
            "--ring-bytes", str(512 << 20), "--state-dir", str(state), "--stop-taps"]
    if active:
        argv += ["--active", "--mode", "active", "--active-policy", "br0"]
    return argv


def ports_free(first: int, n: int, timeout_s: float = 120.0) -> None:
    """Wait until ports first..first+n-1 can all be bound (serve's API and taps: the previous
    serve's tap group releases them when it has stopped, later on a loaded host)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = []
        for p in range(first, first + n):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    busy.append(p)
        if not busy:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"ports {busy} still in use after {timeout_s:.0f} s")
        time.sleep(0.2)


def one_run(arm: str, urls: list[str], port: int, trace: Path, args: argparse.Namespace, logs: Path,
            tag: str) -> Run:
    argv = serve_argv(port, args.slots, args.compare_window, logs / f"state-{tag}", arm == "B")
    for w, u in zip(WORKERS, urls, strict=True):
        argv += ["--upstream", f"{w}={u}"]
    ports_free(port, 1 + len(WORKERS))  # the last run's tap group may still be going away
    serve = Child(f"shadow serve ({tag})", shadow_argv(*argv), logs / f"serve-{tag}.log", timeout_s=180)
    children = [serve]
    run = Run(arm, os.getloadavg()[0])
    try:
        api = serve.ready["api"]
        if arm == "A":
            rargv = ["router", "--port", "0"]
            for w in WORKERS:
                rargv += ["--decode", f"{w}={serve.ready['taps'][w]}"]
            router = Child(f"shadow router ({tag})", shadow_argv(*rargv), logs / f"router-{tag}.log",
                           timeout_s=120)
            children.append(router)
            target = router.ready["url"]
        else:
            target = serve.ready["active"]
        run.load, run.steps, _ = load_with_steps(api, urls, target, trace, args, logs / f"load-{tag}.json")
        with httpx.Client(timeout=300, trust_env=False) as c:
            run.report = c.get(f"{api}/v1/report", params={"drain": 1}).json()
            if arm == "B":
                run.modes = c.get(f"{api}/v1/mode").json()
        run.load_after = os.getloadavg()[0]
    finally:
        for ch in reversed(children):
            ch.stop()
    return run


def cost_summary(report: dict[str, Any]) -> str:
    groups = report.get("step_model", {}).get("cost", {}).get("groups", {})
    return "; ".join(f"{g}: {v.get('form')} {json.dumps(v.get('terms'))} R² {v.get('r2')} "
                     f"oos {v.get('oos_error')}" for g, v in groups.items()) or "no cost fit"


def run_workload(kind: str, urls: list[str], port: int, args: argparse.Namespace,
                 logs: Path) -> dict[str, Any]:
    trace = logs / f"{kind}.csv"
    shape = write_trace(trace, kind, args.requests, args.seed, args.heavy_words)
    say(f"workload {shape}")
    runs: list[Run] = []
    for k in range(2 * args.rounds):
        arm = "AB"[k % 2]
        r = one_run(arm, urls, port, trace, args, logs, f"{kind}-{k}-{arm}")
        runs.append(r)
        cmp = r.report.get("comparison", {})
        pred = r.predicted() if arm == "A" else {}
        say(f"{kind} run {k} {arm}: ok {r.ok} failed {r.failed}, wall {r.wall_s:.1f} s, "
            f"{r.throughput():.0f} tok/s, step {1e3 * r.step_mean_s():.2f} ms over {len(r.busy())} busy "
            "steps, "
            f"KV spread {r.kv_spread():.4f}, running spread {r.running_spread():.2f}; load average "
            f"{r.load_before:.2f} -> {r.load_after:.2f}; trustworthy {cmp.get('trustworthy')} "
            f"{cmp.get('problems')}; predicted {pred}; mode {mode_line(r.modes)}")
        say(f"  step cost: {cost_summary(r.report)}")
    a = [r for r in runs if r.arm == "A"]
    b = [r for r in runs if r.arm == "B"]
    realized = {f: ratio_interval([rb.realized()[f] / ra.realized()[f] for ra, rb in zip(a, b, strict=True)])
                for f in FIGURES}
    over_runs = {f: ratio_interval([p for p in (r.predicted()[f][0] for r in a) if p is not None])
                 for f in FIGURES}
    last = a[-1].predicted()
    return {"workload": shape, "realized": realized, "predicted_over_runs": over_runs,
            "predicted_last_run": last, "runs": runs}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mode_line(doc: dict[str, Any]) -> str:
    """B: the mode at the end and the modes it went through with why (the mode controller's
    /v1/mode): "active (start→active: flag)" when it routed with its policy throughout."""
    moves = ", ".join(f"{t.get('from')}→{t.get('to')}: {t.get('reason')}" for t in doc.get("transitions", []))
    fallback = f"; fallback: {doc['fallback_reason']}" if doc.get("fallback_reason") else ""
    return f"{doc.get('current')} ({moves}){fallback}"


def table(kind: str, res: dict[str, Any]) -> str:
    lines = [f"\n### {kind}: B (shadow routes, br0) over A (JSQ-bytes routes)\n",
             "| figure (B/A) | realized over pairs | predicted, over the A runs | "
             "predicted, last A run's windows |",
             "|---|---|---|---|"]
    for f in FIGURES:
        est, low, high = res["predicted_last_run"][f]
        last = "–" if est is None else (f"{est:.3f}" + ("" if low is None or high is None
                                                        else f" [{low:.3f}–{high:.3f}]"))
        lines.append(f"| {f} | {fmt_iv(res['realized'][f])} | {fmt_iv(res['predicted_over_runs'][f])} | "
                     f"{last} |")
    lines += ["", "| run | arm | ok/failed | wall s | tok/s | step ms | KV spread | running spread | "
              "load before→after | trustworthy (A) / mode (B) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in enumerate(res["runs"]):
        trust = (str(r.report.get("comparison", {}).get("trustworthy")) if r.arm == "A"
                 else mode_line(r.modes))
        lines.append(f"| {k} | {r.arm} | {r.ok}/{r.failed} | {r.wall_s:.1f} | {r.throughput():.0f} | "
                     f"{1e3 * r.step_mean_s():.2f} | {r.kv_spread():.4f} | {r.running_spread():.2f} | "
                     f"{r.load_before:.2f}→{r.load_after:.2f} | {trust} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3, help="A/B pairs per workload")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=12, help="client streams (below 2 × --slots)")
    ap.add_argument("--slots", type=int, default=8, help="max_num_seqs of each rank (= serve --slots)")
    ap.add_argument("--heavy-words", type=int, default=400, help="misplacing: the heavy prompts' words")
    ap.add_argument("--compare-window", type=float, default=2.0, help="serve's window (s) in arm A")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--warmup", type=int, default=8, help="requests straight to each rank first")
    args = ap.parse_args()
    kinds = args.workloads.split(",")
    if unknown := set(kinds) - set(WORKLOADS):
        ap.error(f"unknown workloads {sorted(unknown)}")

    logs = Path(f"/tmp/shadow-bench-switch-{int(time.time())}")
    logs.mkdir(parents=True)
    port = free_port_run(1 + len(WORKERS))  # serve's API (the probes' target), then its taps
    fleet = moe_pair(port, args.slots, TOKEN, logs)
    start_load = os.getloadavg()
    say(f"logs in {logs}; load average before {start_load}")
    results: dict[str, Any] = {}
    try:
        fleet.start()
        urls = fleet.decode_urls
        warm_up(urls, args.warmup)
        for kind in kinds:
            results[kind] = run_workload(kind, urls, port, args, logs)
    finally:
        fleet.stop()
    end_load = os.getloadavg()
    print(f"load average before {start_load}, after {end_load}; args {vars(args)}; logs {logs}")
    for kind, res in results.items():
        print(table(kind, res))
    doc = {kind: {"workload": res["workload"],
                  "realized": {f: dataclasses.asdict(iv) for f, iv in res["realized"].items()},
                  "predicted_over_runs": {f: dataclasses.asdict(iv)
                                          for f, iv in res["predicted_over_runs"].items()},
                  "runs": [{"arm": r.arm, **r.realized(),
                            "predicted": r.predicted() if r.arm == "A" else None,
                            "load": [r.load_before, r.load_after], "ok": r.ok, "failed": r.failed,
                            "modes": r.modes,
                            "trustworthy": r.report.get("comparison", {}).get("trustworthy"),
                            "problems": r.report.get("comparison", {}).get("problems"),
                            "step_cost": r.report.get("step_model", {}).get("cost", {}).get("groups")}
                           for r in res["runs"]]}
           for kind, res in results.items()}
    (logs / "result.json").write_text(json.dumps(doc, default=str, indent=1))
    print(f"\nfull result: {logs / 'result.json'}")
    return 0 if all(r.failed == 0 for res in results.values() for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
