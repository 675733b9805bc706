"""Tap overhead benchmark (run on demand): added latency per SSE chunk and mirrored chunks per CPU-second.

    python3 bench/bench_tap.py [--pin] [--streams 512 --step-ms 60 --seconds 8]
                               [--max-streams 128 --max-step-ms 4] [--tap-args "--relay thread"]
                               [--before REF|DIR ... --thread --repeat N]

Before/after in one run (what the coordinator re-measures; one SUMMARY line per configuration and
run, then medians and the ratio):

    nice -n 10 python3 bench/bench_tap.py --pin --before 653b9e4 --thread --repeat 3

653b9e4 is the relay before the hardening (hand-written framing, analysis inline on the relay
loop); "after" is this checkout: the data plane `shadow tap` (a supervisor and its relay) plus a
mirror-only analysis attached to it, the same work the earlier `shadow tap` did in its relay and
analysis processes (checkouts before the split run their own `shadow tap`); `--thread` adds this
checkout with the taps on a thread of the analysis' process.

Three processes: a barrier-stepped SSE upstream (streams dealt to 8 staggered groups, like DP
workers; every step it writes one vLLM-format chunk stamped with CLOCK_MONOTONIC to each stream of
a group), `shadow tap` in front of it (its own process or processes, CPU read from /proc for the
whole tree), and the clients here.
Phase 1 (fleet-like load: 512 streams at 60 ms ≈ 8.5 k chunks/s through the tap) runs as many
direct streams interleaved on the same upstream steps, so both paths share the machine's noise, and
reports per-chunk latency direct vs through the tap and the added p50/p99. Phase 2 drives the tap
at ~32 k chunks/s offered and reports mirrored chunks per tap CPU-second (user + system, all the
tap's processes), checking that nothing was lost (every stream's recorded Finish carries exactly
the tokens sent; drop and error counters are zero), with each tap process's CPU (user + system),
read/write syscalls, minor page faults and context switches per chunk (from /proc: where a
difference between two checkouts comes from). `--pin` gives the tap a core of its own (CPU 1,
every thread of every tap process; upstream and clients share CPU 0), as when one tap runs per
decode node. Targets: p99 added ≤ 1 ms, ≥ 20,000/s. Latency figures need a quiet machine: each
SUMMARY line carries the 1-minute load average.
Set BENCH_TAP_PROFILE=FILE to run the tap under cProfile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
_TS = re.compile(rb'"ts":(\d+)')
_CLK = os.sysconf("SC_CLK_TCK")


# -- upstream: barrier-stepped SSE server ------------------------------------------------------------


def _upstream_main(port_q: mp.Queue, step_s: float, tokens: int, groups: int) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        # streams are dealt to `groups` barrier groups (like DP workers) whose steps are staggered
        group_streams: list[list[list]] = [[] for _ in range(groups)]  # [transport, remaining, i]
        dealt = [0]

        class Proto(asyncio.Protocol):
            def connection_made(self, tr: asyncio.BaseTransport) -> None:
                self.tr = tr
                self.buf = b""

            def data_received(self, data: bytes) -> None:
                self.buf += data
                while True:
                    end = self.buf.find(b"\r\n\r\n")
                    if end < 0:
                        return
                    head = self.buf[:end].decode("latin-1")
                    m = re.search(r"(?i)content-length:\s*(\d+)", head)
                    n = int(m.group(1)) if m else 0
                    if len(self.buf) < end + 4 + n:
                        return
                    self.buf = self.buf[end + 4 + n :]
                    if head.startswith("GET /metrics"):
                        body = b"vllm:num_requests_running 0\n"
                        self.tr.write(
                            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: "
                            + str(len(body)).encode()
                            + b"\r\n\r\n"
                            + body
                        )
                        continue
                    self.tr.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                        b"transfer-encoding: chunked\r\n\r\n"
                    )
                    group_streams[dealt[0] % groups].append([self.tr, tokens, 0])
                    dealt[0] += 1

        loop = asyncio.get_running_loop()
        srv = await loop.create_server(Proto, "127.0.0.1", 0)
        port_q.put(srv.sockets[0].getsockname()[1])
        pad = "x" * 60
        nxt = time.monotonic()
        g = 0
        while True:
            nxt += step_s / groups
            delay = nxt - time.monotonic()
            await asyncio.sleep(max(0.0, delay))
            streams = group_streams[g]
            g = (g + 1) % groups
            alive = []
            for s in streams:
                tr, rem, i = s
                if rem <= 0 or tr.is_closing():
                    continue
                last = rem == 1
                fr = '"length"' if last else "null"
                data = (
                    'data: {"id":"cmpl-b","object":"text_completion","created":1,"model":"m","choices":'
                    f'[{{"index":0,"text":" t{i}{pad}","logprobs":null,"finish_reason":{fr},'
                    f'"stop_reason":null}}],"ts":{time.monotonic_ns()}}}\n\n'
                )
                if last:
                    data += "data: [DONE]\n\n"
                b = data.encode()
                out = b"%x\r\n%s\r\n" % (len(b), b)
                if last:
                    out += b"0\r\n\r\n"
                tr.write(out)
                s[1] = rem - 1
                s[2] = i + 1
                if s[1] > 0:
                    alive.append(s)
            streams[:] = alive

    asyncio.run(main())


# -- clients -----------------------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    def __init__(self, done: asyncio.Future, lat: list[int] | None) -> None:  # type: ignore[type-arg]
        self.done = done
        self.lat = lat
        self.frames = 0
        self.tail = b""

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        buf = self.tail + data
        self.tail = buf[-64:]
        if self.lat is not None:
            for m in _TS.finditer(data):
                self.lat.append(now - int(m.group(1)))
        self.frames += data.count(b'"ts":')
        if b"0\r\n\r\n" in buf and b"[DONE]" in buf and not self.done.done():
            self.done.set_result(self.frames)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(self.frames)


async def _run_streams(
    port: int, n: int, lat: list[int] | None, rid_prefix: str, port2: int = 0, lat2: list[int] | None = None,
    tokens: int = 100000,
) -> int:
    """n streams of `tokens` to `port` (the upstream ends each after its chunks, for length, so a
    request asks for exactly that many: the mirror takes max_tokens as the count of a stream that
    ended for length); with `port2`, every other stream goes there instead (recorded in lat2), so
    both paths share the same upstream steps and the same machine noise."""
    loop = asyncio.get_running_loop()
    futs = []
    trs = []
    body = b'{"model":"m","prompt":"p","stream":true,"max_tokens":%d}' % tokens
    for i in range(n):
        fut = loop.create_future()
        p, lt = (port2, lat2) if port2 and i % 2 else (port, lat)
        tr, _ = await loop.create_connection(lambda f=fut, lt=lt: _Client(f, lt), "127.0.0.1", p)
        tr.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"x-request-id: %s-%d\r\ncontent-length: %d\r\n\r\n%s" % (rid_prefix.encode(), i, len(body), body)
        )
        futs.append(fut)
        trs.append(tr)
    frames = await asyncio.gather(*futs)
    for tr in trs:
        tr.close()
    return sum(frames)


def _cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process."""
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(parts[11]) / _CLK, int(parts[12]) / _CLK


