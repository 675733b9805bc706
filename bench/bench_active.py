"""Active proxy benchmark (run on demand; run it with `nice -n 10` on a shared machine).

    python3 bench/bench_active.py [--rounds 2000] [--streams 120 --concurrency 8 --tokens 64]

Part 1 — decision time: one `Dispatcher` (the active proxy's, in-process) for G=8 decode workers
× B=64 slots, all slots running, 256 requests in the Prompt Pool (seeded prompt lengths); each
round frees one random running leg and runs the coalesced round that refills it (view merge +
`make_router` decision + bookkeeping), as at saturation. P50/P99 of the round per policy, wall
clock and the thread CPU time (on a shared machine the wall P99 mostly measures
preemption by other processes; the CPU time is the round's own cost). Target: P99 < 2 ms.

Part 2 — added latency: a plain simulated fleet (2 decode ranks, time-scale 1) and three paths to
it — direct to the ranks, `shadow serve --active` (proxy + taps, BR-0), and vllm-router (PyPI,
round_robin) — driven in interleaved batches by one async client (`--streams` streams per path,
`--concurrency` at once, `--tokens` tokens each). Time to first token and inter-chunk gap per
path (P50/P99), and the differences against direct. One run, all paths share the machine's noise.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry  # noqa: E402

from shadow.active.dispatcher import DispatchConfig, Dispatcher  # noqa: E402
from shadow.active.ledger import Ledger, NoSource  # noqa: E402
from shadow.active.metrics import ActiveMetrics  # noqa: E402
from shadow.base.procs import read_json_line, shadow_argv  # noqa: E402
from shadow.base.tools import find_executable  # noqa: E402
from shadow.contracts.modes import StaticModeSource  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def decision_bench(
    policy: str, rounds: int, workers: int = 8, slots: int = 64, pool: int = 256, seed: int = 1
) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)
    names = [f"d{g}" for g in range(workers)]
    ledger = Ledger(workers, slots, transfer_cap=slots)
    d = Dispatcher(
        DispatchConfig(names, slots, transfer_cap=slots, tick_s=3600.0),
        ledger,
        NoSource(workers),
        ActiveMetrics(CollectorRegistry()),
        StaticModeSource("active", policy),
    )
    n = 0

    def prompt() -> int:
        return int(min(8000, max(16, rng.lognormvariate(7.5, 1.0))))

    for g in range(workers):  # every slot running, with some generated tokens
        for _ in range(slots):
            ledger.dispatch(f"r{n}", g, prompt(), 0.0, 0.0)
            ledger.first_token(f"r{n}")
            ledger.progress(f"r{n}", rng.randrange(0, 500))
            n += 1
    for _ in range(pool):
        d.submit(f"r{n}", prompt(), 0.0, policy)
        n += 1
    d._scheduled = False
    times: list[float] = []
    cpu: list[float] = []
    for _ in range(rounds):
        running = list(ledger.legs)
        ledger.finish(rng.choice(running), 0.0)
        d.submit(f"r{n}", prompt(), 0.0, policy)  # a new arrival keeps the pool at 256
        n += 1
        d._scheduled = False
        t0, c0 = time.perf_counter(), time.thread_time()
        d._round()
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
        for rid in list(ledger.legs):
            ledger.first_token(rid)
    await d.stop()
    return times, cpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_health(url: str, proc: subprocess.Popen[Any], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy")


async def one_stream(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> tuple[float, list[float]]:
    body = {
        "model": "sim-llm",
        "prompt": f"b{i} " + "w " * 64,
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.status_code
        async for chunk in r.aiter_raw():
            if chunk:
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return arrivals[0] - t0, gaps


async def latency_bench(
    paths: dict[str, list[str]], streams: int, concurrency: int, tokens: int
) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {p: ([], []) for p in paths}
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for batch in range(0, streams, concurrency):
            for name, url in paths.items():  # interleaved batches: the same noise for every path
                res = await asyncio.gather(
                    *(
                        one_stream(client, url[(batch + k) % len(url)], batch + k, tokens)
                        for k in range(min(concurrency, streams - batch))
                    )
                )
                for ttft, gaps in res:
                    out[name][0].append(ttft)
                    out[name][1].extend(gaps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip-latency", action="store_true")
    a = ap.parse_args()

    print(
        "Part 1: decision round time, G=8 x B=64, 256 in the pool, one slot freed per round "
        f"({a.rounds} rounds)"
    )
    for policy in ("br0", "brh", "jsq-bytes", "rr"):
        t, c = asyncio.run(decision_bench(policy, a.rounds))
        print(
            f"  {policy:9} wall p50 {pct(t, 0.5) * 1e3:6.3f} p99 {pct(t, 0.99) * 1e3:7.3f} ms | "
            f"thread CPU p50 {pct(c, 0.5) * 1e3:6.3f} p99 {pct(c, 0.99) * 1e3:6.3f} ms"
        )
    if a.skip_latency:
        return

    procs: list[subprocess.Popen[Any]] = []
    try:
        fleet = subprocess.Popen(
            shadow_argv("fleet", "--prefill", "0", "--decode", "2", "--slots", "64", "--port", "0"),
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(fleet)
        decode = read_json_line(fleet, "fleet", 60)["decode"]
        args = ["serve", "--slots", "64", "--active", "--active-policy", "br0", "--scrape-interval", "1",
                "--stop-taps"]  # its tap group ends with it
        for i, u in enumerate(decode):
            args += ["--upstream", f"d{i}={u}"]
        serve = subprocess.Popen(shadow_argv(*args), stdout=subprocess.PIPE, text=True)
        procs.append(serve)
        # direct: the client itself alternates the two ranks (as round-robin routers do)
        paths = {"direct": list(decode), "shadow --active": [read_json_line(serve, "serve", 60)["active"]]}
        exe = find_executable("vllm-router")
        if exe is not None:
            port = _free_port()
            vr = subprocess.Popen(
                [
                    exe,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--worker-urls",
                    *decode,
                    "--policy",
                    "round_robin",
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    str(_free_port()),
                    "--worker-startup-check-interval",
                    "1",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(vr)
            _wait_health(f"http://127.0.0.1:{port}", vr)
            paths["vllm-router"] = [f"http://127.0.0.1:{port}"]
        else:
            print("  (vllm-router not installed: pip install -e '.[test]')")
        res = asyncio.run(latency_bench(paths, a.streams, a.concurrency, a.tokens))
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    print(
        f"\nPart 2: plain fleet (2 ranks, step 20 ms), {a.streams} streams x {a.tokens} tokens per path, "
        f"{a.concurrency} at once, interleaved batches"
    )
    d_ttft, d_gap = res["direct"]
    for name, (ttft, gaps) in res.items():
        print(
            f"  {name:16} TTFT p50 {pct(ttft, 0.5) * 1e3:7.2f} p99 {pct(ttft, 0.99) * 1e3:7.2f} ms | "
            f"chunk gap p50 {pct(gaps, 0.5) * 1e3:6.2f} p99 {pct(gaps, 0.99) * 1e3:6.2f} ms | "
            f"added vs direct: TTFT p50 {(pct(ttft, 0.5) - pct(d_ttft, 0.5)) * 1e3:+6.2f} ms, "
            f"mean gap {(statistics.fmean(gaps) - statistics.fmean(d_gap)) * 1e3:+6.3f} ms"
        )


if __name__ == "__main__":
    main()
