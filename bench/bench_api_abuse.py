"""`shadow serve --active` under a flood on its API/admin listener (run on demand): slowloris and
huge request heads while 100 streams run through the proxy.

    python3 bench/bench_api_abuse.py [--streams 100 --step-ms 60 --seconds 8]
                                     [--slowloris 2000 --huge 4 --huge-mb 64] [--before REF|DIR ...]

Processes: bench_tap's barrier-stepped SSE upstream; `shadow serve --active` (mode active, pinned)
in front of it; attacker processes; the clients here. Per configuration (this checkout, and each
`--before` commit or source directory, e.g. ec62bec: the listeners on uvicorn), two waves of
`streams` streams through the proxy, each interleaved with as many direct ones on the same upstream
steps: a quiet wave, then one while the API port takes `slowloris` connections that send a request
head one byte every 0.5 s and `huge` connections that each send up to `huge-mb` MB of header lines
as fast as the listener reads them (reconnecting until the wave ends). Reports per wave the added
per-chunk latency (proxy - direct, p50/p99), the serve process tree's RSS before the attack and at
its end, how a fresh client fares on the API during it (GET /v1/mode), and the listener's refusal
counts (this checkout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tap import ROOT, _load, _pct, _run_streams, _start_upstream, _tree


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants, MB."""
    total = 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _start_serve(root: Path, upstream_port: int) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    argv = [sys.executable, "-m", "shadow", "serve", "--upstream", f"u=http://127.0.0.1:{upstream_port}",
            "--slots", "4096", "--transfer-cap", "4096", "--scrape-interval", "3600", "--policies", "br0",
            "--active", "--mode", "active", "--pin-mode"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=root,
                            env=env)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def _slowloris_main(port: int, n: int, stop: Any, out: Any) -> None:
    """`n` connections, each sending a request head one byte at a time (0.5 s apart), reopened when
    the listener closes them."""
    _raise_nofile()
    head = b"GET /v1/mode HTTP/1.1\r\nHost: x\r\nx-slow: " + b"a" * 100_000

    async def one() -> tuple[int, int]:
        opened = closed = 0
        while not stop.is_set():
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            opened += 1
            try:
                for i in range(len(head)):
                    if stop.is_set():
                        break
                    w.write(head[i : i + 1])
                    await w.drain()
                    await asyncio.sleep(0.5)
            except OSError:
                closed += 1
            finally:
                w.close()
        return opened, closed

    async def main() -> list[tuple[int, int]]:
        return await asyncio.gather(*(one() for _ in range(n)))

    res = asyncio.run(main())
    out.put(("slowloris", sum(a for a, _ in res), sum(b for _, b in res)))