def _start_upstream(step_s: float, tokens: int, groups: int) -> tuple[mp.Process, int]:
    q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    p = mp.Process(target=_upstream_main, args=(q, step_s, tokens, groups), daemon=True)
    p.start()
    return p, q.get(timeout=10)


# The mirror-only analysis of the split layout (what `shadow tap` ran beside its relay before the
# data plane became a process of its own): attached to the tap group, or with the taps in-process.
_ANALYSIS_BOOT = """
import asyncio, json, sys
try:
    from shadow.mirror.config import MirrorConfig
    from shadow.mirror.service import MirrorService
except ImportError:  # a checkout before the analysis had its own config module (--before)
    from shadow.mirror.service import TapConfig as MirrorConfig, TapService as MirrorService
async def main():
    svc = MirrorService(MirrorConfig(**json.loads(sys.argv[1])))
    print(json.dumps(await svc.start()), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


class _UnderTest:
    """The tap (and its analysis) of one configuration: `pids` roots of the process trees whose CPU
    counts, `ready` = {"taps": ..., "api": ...}, `stop()`."""

    def __init__(self, procs: list[subprocess.Popen[str]], ready: dict) -> None:  # type: ignore[type-arg]
        self.procs = procs
        self.ready = ready

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def _popen(argv: list[str], root: Path) -> tuple[subprocess.Popen[str], dict]:  # type: ignore[type-arg]
    env = {**os.environ, "PYTHONPATH": str(root)}
    profile = os.environ.get("BENCH_TAP_PROFILE")
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    proc = subprocess.Popen([sys.executable, *prof, *argv], stdout=subprocess.PIPE, text=True, cwd=root,
                            env=env)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def _start_tap(upstream_port: int, record: str, extra: list[str], root: Path, state: str) -> _UnderTest:
    """Before the split (no relay.py: in shadow/mirror then, in shadow/dataplane since the analysis
    and the data plane became packages of their own): `shadow tap` ran the relay and the mirror's
    analysis itself. After it: the data plane `shadow tap` plus a mirror-only analysis attached to
    it (`--relay thread` in `extra`: one process, the taps in it)."""
    up = f"http://127.0.0.1:{upstream_port}"
    if not any((root / "shadow" / room / "relay.py").exists() for room in ("mirror", "dataplane")):
        proc, ready = _popen(["-m", "shadow.commands.tap", "--upstream", f"u={up}", "--scrape-interval", "0",
                              "--record", record, *extra], root)
        return _UnderTest([proc], ready)
    cfg = {"upstreams": {"u": up}, "scrape_interval_s": 0, "record": record, "relay": "process"}
    if "--relay" in extra and extra[extra.index("--relay") + 1] == "thread":
        cfg["relay"] = "thread"
        proc, ready = _popen(["-c", _ANALYSIS_BOOT, json.dumps(cfg)], root)
        return _UnderTest([proc], ready)
    tap, tready = _popen(["-m", "shadow", "tap", "--upstream", f"u={up}", "--state-dir", state,
                          "--name", "bench", *extra], root)
    cfg["attach"] = [tready["dir"]]
    analysis, ready = _popen(["-c", _ANALYSIS_BOOT, json.dumps(cfg)], root)
    return _UnderTest([tap, analysis], ready)


def _wait_analysis(api: str, rec: str, n: int, limit_s: float = 30.0) -> None:
    """Until the mirror has no request left and the recording holds `n` requests (or `limit_s`)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        state = httpx.get(api + "/v1/state").json()
        text = Path(rec).read_text() if os.path.exists(rec) else ""
        lines = len(re.findall(r'"type": ?"(?:request|finish)"', text))
        if sum(w["active"] for w in state["workers"].values()) == 0 and lines >= n:
            return
        time.sleep(0.1)


