"""Before/after in one run: a bench of two checkouts, alternated, and the ratios of its figures.

    python bench/ab.py --before ../old-checkout decision engine live [--rounds 3]

Each round runs the bench of the `--before` checkout, then this checkout's (each its own
`bench/<name>.py` with PYTHONPATH on its own tree, so a bench that changed with the code measures
each side as it is), so both sides share the machine's noise. Per figure it prints the medians,
the ratio after / before and each side's spread (half its runs' range, of its median: the noise the
ratio is read against); per bench the geometric mean of the ratios of its own figures (each row
says whether lower or higher is better), and the CPU seconds of the whole run of each side.

Presets (arguments and what is read from the output):
  decision  bench_decision.py --quick --rounds 50 --clock cpu; P50 and P99 ms of one round per (G, waiting,
            policy)
  engine    bench_engine.py --lanes rr,jsq-bytes,br0,brh:survival (10,000 paper-azure requests at rho=1.1,
            G=8, B=64); M request-steps/s per lane (its perf_counter reads the CPU clock)
  live      bench_live.py --seconds 10 (G=64, B=256, 60 ms steps); CPU cores the lanes need
"""

from __future__ import annotations

import argparse
import math
import os
import re
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
#: The whole run's CPU seconds (user + system), a figure of every bench: on a shared machine the
#: wall-clock figures move with the neighbours, the CPU spent to do the same work much less.
CPU = "run CPU s"
#: Runs a bench script (argv[1]) with time.perf_counter reading the process's CPU clock.
CPU_CLOCK = ("import runpy, sys, time; time.perf_counter = time.process_time; sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")


@dataclass(frozen=True)
class Preset:
    script: str
    args: tuple[str, ...]
    read: Callable[[str], dict[str, float]]
    better: str  # "lower" or "higher"
    cpu_clock: bool = False  # the bench's perf_counter reads the process's CPU clock


def _decision(out: str) -> dict[str, float]:
    row = re.compile(r"^\s*(\d+)\s+(\d+)\s+\d+\s+(\S+)\s+([\d.]+)\s+([\d.]+)", re.M)
    out_ = {}
    for g, w, p, p50, p99 in row.findall(out):
        out_[f"G={g} waiting={w} {p} p50"] = float(p50)
        out_[f"G={g} waiting={w} {p} p99"] = float(p99)
    return out_


def _engine(out: str) -> dict[str, float]:
    row = re.compile(r"^\s*(\S+):\s+[\d.]+ s\s+([\d.]+) M request-steps/s", re.M)
    return {f"{lane} M steps/s": float(v) for lane, v in row.findall(out)}


def _live(out: str) -> dict[str, float]:
    # from the CPU seconds (two decimals of 10 s), not the rounded cores figure (0.01 = 3 %)
    m = re.search(r"lanes CPU: ([\d.]+) s for ([\d.]+) s of fleet time", out)
    return {"lanes CPU cores": float(m.group(1)) / float(m.group(2))} if m else {}


PRESETS = {
    "decision": Preset("bench_decision.py", ("--quick", "--rounds", "50", "--clock", "cpu"), _decision,
                       "lower"),
    "engine": Preset("bench_engine.py", ("--lanes", "rr,jsq-bytes,br0,brh:survival"), _engine, "higher",
                     cpu_clock=True),
    "live": Preset("bench_live.py", ("--seconds", "10"), _live, "lower"),
}


def run(tree: Path, preset: Preset) -> dict[str, float]:
    """One run of `preset` from `tree`'s bench directory with `tree` first on the import path."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    script = str(tree / "bench" / preset.script)
    cmd = [sys.executable, script, *preset.args]
    if preset.cpu_clock:
        cmd = [sys.executable, "-c", CPU_CLOCK, script, *preset.args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(cmd[1:])} exited {res.returncode}:\n{res.stderr[-2000:]}")
    figures = preset.read(res.stdout)
    if not figures:
        raise SystemExit(f"{tree}: no figures in the output of {preset.script}:\n{res.stdout[-2000:]}")
    figures[CPU] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return figures


def _spread(runs: list[dict[str, float]], key: str) -> float:
    """Half the range of one side's runs of a figure, as a fraction of their median (the noise a
    ratio is read against)."""
    xs = [r[key] for r in runs]
    med = statistics.median(xs)
    return (max(xs) - min(xs)) / 2 / med if med else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("benches", nargs="+", choices=sorted(PRESETS), help="which benches to compare")
    ap.add_argument("--before", required=True, type=Path, metavar="DIR", help="the other checkout")
    ap.add_argument("--rounds", type=int, default=3, help="alternated runs per side (default 3)")
    args = ap.parse_args()
    before = args.before.resolve()
    for name in args.benches:
        preset = PRESETS[name]
        runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        for k in range(args.rounds):
            for side, tree in (("before", before), ("after", HERE)):
                print(f"[{name}] round {k + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
                runs[side].append(run(tree, preset))
        keys = [key for key in runs["after"][0] if all(key in r for r in runs["before"] + runs["after"])]
        print(f"== {name}: {preset.script} {' '.join(preset.args)}; {args.rounds} alternated rounds; "
              f"load average {os.getloadavg()[0]:.1f} at the end")
        ratios = []
        for key in keys:
            b = statistics.median(r[key] for r in runs["before"])
            a = statistics.median(r[key] for r in runs["after"])
            ratio = a / b if b else math.nan
            better = "lower" if key == CPU else preset.better
            if key != CPU:
                ratios.append(ratio)
            print(f"  {key:<40} before {b:10.3f}  after {a:10.3f}  after/before {ratio:6.3f}  "
                  f"({better} is better; runs +-{_spread(runs['before'], key):.0%} / "
                  f"+-{_spread(runs['after'], key):.0%})")
        finite = [r for r in ratios if r > 0 and math.isfinite(r)]
        geo = math.exp(statistics.fmean(math.log(r) for r in finite)) if finite else math.nan
        print(f"  geometric mean after/before over the {len(finite)} figures of the bench: {geo:.3f}")


if __name__ == "__main__":
    main()