def _huge_main(port: int, n: int, mb: int, stop: Any, out: Any) -> None:
    """`n` connections writing header lines as fast as they are read, up to `mb` MB each."""
    line = b"x-pad: " + b"a" * 8000 + b"\r\n"

    async def one() -> tuple[int, int, int]:
        sent = answered = conns = 0
        while not stop.is_set():
            try:
                r, w = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            conns += 1
            try:
                w.write(b"GET /v1/mode HTTP/1.1\r\nHost: x\r\n")
                for _ in range((mb << 20) // len(line)):
                    if stop.is_set():
                        break
                    w.write(line)
                    await w.drain()
                    sent += len(line)
            except OSError:  # the listener answered (431) and closed
                pass
            with contextlib.suppress(OSError, TimeoutError):
                answered += (await asyncio.wait_for(r.read(64), 1.0)).startswith(b"HTTP/1.1 431")
            w.close()
        return sent, answered, conns

    async def main() -> list[tuple[int, int, int]]:
        return await asyncio.gather(*(one() for _ in range(n)))

    res = asyncio.run(main())
    out.put(("huge", sum(a for a, _, _ in res), sum(b for _, b, _ in res), sum(c for _, _, c in res)))


async def _probe_api(api: str, stop: asyncio.Event, failures: dict[str, int]) -> list[float]:
    """Fresh-connection GET /v1/mode every 0.25 s; latency in ms (inf: failed, counted in
    `failures` by status or exception)."""
    out: list[float] = []
    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = await c.get(api + "/v1/mode")
                ok = r.status_code == 200
                why = str(r.status_code)
            except httpx.HTTPError as exc:
                ok, why = False, type(exc).__name__
            out.append((time.monotonic() - t0) * 1e3 if ok else float("inf"))
            if not ok:
                failures[why] = failures.get(why, 0) + 1
            await asyncio.sleep(0.25)
    return out


def _wave(args: argparse.Namespace, up_port: int, proxy_port: int, tag: str) -> tuple[float, float]:
    direct: list[int] = []
    via: list[int] = []
    asyncio.run(_run_streams(up_port, 2 * args.streams, direct, tag, proxy_port, via))
    return _pct(via, 0.5) - _pct(direct, 0.5), _pct(via, 0.99) - _pct(direct, 0.99)


def _run(args: argparse.Namespace, name: str, root: Path) -> dict[str, Any]:
    tokens = max(2, int(args.seconds / (args.step_ms / 1000)))
    up, up_port = _start_upstream(args.step_ms / 1000, tokens, 8)
    serve, ready = _start_serve(root, up_port)
    api = ready["api"]
    proxy_port = int(ready["active"].rsplit(":", 1)[1])
    api_port = int(api.rsplit(":", 1)[1])
    res: dict[str, Any] = {"name": name}
    try:
        _wave(args, up_port, proxy_port, "warm")
        res["quiet_p50"], res["quiet_p99"] = _wave(args, up_port, proxy_port, "quiet")
        res["rss_before"] = _rss_mb(serve.pid)
        stop = mp.Event()
        out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        attackers = [
            mp.Process(target=_slowloris_main, args=(api_port, args.slowloris, stop, out), daemon=True),
            mp.Process(target=_huge_main, args=(api_port, args.huge, args.huge_mb, stop, out), daemon=True),
        ]
        for a in attackers:
            a.start()
        time.sleep(2.0)  # (a benchmark: let the attack build up before the wave)

        async def wave_and_probe() -> tuple[tuple[float, float], list[float]]:
            halt = asyncio.Event()
            probe = asyncio.create_task(_probe_api(api, halt, res.setdefault("failures", {})))
            added = await asyncio.to_thread(_wave, args, up_port, proxy_port, "attack")
            halt.set()
            return added, await probe

        (res["attack_p50"], res["attack_p99"]), probes = asyncio.run(wave_and_probe())
        res["rss_attack"] = _rss_mb(serve.pid)
        stop.set()
        for a in attackers:
            a.join(30)
        while not out.empty():
            item = out.get()
            res[item[0]] = item[1:]
        ok = sorted(p for p in probes if p != float("inf"))
        res["probes"] = (len(probes), len(ok), ok[len(ok) // 2] if ok else float("nan"),
                         ok[-1] if ok else 0.0)
        try:
            state = httpx.get(api + "/v1/state", timeout=30).json()
            res["listener"] = state.get("listeners", {}).get("api")
        except (httpx.HTTPError, ValueError):
            res["listener"] = None
    finally:
        serve.terminate()
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
        up.terminate()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--step-ms", type=float, default=60.0)
    ap.add_argument("--seconds", type=float, default=8.0, help="length of one wave of streams")
    ap.add_argument("--slowloris", type=int, default=2000, help="slowloris connections to the API port")
    ap.add_argument("--huge", type=int, default=4, help="connections sending endless heads to the API port")
    ap.add_argument("--huge-mb", type=int, default=64, help="MB of head each such connection sends at most")
    ap.add_argument("--before", metavar="REF|DIR", action="append", default=[],
                    help="also run the serve of git commit REF or of a source directory (first)")
    args = ap.parse_args()
    _raise_nofile()
    results = []
    with tempfile.TemporaryDirectory() as td:
        configs: list[tuple[str, Path]] = []
        for i, ref in enumerate(args.before):
            if Path(ref).is_dir():
                configs.append((f"before({ref})", Path(ref).resolve()))
                continue
            old = Path(td) / f"before{i}"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            configs.append((f"before({ref})", old))
        configs.append(("this checkout", ROOT))
        for name, root in configs:
            print(f"== {name}, load average {_load()}", flush=True)
            r = _run(args, name, root)
            results.append(r)
            n, ok, p50, worst = r["probes"]
            print(f"  quiet wave:  added p50 {r['quiet_p50']:.3f} ms  p99 {r['quiet_p99']:.3f} ms")
            print(f"  attack wave: added p50 {r['attack_p50']:.3f} ms  p99 {r['attack_p99']:.3f} ms")
            print(f"  serve RSS: {r['rss_before']:.0f} MB before the attack, {r['rss_attack']:.0f} MB "
                  "at its end")
            print(f"  API during the attack: {ok}/{n} fresh GET /v1/mode answered, p50 {p50:.1f} ms, "
                  f"worst {worst:.1f} ms; failed: {r.get('failures') or 'none'}")
            if "slowloris" in r:
                opened, closed = r["slowloris"]
                print(f"  slowloris: {opened} connections opened, {closed} closed on them")
            if "huge" in r:
                sent, answered, conns = r["huge"]
                print(f"  huge heads: {sent / 2**20:,.0f} MB sent over {conns} connections, "
                      f"{answered} answered 431")
            if r.get("listener"):
                print(f"  API listener: {r['listener']['connections']} connections at the end, refusals "
                      f"{ {k: v for k, v in r['listener']['rejected'].items() if v} }")
    for r in results:
        print(f"SUMMARY {r['name']}: added p99 quiet {r['quiet_p99']:.3f} ms, under attack "
              f"{r['attack_p99']:.3f} ms; RSS {r['rss_before']:.0f} -> {r['rss_attack']:.0f} MB; "
              f"API answered {r['probes'][1]}/{r['probes'][0]} (load {_load()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