def _pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1e6 if xs else float("nan")


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (the tap may run parts of itself in child processes)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def _tree_cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process and its live descendants."""
    u = s = 0.0
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            a, b = _cpu_s(p)
            u, s = u + a, s + b
    return u, s


def _by_process(pids: list[int]) -> dict[int, tuple[str, float, float, int, int, int, int]]:
    """pid -> (its name, user and system CPU seconds, read and write syscalls, minor page faults,
    context switches) for every live process of the trees (threads' switches not counted)."""
    out = {}
    for p in [q for pid in pids for q in _tree(pid)]:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            name = " ".join(a.decode(errors="replace") for a in argv[1:4] if a).split("\n")[0][:40]
            io = dict(line.split(": ") for line in Path(f"/proc/{p}/io").read_text().splitlines())
            minflt = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[7])
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
            st = dict(ln.split(":\t") for ln in lines if ":\t" in ln)
            out[p] = (name, *_cpu_s(p), int(io["syscr"]), int(io["syscw"]), minflt,
                      int(st["voluntary_ctxt_switches"]) + int(st["nonvoluntary_ctxt_switches"]))
    return out


def _trees_cpu_s(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of several process trees."""
    u = s = 0.0
    for pid in pids:
        a, b = _tree_cpu_s(pid)
        u, s = u + a, s + b
    return u, s


def _pin(args: argparse.Namespace, tap_pids: list[int], up_pid: int) -> None:
    """--pin: every thread of the tap's processes on CPU 1; upstream and the clients on CPU 0."""
    if not (args.pin and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2):
        return
    for p in [q for pid in tap_pids for q in _tree(pid)]:
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), {1})
    os.sched_setaffinity(up_pid, {0})
    os.sched_setaffinity(0, {0})


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def _phase1(args: argparse.Namespace, root: Path, extra: list[str]) -> dict[str, float]:
    """Latency at fleet-like load: per-chunk latency direct vs through the tap, same upstream steps."""
    tokens = max(2, int(args.seconds / (args.step_ms / 1000)))
    up, up_port = _start_upstream(args.step_ms / 1000, tokens, args.groups)
    with tempfile.TemporaryDirectory() as td:
        tap = _start_tap(up_port, os.path.join(td, "p1.ndjson"), args.tap_args.split() + extra, root, td)
        _pin(args, tap.pids, up.pid or 0)
        tap_port = int(tap.ready["taps"]["u"].rsplit(":", 1)[1])
        try:
            direct: list[int] = []
            via: list[int] = []
            frames = asyncio.run(_run_streams(up_port, 2 * args.streams, direct, "d", tap_port, via, tokens))
        finally:
            tap.stop()
            up.terminate()
    rate = args.streams / (args.step_ms / 1000)
    print(
        f"phase 1: {args.streams} streams in {args.groups} staggered groups x {tokens} chunks every "
        f"{args.step_ms:g} ms (~{rate:,.0f} chunks/s)"
    )
    print(f"  (interleaved with as many direct streams on the same upstream steps; {frames:,} chunks in all)")
    print(f"  chunk latency direct  p50 {_pct(direct, 0.5):.3f} ms  p99 {_pct(direct, 0.99):.3f} ms")
    print(f"  chunk latency via tap p50 {_pct(via, 0.5):.3f} ms  p99 {_pct(via, 0.99):.3f} ms")
    add50, add99 = _pct(via, 0.5) - _pct(direct, 0.5), _pct(via, 0.99) - _pct(direct, 0.99)
    print(f"  added by the tap:     p50 {add50:.3f} ms  p99 {add99:.3f} ms   (target p99 <= 1 ms)")
    return {"p50": add50, "p99": add99}


