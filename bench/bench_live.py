"""Live lanes' CPU: lanes actual, jsq-bytes, br0, brh beside a G=64 × B=256 fleet at 60 ms steps.

    python bench/bench_live.py                    # G=64, B=256, 60 ms steps, 20 s measured
    python bench/bench_live.py --workers 8 --slots 64 --seconds 10

Protocol: a synthetic fleet at full occupancy (G·B streams, paper-azure prompt/output lengths,
arrivals replacing finishes one for one, placed by the JSQ-bytes rule as the "real" router) emits
the events a mirror produces: Arrive + Route per request, a cumulative Token per stream per
decode step (every step: the worst case, nothing coalesced), Finish at its end. The fleet starts
full (ages drawn uniformly), a warm-up of `--warmup` seconds is excluded, then `--seconds` of
event time are measured. The events are generated in chunks of one step and timed apart; the
figure is the CPU seconds of `LiveLanes` (queue intake, event folding, step-time windows, fit,
fidelity, agreement, all lanes advancing, snapshots every 0.25 s) per second of fleet time —
under 1.0 means the lanes keep up on one core.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

from shadow.contracts.events import Arrive, Event, Finish, Route, Token
from shadow.live.lanes import LiveLanes
from shadow.traces import resolve


class Fleet:
    """The synthetic "real" fleet: G·B running streams, one token each per step."""

    def __init__(self, workers: int, slots: int, step_s: float, seed: int) -> None:
        self.g, self.b, self.step_s = workers, slots, step_s
        trace = resolve("paper-azure", seed=seed, limit=20_000)
        self.lengths = [(r.prompt_tokens, r.output_tokens) for r in trace.requests]
        self.rng = random.Random(seed)
        self.next_id = 0
        self.pending: list[Event] = []
        self.t = 1000.0
        self.outstanding = [0.0] * workers  # JSQ-bytes: prompt tokens of running requests
        # stream: [rid, worker, prompt, output, generated]
        self.streams: list[list[object]] = []
        for _ in range(workers * slots):
            self.streams.append(self._new(age=True))

    def _new(self, age: bool = False) -> list[object]:
        s, o = self.lengths[self.next_id % len(self.lengths)]
        rid = f"r{self.next_id}"
        self.next_id += 1
        g = min(range(self.g), key=lambda i: (self.outstanding[i], i))
        self.outstanding[g] += s
        gen = self.rng.randrange(o) if age else 0
        self.pending.append(Arrive(rid, self.t, s))
        self.pending.append(Route(rid, self.t, f"d{g}", s))
        return [rid, g, s, o, gen]

    def step(self) -> list[Event]:
        """One decode step of event time: tokens for every stream, finishes, replacements."""
        self.t += self.step_s
        out = self.pending
        self.pending = []
        t = self.t
        keep: list[list[object]] = []
        ended = 0
        for st in self.streams:
            st[4] = gen = int(st[4]) + 1  # type: ignore[call-overload]
            out.append(Token(st[0], t, gen))  # type: ignore[arg-type]
            if gen >= int(st[3]):  # type: ignore[call-overload]
                out.append(Finish(st[0], t, "stop", gen))  # type: ignore[arg-type]
                self.outstanding[int(st[1])] -= int(st[2])  # type: ignore[call-overload]
                ended += 1
            else:
                keep.append(st)
        self.streams = keep
        for _ in range(ended):
            self.streams.append(self._new())
        out.extend(self.pending)
        self.pending = []
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=60.0)
    ap.add_argument("--seconds", type=float, default=20.0, help="measured fleet seconds (default 20)")
    ap.add_argument("--warmup", type=float, default=5.0, help="fleet seconds not measured (default 5)")
    ap.add_argument("--policies", default="jsq-bytes,br0,brh:survival")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lane-clock", choices=("measured", "configured"), default="measured",
                    help="the lanes' step clock, as shadow serve's --lane-clock (default measured; "
                    "configured = the step model alone, what checkouts before the measured clock ran)")
    args = ap.parse_args()
    step_s = args.step_ms / 1e3
    fleet = Fleet(args.workers, args.slots, step_s, args.seed)
    workers = [f"d{g}" for g in range(args.workers)]
    # lanes simulate the same step time as the fleet's (a=0: 60 ms whatever the load)
    from shadow.core.stepmodel import StepTimeModel

    live = LiveLanes(
        workers=workers,
        slots=args.slots,
        policies=[p for p in args.policies.split(",") if p],
        step=StepTimeModel(a=1e-12, b=step_s),
        lag_s=2.0,
        queue_size=10_000_000,
        lane_clock=args.lane_clock,
    )
    steps_warm = round(args.warmup / step_s)
    steps_meas = round(args.seconds / step_s)
    gen_s = cpu_s = 0.0
    events = 0
    last_publish = 0.0
    rss_warm = 0.0
    for k in range(steps_warm + steps_meas):
        g0 = time.process_time()
        batch = fleet.step()
        g1 = time.process_time()
        for ev in batch:
            live.listener(ev)
        live.process_now()
        live.driver.advance_to(live.driver.now)
        if fleet.t - last_publish >= 0.25:
            live._publish()
            last_publish = fleet.t
        g2 = time.process_time()
        if k == steps_warm:
            rss_warm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
        if k >= steps_warm:
            gen_s += g1 - g0
            cpu_s += g2 - g1
            events += len(batch)
    rss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    rep = live.report()
    lanes = ", ".join(f"{k} {v['steps']} steps" for k, v in rep["lanes"].items())
    print(
        f"G={args.workers} B={args.slots} step={args.step_ms:g} ms; lanes: actual,{args.policies}; "
        f"{args.seconds:g} s measured after {args.warmup:g} s warm-up; {events:,} events "
        f"({events / args.seconds:,.0f}/s)"
    )
    print(
        f"live lanes CPU: {cpu_s:.2f} s for {args.seconds:g} s of fleet time = {cpu_s / args.seconds:.2f} "
        "core"
    )
    print(
        f"(event generation, not counted: {gen_s:.2f} s); max RSS {rss_warm:.0f} MB after warm-up, "
        f"{rss_end:.0f} MB at the end"
    )
    print(
        f"lanes: {lanes}; open requests {rep['requests']['open']}, stalls "
        f"{sum(v['lookahead_stalls'] for v in rep['lanes'].values())}"
    )


if __name__ == "__main__":
    main()
