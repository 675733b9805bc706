"""Time-compressed soak of the live lanes: hours of a fleet's events, lane lag and RSS per hour.

    python bench/soak_lanes.py --load 1.2 --hours 6      # overload (the router's bounded queue sheds)
    python bench/soak_lanes.py --load 0.8 --hours 6
    python bench/soak_lanes.py --load 1.2 --hours 6 --rolling 60 --record rec.ndjson.gz --check-replay 12

Protocol: a synthetic "real" fleet of G decode workers × B slots steps every `--step-ms` (one token
per running request per step), behind a JSQ-bytes router with per-worker FIFO queues and a
bounded queue at the door (arrivals refused while N × G wait: they never reach the lanes).
Arrivals are Poisson at ρ × G·B / (mean output × step), paper-azure lengths with outputs ÷
`--divide` (time compression: a request lives seconds, not a minute). The fleet emits what a
mirror sees: Arrive + Route when a request is placed, a cumulative Token every `--token-every`
tokens, Finish at its end. `LiveLanes` (actual + `--policies`) take every event and advance to
the live clock after each step, as `shadow serve` does, in event time (no sleeping): an hour of
fleet time runs in seconds to minutes. Per row (every `--row-minutes` of fleet time, default an
hour): the largest lane lag seen and each lane's lag at the row's end (how far the lanes run
behind the newest event, event-time seconds), the requests held in the lanes' table, and the
process's resident memory (VmRSS). `--rolling W` re-seeds the lanes every W s (the rolling
counterfactual, `shadow serve --rolling`); `--record` writes the session as `shadow serve
--record` does (requests, seeds, header); `--check-replay K` then replays the recording window by
window (what `shadow replay REC` does) and compares every complete window with the live one, and
K windows replayed alone from their seeds. After the hours the fleet gets no more arrivals and
runs out, so every end is known.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.settings import LaneSettings
from shadow.fleet.events import ROUTES, EventFleet
from shadow.live.lanes import LiveLanes
from shadow.mirror.recording import CompactRecorder
from shadow.replay.experiment import ReplaySetup, as_recorded
from shadow.replay.rolled import run_rolled
from shadow.traces import load_trace, resolve


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1e3
    return 0.0


def make_fleet(g: int, b: int, step_s: float, rho: float, divide: int, queue: int, seed: int,
               token_every: int, route: str) -> EventFleet:
    """The "real" fleet and its router (see module docstring)."""
    trace = resolve("paper-azure", seed=seed, limit=20_000)
    lengths = [(r.prompt_tokens, max(1, r.output_tokens // divide)) for r in trace.requests]
    mean_out = sum(o for _, o in lengths) / len(lengths)
    rate = rho * g * b / (mean_out * step_s)
    return EventFleet(g, b, step_s, rate, lengths, random.Random(seed), route=route,
                      queue_cap=queue * g if queue > 0 else None, token_every=token_every)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=float, default=1.2, help="ρ against the fleet's capacity (default 1.2)")
    ap.add_argument("--hours", type=float, default=6.0, help="simulated hours (default 6)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=60.0)
    ap.add_argument("--divide", type=int, default=10, help="outputs ÷ this (default 10)")
    ap.add_argument("--queue", type=int, default=6,
                    help="router's bound: N × G waiting (default 6; 0: unbounded queues)")
    ap.add_argument("--token-every", type=int, default=8, help="a Token event every N tokens (default 8)")
    ap.add_argument("--policies", default="jsq-bytes,br0")
    ap.add_argument("--router", default="jsq-bytes", choices=ROUTES,
                    help="the real router (default jsq-bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row-minutes", type=float, default=60.0, help="a row every N simulated minutes")
    ap.add_argument("--rolling", type=float, default=0.0, metavar="W",
                    help="re-seed the lanes from the mirrored fleet every W s of lane time (0: off)")
    ap.add_argument("--record", metavar="FILE",
                    help="record the session as `shadow serve --record` does (requests, seeds, header)")
    ap.add_argument("--check-replay", type=int, default=0, metavar="K",
                    help="after the run (needs --record and --rolling): replay the recording window by "
                    "window and compare every complete window with the live one; also K windows alone")
    ap.add_argument("--json", metavar="OUT", help="write the per-hour rows as JSON")
    args = ap.parse_args()
    if args.check_replay and not (args.record and args.rolling):
        ap.error("--check-replay needs --record and --rolling")
    step_s = args.step_ms / 1e3
    fleet = make_fleet(args.workers, args.slots, step_s, args.load, args.divide, args.queue, args.seed,
                       args.token_every, args.router)
    live = LiveLanes(workers=[f"d{g}" for g in range(args.workers)], slots=args.slots,
                     policies=live_policies(args),
                     step=StepTimeModel(a=1e-12, b=step_s), lag_s=2.0, queue_size=10_000_000,
                     rolling_s=args.rolling or None, clock=lambda: fleet.t)
    settings = LaneSettings(policies=tuple(live_policies(args)), step=live.step, slots=args.slots, lag_s=2.0,
                            rolling_s=live.rolling_s)
    rec = (CompactRecorder(args.record, workers=live.workers, slots=args.slots, lanes=settings.to_json())
           if args.record else None)
    if rec is not None:
        live.seed_sink = rec.seed
    hour_steps = round(60 * args.row_minutes / step_s)
    rows = []
    worst = 0.0
    t0 = time.process_time()
    last_publish = 0.0
    steps = round(args.hours * 3600 / step_s)
    k = 0
    while k < steps or fleet.busy():  # after the hours, no arrivals: what runs ends (all ends known)
        k += 1
        fleet.arrivals = k <= steps
        for ev in fleet.step():
            live.listener(ev)
            if rec is not None:
                rec.write(ev)
        if rec is not None and k % 100 == 0:
            rec.flush()
        live.process_now()
        live.driver.advance_to(live.live_now())
        d = live.driver
        worst = max(worst, max(d.lag(lane) for lane in d.lanes))
        if fleet.t - last_publish >= 60.0:
            live._publish()
            last_publish = fleet.t
        if k % hour_steps == 0 and k <= steps:
            live._publish()
            rep = live.report()
            row = {"minute": round(k * step_s / 60, 1), "max_lag_s": round(worst, 2),
                   "lag_s": {lb: round(v["lag_s"], 2) for lb, v in rep["lanes"].items()},
                   "finished": {lb: v["requests_finished"] for lb, v in rep["lanes"].items()},
                   "open_requests": rep["requests"]["open"], "rss_mb": round(rss_mb(), 1),
                   "shed": fleet.shed, "arrived": fleet.arrived, "cpu_s": round(time.process_time() - t0, 1),
                   "windows": rep["rolling"]["windows_complete"],
                   "cut": {lb: v["windows_cut"] for lb, v in rep["lanes"].items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
            worst = 0.0
    live.drain()
    if rec is not None:
        rec.close()
    print(f"ρ={args.load:g}: G={args.workers} B={args.slots} step {args.step_ms:g} ms, outputs ÷ "
          f"{args.divide}, lanes actual,{args.policies}; {args.hours:g} simulated hours"
          + (f", re-seeded every {args.rolling:g} s" if args.rolling else ""))
    summary: dict[str, object] = {
        "max_lag_s": max(r["max_lag_s"] for r in rows) if rows else None,  # type: ignore[type-var]
        "rss_mb": [min(r["rss_mb"] for r in rows), max(r["rss_mb"] for r in rows)] if rows else None,  # type: ignore[type-var]
        "open_requests_max": max(r["open_requests"] for r in rows) if rows else None,  # type: ignore[type-var]
    }
    print(json.dumps({"summary": summary}), flush=True)
    if args.check_replay:
        summary["replay"] = check_replay(args.record, live, args.check_replay)
        print(json.dumps({"replay": summary["replay"]}), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows, "summary": summary}, fh, indent=1)


def live_policies(args: argparse.Namespace) -> list[str]:
    return [p for p in args.policies.split(",") if p]


def check_replay(path: str, live: LiveLanes, alone: int) -> dict[str, object]:
    """Replay the recording window by window (`shadow replay` does the same) and compare every
    complete, uncut live window's figures; then `alone` windows, evenly spread, each replayed alone
    from its seed (the lanes whose decisions depend only on the fleet they see)."""
    t0 = time.process_time()
    trace = load_trace(path)
    assert trace.lane_settings is not None
    setup, what_if = as_recorded(ReplaySetup(), trace.lane_settings, set())
    assert not what_if, what_if
    report = run_rolled(trace, setup)
    g = len(live.workers)
    out: dict[str, object] = {"seeds": len(trace.seeds), "requests": len(trace.recorded)}
    per_lane: dict[str, dict[str, int]] = {}
    for label in report.lanes:
        mine = {w.index: w for w in live.windows.series(label)}
        same = differ = cut = 0
        for w in report.windows[label]:
            lw = mine.get(w["index"])
            if lw is None:
                continue
            if lw.cut:
                cut += 1
            elif w == lw.figures(live.step, g):
                same += 1
            else:
                differ += 1
        per_lane[label] = {"equal": same, "differ": differ, "cut_live": cut}
    out["windows"] = per_lane
    n = len(trace.seeds)
    picks = sorted({1 + i * (n - 2) // max(alone - 1, 1) for i in range(alone)}) if n > 2 else []
    ok = bad = 0
    for only in picks:
        one = run_rolled(trace, setup, only=only)
        for label in ("actual", "jsq-bytes", "br0"):
            if label not in one.windows or not one.windows[label]:
                continue
            lw = {w.index: w for w in live.windows.series(label)}.get(only)
            if lw is None or lw.cut:
                continue
            if one.windows[label][0] == lw.figures(live.step, g):
                ok += 1
            else:
                bad += 1
    out["alone"] = {"windows": picks, "equal": ok, "differ": bad}
    out["cpu_s"] = round(time.process_time() - t0, 1)
    return out


if __name__ == "__main__":
    main()
