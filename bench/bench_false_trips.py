"""False fallback trips on a loaded host (run on demand): `shadow serve --active` as operators run it
(default triggers and scrape interval) beside a router, healthy traffic, CPU burners, no fault.

    python bench/bench_false_trips.py [--minutes 30] [--burners 4] [--streams 12] [--mode canary]

Processes: a simulated P/D fleet (`shadow fleet`, 1 prefill, 2 decode ranks x 8 slots), the
`shadow router` stand-in pointed at shadow's taps, `shadow serve --active` (policy br0, mode
`--mode`, canary fraction 0.5, every trigger at its default), `--burners` processes that spin a core
each, and here `--streams` closed-loop `openai` streams (prompts of 64 or 700 words, max_tokens
20-200) to shadow's proxy: below the fleet's 16 slots, so nothing is overloaded but the host.
Every second /v1/mode is read; at the end the trips by reason, every transition with its detail,
what the clients got and the load average are printed, with one SUMMARY line. A healthy run has
0 trips; any trip it prints is a false one (there is no fault to find).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent


def _spin() -> None:
    while True:
        pass


def _free_run(n: int) -> int:
    """The first of n+1 consecutive free loopback ports (serve's layout: API, decode taps, prefill
    taps, front tap)."""
    for _ in range(200):
        base = random.randrange(20000, 30000)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SystemExit("no run of free loopback ports")


def _start(argv: list[str], log: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, "-m", "shadow", *argv], stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True, cwd=ROOT,
                            env={**os.environ, "OTEL_SDK_DISABLED": "true"})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip():
        raise SystemExit(f"{argv[0]} did not start: {log.read_text()[-2000:]}")
    return proc, json.loads(line)


class Clients:
    """Closed-loop streams to `url` until stop(); counts what the clients got."""

    def __init__(self, url: str, n: int, seed: int) -> None:
        self.url = url
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.got: dict[str, int] = {}
        self.threads = [threading.Thread(target=self._run, args=(random.Random(seed + i),), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _count(self, what: str) -> None:
        with self.lock:
            self.got[what] = self.got.get(what, 0) + 1

    def _run(self, rng: random.Random) -> None:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=120)
        while not self.stop_event.is_set():
            prompt = "x " * rng.choice((64, 700))
            want = rng.randint(20, 200)
            try:
                stream = client.completions.create(model="sim-llm", prompt=prompt, max_tokens=want,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
                got = 0
                finish = None
                for chunk in stream:
                    if chunk.usage is not None:
                        got = chunk.usage.completion_tokens
                    for c in chunk.choices:
                        finish = c.finish_reason or finish
                self._count("ok" if got == want and finish == "length" else "short")
            except openai.APIStatusError as exc:
                self._count(f"http {exc.status_code}")
            except openai.APIError as exc:
                self._count(type(exc).__name__)

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(150)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="minutes of traffic (default 30)")
    ap.add_argument("--burners", type=int, default=4, help="processes spinning a core each (default 4)")
    ap.add_argument("--streams", type=int, default=12, help="closed-loop client streams (default 12)")
    ap.add_argument("--mode", choices=("canary", "active"), default="canary")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for shadow serve (repeatable): --serve-arg=--scrape-interval=1")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-false-trips-"))
    burners = [mp.Process(target=_spin, daemon=True) for _ in range(args.burners)]
    procs: list[subprocess.Popen[str]] = []
    clients: Clients | None = None
    samples: list[dict[str, Any]] = []
    loads: list[float] = []
    try:
        fleet, fr = _start(["fleet", "--prefill", "1", "--decode", "2", "--slots", "8", "--port", "0"],
                           work / "fleet.log")
        procs.append(fleet)
        base = _free_run(4)
        router, rr = _start(["router", "--port", "0", "--decode", f"d0=http://127.0.0.1:{base + 1}",
                             "--decode", f"d1=http://127.0.0.1:{base + 2}",
                             "--prefill", f"p0=http://127.0.0.1:{base + 3}"], work / "router.log")
        procs.append(router)
        serve_argv = ["serve", "--port", str(base), "--front", f"router={rr['url']}", "--slots", "8",
                      "--mode", args.mode, "--canary-fraction", "0.5", "--active", "--active-policy", "br0",
                      "--state-dir", str(work / "state"), "--stop-taps", *args.serve_arg]
        for g, url in enumerate(fr["decode"]):
            serve_argv += ["--upstream", f"d{g}={url}"]
        serve_argv += ["--prefill", f"p0={fr['prefill'][0]}"]
        serve, sr = _start(serve_argv, work / "serve.log")
        procs.append(serve)
        for b in burners:
            b.start()
        print(f"shadow serve --active --mode {args.mode} beside shadow router; {args.burners} burners; "
              f"{args.streams} streams for {args.minutes:g} min; logs in {work}", file=sys.stderr, flush=True)
        clients = Clients(str(sr["active"]), args.streams, args.seed)
        end = time.monotonic() + args.minutes * 60
        next_note = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                doc = httpx.get(str(sr["api"]) + "/v1/mode", timeout=30).json()
                samples.append(doc)
            except httpx.HTTPError as exc:
                samples.append({"error": type(exc).__name__})
            loads.append(os.getloadavg()[0])
            if time.monotonic() >= next_note:
                last = next((s for s in reversed(samples) if "trips" in s), {})
                print(f"  {len(samples) // 60:3d} min: mode {last.get('current')}, "
                      f"trips {last.get('trips')}, clients {clients.got}, load {loads[-1]:.1f}",
                      file=sys.stderr, flush=True)
                next_note += 60
            time.sleep(1.0)
    finally:
        if clients is not None:
            clients.stop()
        for b in burners:
            b.kill()
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    last = next((s for s in reversed(samples) if "trips" in s), {})
    trips = last.get("trips", {})
    moves = [t for t in last.get("transitions", []) if t.get("to") == "fallback"]
    print(f"mode {args.mode}, {args.burners} burners, {args.streams} streams, {args.minutes:g} min; "
          f"load average mean {sum(loads) / max(1, len(loads)):.1f} (max {max(loads, default=0):.1f})")
    print(f"clients: {dict(sorted(clients.got.items())) if clients else {}}")
    print(f"/v1/mode reads failed: {sum(1 for s in samples if 'error' in s)} of {len(samples)}")
    for t in moves:
        print(f"  trip {t.get('at')}: {t.get('reason')}: {t.get('detail')}")
    print(f"SUMMARY false trips {sum(trips.values())} {dict(sorted(trips.items()))} in {args.minutes:g} min "
          f"under {args.burners} burners (load mean {sum(loads) / max(1, len(loads)):.1f}); "
          f"clients {dict(sorted(clients.got.items())) if clients else {}}")


if __name__ == "__main__":
    main()