def _phase2(args: argparse.Namespace, root: Path, extra: list[str]) -> dict[str, float]:
    """Throughput per tap CPU-second (all the tap's processes), nothing lost."""
    tokens2 = max(2, int(args.max_seconds / (args.max_step_ms / 1000)))
    up, up_port = _start_upstream(args.max_step_ms / 1000, tokens2, 1)
    with tempfile.TemporaryDirectory() as td:
        rec = os.path.join(td, "p2.ndjson")
        tap = _start_tap(up_port, rec, args.tap_args.split() + extra, root, td)
        ready = tap.ready
        _pin(args, tap.pids, up.pid or 0)
        tap_port = int(ready["taps"]["u"].rsplit(":", 1)[1])
        try:
            c0 = _trees_cpu_s(tap.pids)
            p0 = _by_process(tap.pids)
            t0 = time.monotonic()
            frames = asyncio.run(_run_streams(tap_port, args.max_streams, None, "x", tokens=tokens2))
            wall = time.monotonic() - t0
            _wait_analysis(ready["api"], rec, args.max_streams)
            c1 = _trees_cpu_s(tap.pids)
            p1 = _by_process(tap.pids)
            metrics = httpx.get(ready["api"] + "/metrics").text
            state = httpx.get(ready["api"] + "/v1/state").json()
        finally:
            tap.stop()
            up.terminate()
        # the recording: one `request` line per ended request (compact format), or `finish` events
        recs = [json.loads(line) for line in Path(rec).read_text().splitlines() if line.strip()]
        fins = [
            {"generated": r.get("output_tokens"), "reason": r.get("end")}
            for r in recs
            if r.get("type") == "request"
        ] + [r for r in recs if r.get("type") == "finish"]
    user, system = c1[0] - c0[0], c1[1] - c0[1]
    cpu = user + system
    dropped = sum(
        float(m.group(1)) for m in re.finditer(r"^shadow_mirror_dropped_total\{[^}]*\} (\S+)$", metrics, re.M)
    )
    errors = sum(
        float(m.group(1)) for m in re.finditer(r"^shadow_mirror_errors_total\{[^}]*\} (\S+)$", metrics, re.M)
    )
    exact = sum(1 for f in fins if f.get("generated") == tokens2 and f.get("reason") == "length")
    print(f"phase 2: {args.max_streams} streams x {tokens2} chunks every {args.max_step_ms:g} ms")
    print(
        f"  relayed {frames:,} chunks in {wall:.2f} s wall ({frames / wall:,.0f}/s); "
        f"tap CPU {cpu:.2f} s ({user:.2f} user + {system:.2f} system)"
    )
    print("  by process (CPU user + system; read, write syscalls, minor page faults and context switches"
          " per chunk):")
    relay = 0.0  # the tap group's processes (its supervisor and relay), not the attached analysis
    for pid, (name, u, s, r, w, f, c) in sorted(p1.items(), key=lambda kv: -kv[1][1] - kv[1][2]):
        _, u0, s0, r0, w0, f0, c0 = p0.get(pid, ("", 0.0, 0.0, 0, 0, 0, 0))
        per = ", ".join(f"{(a - b) / frames:6.3f}" for a, b in ((r, r0), (w, w0), (f, f0), (c, c0)))
        print(f"    {u - u0:5.2f} + {s - s0:5.2f} s  {per}  {name}")
        if "shadow tap" in name:
            relay += (u - u0) + (s - s0)
    print(f"  mirrored chunks per tap CPU-second: {frames / cpu:,.0f}   (target >= 20,000)")
    print(f"  chunks per relay CPU-second (the `shadow tap` processes): {frames / relay:,.0f}" if relay > 0
          else "  chunks per relay CPU-second: - (no `shadow tap` process: the relay runs in the analysis')")
    print(
        f"  lost: dropped={dropped:g} errors={errors:g}; finishes exact {exact}/{args.max_streams}; "
        f"active after: {sum(w['active'] for w in state['workers'].values())}"
    )
    return {"per_cpu_s": frames / cpu, "relay_per_cpu_s": frames / relay if relay > 0 else math.nan,
            "lost": dropped + errors + (args.max_streams - exact)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=512)
    ap.add_argument("--step-ms", type=float, default=60.0)
    ap.add_argument("--groups", type=int, default=8, help="staggered barrier groups (DP workers)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--max-streams", type=int, default=128)
    ap.add_argument("--max-step-ms", type=float, default=4.0)
    ap.add_argument("--max-seconds", type=float, default=8.0)
    ap.add_argument("--tap-args", default="", help="extra `shadow tap` arguments (one string)")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="give the tap CPU 1 to itself, upstream and clients CPU 0 (a tap per node, as deployed)",
    )
    ap.add_argument(
        "--before",
        metavar="REF|DIR",
        action="append",
        default=[],
        help="also run the tap of git commit REF (e.g. 653b9e4, the pre-hardening relay) or of a source "
        "directory, alternating with this checkout's, and print ratios (repeatable; default: this "
        "checkout only)",
    )
    ap.add_argument(
        "--thread",
        action="store_true",
        help="also run this checkout with `--relay thread` (analysis on a thread of the relay's process)",
    )
    ap.add_argument(
        "--variant",
        metavar="ARGS",
        action="append",
        default=[],
        help="also run this checkout with these extra `shadow tap` arguments (repeatable), "
        'e.g. "--analysis-nice 10"',
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration (default 1)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as td:
        configs: list[tuple[str, Path, list[str]]] = []
        for i, ref in enumerate(args.before):
            if Path(ref).is_dir():
                configs.append((f"before({ref})", Path(ref).resolve(), []))
                continue
            old = Path(td) / f"before{i}"
            old.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            configs.append((f"before({ref})", old, []))
        if args.thread:
            configs.append(("after(--relay thread)", ROOT, ["--relay", "thread"]))
        for v in args.variant:
            configs.append((f"after({v})", ROOT, v.split()))
        configs.append(("after(this checkout)" if len(configs) else "this checkout", ROOT, []))
        results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in configs}
        for run in range(args.repeat):
            for name, root, extra in configs:
                print(f"== {name}, run {run + 1}/{args.repeat}, load average {_load()}")
                r = {**_phase1(args, root, extra), **_phase2(args, root, extra), "load": float(_load())}
                results[name].append(r)
                print(
                    f"SUMMARY {name} run {run + 1}: chunks/tap-CPU-s {r['per_cpu_s']:,.0f}  "
                    f"chunks/relay-CPU-s {r['relay_per_cpu_s']:,.0f}  "
                    f"added p50 {r['p50']:.3f} ms  p99 {r['p99']:.3f} ms  lost {r['lost']:g}  "
                    f"load {r['load']:.2f}"
                )
    print("== summary (median over runs)")
    med: dict[str, dict[str, float]] = {}
    for name, rs in results.items():
        keys = ("per_cpu_s", "relay_per_cpu_s", "p50", "p99")
        med[name] = {k: statistics.median(r[k] for r in rs) for k in keys}
        m = med[name]
        per = [r["per_cpu_s"] for r in rs]
        m["spread"] = (max(per) - min(per)) / 2 / m["per_cpu_s"]  # half the runs' range, of the median
        print(
            f"SUMMARY {name}: chunks/tap-CPU-s {m['per_cpu_s']:,.0f} (runs {min(per):,.0f}-{max(per):,.0f}, "
            f"+-{m['spread']:.0%}) (target >= 20,000)  added p50 "
            f"{m['p50']:.3f} ms  p99 {m['p99']:.3f} ms (target <= 1 ms)  runs {len(rs)}  "
            f"load {min(r['load'] for r in rs):.2f}-{max(r['load'] for r in rs):.2f}"
        )
    if len(med) >= 2:
        *olds, (an, a) = med.items()
        for bn, b in olds:
            print(
                f"SUMMARY ratio {an} / {bn}: chunks/tap-CPU-s {a['per_cpu_s'] / b['per_cpu_s']:.2f}x "
                f"chunks/relay-CPU-s {a['relay_per_cpu_s'] / b['relay_per_cpu_s']:.2f}x "
                f"(the same checkout's runs: +-{a['spread']:.0%} and +-{b['spread']:.0%})  "
                f"p99 added {a['p99']:.3f} vs {b['p99']:.3f} ms  "
                f"p50 added {a['p50']:.3f} vs {b['p50']:.3f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
