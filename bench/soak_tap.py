"""Tap memory soak: waves of SSE streams through one `shadow tap` for a long time; RSS over time.

    python3 bench/soak_tap.py [--minutes 60] [--streams 512] [--step-ms 60] [--tokens 100]

Reuses bench_tap's barrier-stepped upstream: every wave opens `streams` streams of `tokens`
chunks each (≈ 8.5 k chunks/s at the defaults), waits for all to end, and starts the next, so
request state churns continuously (new ids, pairing records, tombstones). The tap's resident
memory is sampled from /proc every 10 s; the report gives RSS at start, at mid-run and at the
end, and the growth over the second half (memory is "flat" when that growth is small against the
first half's, after the bounded tables fill).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tap import _run_streams, _start_tap, _start_upstream


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _soak(port: int, pid: int, args: argparse.Namespace) -> list[tuple[float, float, int]]:
    samples: list[tuple[float, float, int]] = []
    t0 = time.monotonic()
    deadline = t0 + 60 * args.minutes
    streams_done = 0
    next_sample = t0
    wave = 0
    while time.monotonic() < deadline:
        task = asyncio.create_task(_run_streams(port, args.streams, None, f"w{wave}"))
        while not task.done():
            now = time.monotonic()
            if now >= next_sample:
                samples.append((now - t0, _rss_mb(pid), streams_done))
                rss = samples[-1][1]
                print(f"  t={now - t0:7.0f} s  rss={rss:7.1f} MB  streams={streams_done}", flush=True)
                next_sample = now + 10
            await asyncio.sleep(0.5)
        await task
        streams_done += args.streams
        wave += 1
    samples.append((time.monotonic() - t0, _rss_mb(pid), streams_done))
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--streams", type=int, default=512)
    ap.add_argument("--step-ms", type=float, default=60.0)
    ap.add_argument("--tokens", type=int, default=100)
    args = ap.parse_args()
    upstream, port = _start_upstream(args.step_ms / 1000, args.tokens, 8)
    tap, ready = _start_tap(port, os.devnull, [])
    tap_port = int(ready["taps"]["u"].rsplit(":", 1)[1])
    try:
        samples = asyncio.run(_soak(tap_port, tap.pid, args))
    finally:
        tap.send_signal(signal.SIGINT)
        tap.wait(15)
        upstream.terminate()
    start, end = samples[0], samples[-1]
    mid = min(samples, key=lambda s: abs(s[0] - end[0] / 2))
    peak = max(s[1] for s in samples)
    print(f"soak {end[0] / 60:.1f} min, {end[2]:,} streams × {args.tokens} chunks through the tap")
    print(f"  RSS start {start[1]:.1f} MB, mid {mid[1]:.1f} MB, end {end[1]:.1f} MB, peak {peak:.1f} MB")
    print(f"  growth first half {mid[1] - start[1]:+.1f} MB, second half {end[1] - mid[1]:+.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
