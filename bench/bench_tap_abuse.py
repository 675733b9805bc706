"""Tap under abuse (run on demand): event-API floods and half-open connections while streams relay.

    python3 bench/bench_tap_abuse.py [--pin] [--streams 256 --step-ms 60 --seconds 20]
                                     [--flood 1000000 --batch 150000] [--half-open 20000]

Reuses bench_tap's barrier-stepped SSE upstream and its interleaved direct/tap clients, with
`shadow tap` in its own process (loopback only).
Phase A (flood): while waves of `streams` SSE streams relay through the tap (and as many go direct on
the same upstream steps), another process POSTs `flood` arrive events with unique ids to the tap's
event API in NDJSON batches of `batch` events; the tap runs with --ttl 2 so the flooded requests
are also reaped (a million at a time) during the run. Reports chunk latency direct vs via the tap
and the added p50/p99 (target p99 <= 5 ms), the API's accepted count and the batch times.
Phase B (half-open): helper processes open `half-open` TCP connections to the tap that never send
a byte (the fd limit is raised in-process to its hard limit; the connections are split over
processes when one cannot hold them all); meanwhile streams relay, and afterwards a fresh client
runs 50 requests: all must be served. Reports the tap's connection count, evictions, and the
fresh client's latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tap import _pct, _pin, _run_streams, _start_tap, _start_upstream


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


def _flood_main(api: str, total: int, batch: int, out_q: mp.Queue) -> None:  # type: ignore[type-arg]
    accepted = 0
    times = []
    with httpx.Client(timeout=600) as c:
        sent = 0
        while sent < total:
            n = min(batch, total - sent)
            t = time.monotonic()  # the host's clock (event times beyond a minute of it are dropped)
            body = "".join(
                f'{{"type":"arrive","request_id":"f{sent + i:07d}","t":{t}}}\n' for i in range(n)
            ).encode()
            t0 = time.monotonic()
            r = c.post(api + "/v1/events", content=body)
            times.append(time.monotonic() - t0)
            if r.status_code == 200:
                accepted += r.json()["accepted"]
            sent += n
    out_q.put((accepted, times))


def _half_open_main(port: int, n: int, ready: mp.Event, done: mp.Event, out_q: mp.Queue) -> None:  # type: ignore[type-arg]
    _raise_nofile()
    socks = []
    failed = 0
    for _ in range(n):
        try:
            s = socket.socket()
            s.setblocking(True)
            s.connect(("127.0.0.1", port))
            socks.append(s)
        except OSError:
            failed += 1
    out_q.put((len(socks), failed))
    ready.set()
    done.wait(300)
    for s in socks:
        s.close()


def _metric(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


async def _fresh_client(port: int, n: int) -> list[float]:
    lat = []
    for _ in range(n):
        t0 = time.monotonic()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            out = await asyncio.wait_for(r.read(-1), 10)
            w.close()
        except (OSError, TimeoutError):
            continue
        if out.startswith(b"HTTP/1.1 200 "):
            lat.append(time.monotonic() - t0)
    return lat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=60.0)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of one wave of streams")
    ap.add_argument("--flood", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=150_000)
    ap.add_argument("--half-open", type=int, default=20_000)
    ap.add_argument("--tap-args", default="", help="extra `shadow tap` arguments (one string)")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="tap (all its processes and threads) on CPU 1, everything else on CPU 0",
    )
    args = ap.parse_args()

    def pin(tap_pid: int, up_pid: int) -> None:
        _pin(args, tap_pid, up_pid)

    tokens = max(2, int(args.seconds / (args.step_ms / 1000)))
    extra = ["--ttl", "2", *args.tap_args.split()]

    # -- phase A: API flood while streams relay ----------------------------------------------------
    up, up_port = _start_upstream(args.step_ms / 1000, tokens, args.groups)
    with tempfile.TemporaryDirectory() as td:
        tap, ready = _start_tap(up_port, os.path.join(td, "a.ndjson"), extra)
        pin(tap.pid, up.pid or 0)
        tap_port = int(ready["taps"]["u"].rsplit(":", 1)[1])
        try:
            q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
            flood = mp.Process(
                target=_flood_main, args=(ready["api"], args.flood, args.batch, q), daemon=True
            )
            direct: list[int] = []
            via: list[int] = []

            async def phase_a() -> int:
                # waves of streams until the flood is over (the first starts before it)
                first = asyncio.create_task(
                    _run_streams(up_port, 2 * args.streams, direct, "d0", tap_port, via)
                )
                await asyncio.sleep(0.5)
                flood.start()
                frames = await first
                wave = 1
                while flood.is_alive():
                    frames += await _run_streams(up_port, 2 * args.streams, direct, f"d{wave}", tap_port, via)
                    wave += 1
                return frames

            t0 = time.monotonic()
            frames = asyncio.run(phase_a())
            wall = time.monotonic() - t0
            accepted, times = q.get(timeout=600)
            flood.join(10)
            state = httpx.get(ready["api"] + "/v1/state", timeout=30).json()
            metrics = httpx.get(ready["api"] + "/metrics", timeout=30).text
        finally:
            tap.terminate()
            tap.wait(60)
            up.terminate()
    print(
        f"phase A: {args.streams} streams via the tap + {args.streams} direct, {tokens} chunks every "
        f"{args.step_ms:g} ms ({frames:,} chunks in {wall:.1f} s); meanwhile {args.flood:,} arrive events "
        f"in batches of {args.batch:,} to the API (tap --ttl 2: reaped during the run)"
    )
    print(
        f"  API accepted {accepted:,}; batch times {', '.join(f'{x:.2f}' for x in times)} s "
        f"(flood {sum(times):.1f} s of the {wall:.1f} s of streams)"
    )
    print(f"  chunk latency direct  p50 {_pct(direct, 0.5):.3f} ms  p99 {_pct(direct, 0.99):.3f} ms")
    print(f"  chunk latency via tap p50 {_pct(via, 0.5):.3f} ms  p99 {_pct(via, 0.99):.3f} ms")
    add50, add99 = _pct(via, 0.5) - _pct(direct, 0.5), _pct(via, 0.99) - _pct(direct, 0.99)
    print(f"  added by the tap:     p50 {add50:.3f} ms  p99 {add99:.3f} ms   (target p99 <= 5 ms)")
    events = _metric(metrics, "shadow_mirror_events_total")
    reaped = sum(v for k, v in events.items() if 'source="reaper"' in k)
    print(
        f"  mirror after: {sum(w['active'] for w in state['workers'].values())} active, reaper events "
        f"{reaped:,.0f}, drops {state['dropped']}, watermark {state.get('watermark')}"
    )

    # -- phase B: half-open connections ------------------------------------------------------------
    up, up_port = _start_upstream(args.step_ms / 1000, max(2, int(5 / (args.step_ms / 1000))), args.groups)
    with tempfile.TemporaryDirectory() as td:
        tap, ready = _start_tap(up_port, os.path.join(td, "b.ndjson"), args.tap_args.split())
        pin(tap.pid, up.pid or 0)
        tap_port = int(ready["taps"]["u"].rsplit(":", 1)[1])
        procs = []
        done = mp.Event()
        try:
            per = 9000  # each helper holds at most this many sockets (below common fd limits)
            n_left = args.half_open
            q2: mp.Queue = mp.Queue()  # type: ignore[type-arg]
            readies = []
            t0 = time.monotonic()
            while n_left > 0:
                n = min(per, n_left)
                ev = mp.Event()
                p = mp.Process(target=_half_open_main, args=(tap_port, n, ev, done, q2), daemon=True)
                p.start()
                procs.append(p)
                readies.append(ev)
                n_left -= n
            for ev in readies:
                ev.wait(300)
            opened = failed = 0
            for _ in procs:
                o, f = q2.get(timeout=60)
                opened += o
                failed += f
            t_open = time.monotonic() - t0
            direct_b: list[int] = []
            via_b: list[int] = []
            frames_b = asyncio.run(_run_streams(up_port, 64, direct_b, "hd", tap_port, via_b))
            lat = asyncio.run(_fresh_client(tap_port, 50))
            try:
                metrics = httpx.get(ready["api"] + "/metrics", timeout=30).text
            except httpx.HTTPError as exc:
                metrics = ""
                print(f"  (the tap's API failed: {exc!r})")
        finally:
            done.set()
            for p in procs:
                p.join(30)
            tap.terminate()
            tap.wait(60)
            up.terminate()
    conns = _metric(metrics, "shadow_mirror_tap_connections")
    rej = _metric(metrics, "shadow_mirror_tap_rejected_total")
    print(
        f"phase B: {opened:,} half-open connections opened to the tap in {t_open:.1f} s ({failed} failed to "
        f"connect); the tap holds {sum(conns.values()):,.0f} (cap 4096; evicted idle "
        f"{sum(v for k, v in rej.items() if 'evicted_idle' in k):,.0f}, busy "
        f"{sum(v for k, v in rej.items() if 'busy' in k):,.0f})"
    )
    print(
        f"  meanwhile 32 streams via the tap + 32 direct: {frames_b:,} chunks; added p99 "
        f"{_pct(via_b, 0.99) - _pct(direct_b, 0.99):.3f} ms"
    )
    lat_ms = sorted(x * 1000 for x in lat)
    p50 = lat_ms[len(lat_ms) // 2] if lat_ms else float("nan")
    worst = lat_ms[-1] if lat_ms else float("nan")
    print(
        f"  a fresh client afterwards: {len(lat)}/50 requests served; "
        f"latency p50 {p50:.2f} ms, max {worst:.2f} ms"
    )
    print(json.dumps({"added_p99_ms_flood": round(add99, 3), "served_after_half_open": len(lat)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
