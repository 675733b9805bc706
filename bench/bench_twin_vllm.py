"""The twin on real vLLM: `shadow demo --fleet vllm` run headless, and how far its `actual` lane
(the router's real placements replayed in the lane engine) was from the fleet, per worker.

    python bench/bench_twin_vllm.py                           # 90 s, the two independent tiny servers
    python bench/bench_twin_vllm.py --duration 300 --runs 3   # longer, several runs
    python bench/bench_twin_vllm.py --demo-arg=--model-size --demo-arg=mid

Prints, per run: the load average before and after, the requests, the step-model windows, and the
twin's errors on the report's windows (`fidelity.twin`, time averages over windows of event time):
its KV against the engines' own (their probe's usage: the figure `fidelity.load_rel_error` gives
with `reference: engine`), its running requests against theirs, its placed load against the
mirror's (what the taps see: the HTTP side's delays included, which the lanes model by their mean,
`servers`); per worker and over all; with the servers' measured latencies and KV cache. The
figures are only as good as the host was quiet: say the load beside them (the lead's quiet-machine
figures are taken with load < 2 before the run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _pct(x: float | None) -> str:
    return "   –  " if x is None else f"{100 * x:5.1f}%"


def run_once(duration: float, demo_args: list[str], work: Path, i: int) -> dict[str, Any]:
    report = work / f"report-{i}.json"
    before = os.getloadavg()
    proc = subprocess.run(
        [sys.executable, "-m", "shadow", "demo", "--fleet", "vllm", "--headless", "--duration", str(duration),
         "--report-json", str(report), *demo_args],
        capture_output=True, text=True, timeout=duration + 1800, check=False)
    after = os.getloadavg()
    if proc.returncode != 0:
        raise RuntimeError(f"shadow demo exited {proc.returncode}: {proc.stderr[-3000:]}")
    doc: dict[str, Any] = json.loads(report.read_text())
    return {"doc": doc, "load_before": before, "load_after": after}


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1e3 * x:.1f}"


def show(i: int, out: dict[str, Any]) -> None:
    doc = out["doc"]
    fid = doc["fidelity"]
    twin = fid.get("twin") or {}
    before = " ".join(f"{x:.2f}" for x in out["load_before"])
    after = " ".join(f"{x:.2f}" for x in out["load_after"])
    demo = doc["demo"]
    print(f"run {i}: load average before {before}, after {after}; {demo['requests']} requests "
          f"({demo['requests_ok']} ok), {twin.get('windows')} twin windows of {twin.get('window_s')} s "
          f"({twin.get('engine_windows')} with engine steps)")
    print(f"  load_rel_error {_pct(fid.get('load_rel_error'))} (reference {fid.get('reference')}); "
          f"against the mirror, step-sampled: {_pct(fid.get('load_rel_error_mirror'))}")
    print("  worker    KV vs engine  running vs engine  placed vs mirror  front ms  back ms  KV tokens")
    servers = fid.get("servers") or {}
    for name, f in dict(twin.get("workers") or {}).items():
        s = servers.get(name, {})
        kv, running, placed = _pct(f.get("kv")), _pct(f.get("running")), _pct(f.get("placed"))
        print(f"  {name:8s}  {kv:>12s}  {running:>17s}  {placed:>16s}"
              f"  {_ms(s.get('front_s')):>8s}  {_ms(s.get('back_s')):>7s}  {s.get('kv_tokens')}")
    print(f"  all       {_pct(twin.get('kv_vs_engine')):>12s}  {_pct(twin.get('running_vs_engine')):>17s}"
          f"  {_pct(twin.get('placed_vs_mirror')):>16s}   (twin / real: {twin.get('ratio')})")
    clock = doc["step_model"].get("clock", {}).get("workers", {})
    models = {n: (m.get("model"), m.get("b_s"), m.get("c_s_per_seq"), m.get("p_s_per_token"))
              for n, m in clock.items()}
    print(f"  lanes' step models (kind, b, c, p): {models}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=90.0, help="the demo's --duration (default 90)")
    p.add_argument("--runs", type=int, default=1, help="demo runs, one after another (default 1)")
    p.add_argument("--demo-arg", action="append", default=[], help="one more argument for shadow demo")
    p.add_argument("--keep", metavar="DIR", default=None, help="keep the reports in DIR")
    args = p.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-twin-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"shadow demo --fleet vllm --headless --duration {args.duration:g} {' '.join(args.demo_arg)}; "
          f"{args.runs} run(s); reports in {work}")
    for i in range(args.runs):
        show(i, run_once(args.duration, args.demo_arg, work, i))
    return 0


if __name__ == "__main__":
    sys.exit(main())
