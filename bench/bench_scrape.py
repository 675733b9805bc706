"""Cost of one `/metrics` scrape of `shadow serve --active`'s registry: the mirror, live-lane, mode
and active-proxy families rendered by prometheus_client (the exporters' collect code and the
exposition), on synthetic state of a G-worker fleet with L lanes.

    python bench/bench_scrape.py                          # G=64, L=5, 400 scrapes x 7 rounds
    python bench/bench_scrape.py --before ../main-checkout # before/after in one run, alternating

Protocol: each round builds the registry once and times `generate_latest` `--scrapes` times
(process CPU time); a round's figure is the median microseconds per scrape. With `--before DIR`
the same measurement runs from that checkout (PYTHONPATH=DIR, a child process) in alternate
rounds, and the line `RATIO` gives median(after) / median(before). A scrape runs on the sidecar's
event loop; traffic never waits for it (the taps relay on their own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class _Queue:
    dropped = 3
    maxsize = 65536
    bytes = 123456

    def __len__(self) -> int:
        return 17


def registry(workers: int, lanes: int) -> Any:
    """A registry with the mirror, live-lane, mode and active-proxy collectors on synthetic state."""
    from prometheus_client import CollectorRegistry

    from shadow.active.metrics import ActiveMetrics
    from shadow.active.mode_metrics import ModeCollector
    from shadow.live.lanes import DECISION_BUCKETS
    from shadow.live.metrics import LiveCollector
    from shadow.live.stepfit import STEP_BUCKETS
    from shadow.mirror.metrics import MirrorCollector

    names = [f"d{g}" for g in range(workers)]
    counts = SimpleNamespace(active=7, kv_tokens=9000, slots=16, finished=1234, cancelled=5, reaped=1)
    state = SimpleNamespace(workers=dict.fromkeys(names, counts), orphans=2, phantoms=lambda now: 0,
                            pending=lambda: 1, oldest_silence=lambda now: 0.25)
    kinds = ("arrive", "route", "token", "finish", "cancel")
    mirror = SimpleNamespace(state=state, events={(s, k): 100 for s in ("tap", "api") for k in kinds},
                             ignored={"duplicate": 1}, dropped={"live_cap": 2}, recorder=None,
                             errors={"analysis": 0}, listener_errors=0)
    analyzer = SimpleNamespace(chunks=dict.fromkeys(names, 5000), legs={(w, "decode"): 40 for w in names},
                               ends={(w, "done"): 40 for w in names}, inflight=dict.fromkeys(names, 7),
                               gaps=0)
    taps = [SimpleNamespace(name=w, requests=40, connect_errors=0, rejected={"busy": 1}, connections=8)
            for w in names]
    load = SimpleNamespace(running=7, waiting=1, kv_usage=0.4)
    rec = SimpleNamespace(workers={w: SimpleNamespace(drift_requests=0, drift_kv_ratio=0.01, load=load,
                                                      last_ok=1.0, errors=0) for w in names})
    lane = {"steps": 1e5, "spread_tokens": 300, "sum_spread_token_steps": 3e7, "imbalance_tokens": 900,
            "sum_imbalance_token_steps": 9e7, "barrier_idle_fraction": 0.1, "throughput_tokens_per_s": 5e4,
            "tpot_s": 0.06, "requests_finished": 1e4, "lookahead_stalls": 3, "lag_s": 0.2, "agreements": 900,
            "decisions": 1000, "worker_running_loads": dict.fromkeys(names, 9000),
            "worker_active": dict.fromkeys(names, 7),
            "decision_buckets": list(range(len(DECISION_BUCKETS))), "decision_count": 99,
            "decision_sum_s": 0.5}
    hist = {"buckets": list(STEP_BUCKETS), "counts": [3] * (len(STEP_BUCKETS) + 1), "sum": 2.0}
    report = {"lanes": {f"lane{i}": lane for i in range(lanes)},
              "step_model": {"a_s_per_token": 1e-6, "b_s": 0.02, "r2": 0.95, "samples": 200},
              "step_histogram": {"events": hist, "sse": hist}, "fidelity": {"load_rel_error": 0.01},
              "events": {"dropped": {"queue_full": 0}}}
    controller = SimpleNamespace(metrics=lambda: {
        "mode": "canary", "transitions": {("canary", "operator"): 1}, "pinned": False, "fallback": False,
        "trips": {}, "holddown_s": 0.0, "policy": "brh", "degraded": {}, "calibration_error": 0.05,
        "oracle_gap": 0.1})
    reg = CollectorRegistry()
    reg.register(MirrorCollector(mirror, analyzer=analyzer, queue=_Queue(), taps=taps,  # type: ignore[arg-type]
                                 reconciler=rec, clock=lambda: 2.0))  # type: ignore[arg-type]
    reg.register(LiveCollector(SimpleNamespace(report=lambda: report)))  # type: ignore[arg-type]
    reg.register(ModeCollector(controller, SimpleNamespace(lookups={"hit": 5, "miss": 1})))  # type: ignore[arg-type]
    active = ActiveMetrics(reg)
    for w in names:
        active.inflight.labels("decode", w).set(3)
        active.upstream_errors.labels("decode", w).inc(0)
    for mode in ("shadow", "active"):
        for bucket in ("lt512", "512-2k", "2k-8k", "ge8k"):
            active.first_token.labels(mode, bucket).observe(0.3)
            active.requests.labels(mode, "brh", "ok").inc()
    return reg


def measure(workers: int, lanes: int, scrapes: int) -> float:
    """One round's figure: CPU microseconds per scrape."""
    from prometheus_client import generate_latest

    reg = registry(workers, lanes)
    generate_latest(reg)  # warm
    t0 = time.process_time()
    for _ in range(scrapes):
        generate_latest(reg)
    return (time.process_time() - t0) / scrapes * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64, help="workers (taps, reconciled workers) G")
    ap.add_argument("--lanes", type=int, default=5, help="live lanes L, each with G per-worker series")
    ap.add_argument("--scrapes", type=int, default=400, help="scrapes timed per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per side (sides alternate)")
    ap.add_argument("--before", help="a checkout of the code to compare with (run from its directory)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child's single round
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.workers, args.lanes, args.scrapes)))
        return 0
    here = Path(__file__).resolve().parents[1]
    sides = {"after": str(here)} | ({"before": str(Path(args.before).resolve())} if args.before else {})
    figures: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side, root in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            out = subprocess.run(
                [sys.executable, __file__, "--one", "--workers", str(args.workers),
                 "--lanes", str(args.lanes), "--scrapes", str(args.scrapes)],
                env={**os.environ, "PYTHONPATH": root}, cwd=root, capture_output=True, text=True, check=True)
            figures[side].append(float(out.stdout))
    load = os.getloadavg()[0]
    for side, values in figures.items():
        print(f"SUMMARY {side}: {statistics.median(values):.1f} us/scrape median of {len(values)} rounds "
              f"({', '.join(f'{v:.0f}' for v in values)}); G={args.workers} L={args.lanes} load={load:.2f}")
    if args.before:
        ratio = statistics.median(figures["after"]) / statistics.median(figures["before"])
        print(f"RATIO after/before {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
