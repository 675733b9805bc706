"""The whole analysis path at fleet scale (run on demand): tokens per analysis CPU-second, lag, RSS.

    python bench/bench_analysis.py                          # G×B = 64×256, then 256×256; 60 ms steps
    python bench/bench_analysis.py --fleet 64x256 --seconds 1 --coalesce 4
    python bench/bench_analysis.py --fleet 256x256 --no-check

What `shadow serve` runs between the attach channel and `/v1/report`, in one process, fed the
frames a relay sends: attach-channel bytes (`shadow.contracts.frames`: info, start, data, end) read
in 1 MiB reads as the attachment reads them → `ChannelReader` → `MirrorService`'s analysis
(`Analyzer`: vLLM SSE parsing, per-stream folding, Arrive/Route/Token/Finish into the `Mirror` and
its state) → the live lanes (`LiveLanes` of a `ServeService`: queue intake, step-time windows and
fit, fidelity, agreement, lanes actual + `--policies` advancing, a snapshot every 0.25 s of fleet
time) → the report.

Protocol: a synthetic decode fleet of G workers × B slots, full from the start (ages drawn
uniformly; paper-azure prompt/output lengths, seed `--seed`), all workers stepping together every
`--step-ms`; every step each running stream's tap sends one data frame holding one vLLM-format
SSE chunk (`--coalesce K`: one frame of K chunks every K steps, the second case: vLLM merging
tokens when its HTTP side lags, or a relay read holding several); a finished stream's last frame
carries a usage chunk (the tokens it sent: a stream under way at the start counts from there) and
`[DONE]`, then its end frame; a new request takes its slot in the same
step (JSQ by outstanding prompt tokens, like the "real" router). The first `--warmup` fleet
seconds are not measured. The analysis' clock is the fleet's (event time), so a run is a function
of its input. The process collects garbage as `shadow serve` does once started (`tune_gc`).
Frames are generated per step and their generation is not counted.

Figures: tokens (decode chunks' tokens) per analysis CPU-second (process CPU, user + system, of
the decoding, analysis and lanes; split per stage), and the fleet's token rate it is fed at; lag:
the analysis is modelled as one core serving the steps in order (lag_k = max(0, lag_{k-1} +
cpu_k − step)), its maximum and last value printed; when CPU per fleet-second is over 1 the lag
grows without bound (its slope is printed); RSS: peak and current after the run.

Check (unless `--no-check`): the same input is run again as the reference — the single-process
path, reads of `--check-read` bytes (default 1 MiB, as the fast run; 4093 splits frames everywhere
and analyses each read on its own), the lanes taking their queue every `--check-lanes-every` steps
(default 1, as the fast run; 0: after every read) — and the report's figures (lanes, fidelity, step
fit, agreement, requests; everything but decision times and the host's load) must equal the fast
run's; a difference is printed and the exit status is 1. Before 2026-12-07 the figures depended
on how the input was batched (docs/scale.md, "What batching changes"); now they must not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from shadow.app.serve import ServeConfig, ServeService
from shadow.base.runtime import ANALYSIS_YOUNG, tune_gc
from shadow.contracts.events import Event
from shadow.contracts.frames import (
    DATA,
    DATA_FIXED,
    START,
    START_LEN,
    T_DATA,
    T_START,
    Info,
    encode_end,
    encode_info,
)
from shadow.mirror.api import ingest_ndjson
from shadow.mirror.channel_reader import ChannelReader
from shadow.mirror.config import MirrorConfig
from shadow.mirror.hub import event_line
from shadow.mirror.service import MirrorService
from shadow.traces import resolve

READ = 1 << 20  # an attachment's read (shadow.mirror.attach)
PUBLISH_S = 0.25
T0 = 1000.0
_PAD = "x" * 24
SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "transfer-encoding": "chunked"}
# report fields that measure this process (CPU, wall time, the host), not the traffic
VOLATILE = frozenset({"host_load_average", "busy_s"})
VOLATILE_PREFIX = ("decision_",)  # a lane's decision times (perf_counter)


_HEAD = 'data: {"id":"cmpl-%s","object":"text_completion","created":1,"model":"m","choices":'
_TOKEN = _HEAD + '[{"index":0,"text":" t%d%s","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
_LAST = (_HEAD + '[{"index":0,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null}],'
         '"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}}\n\ndata: [DONE]\n\n')


def chunk(i: int, rid: str) -> str:
    """One vLLM completions SSE event of one token."""
    return _TOKEN % (rid, i, _PAD)


def last_chunk(rid: str, prompt: int, output: int) -> str:
    """The last event (finish reason, usage) and [DONE]."""
    return _LAST % (rid, prompt, prompt + output, output)


class FleetFrames:
    """The relay's frames of a synthetic G×B fleet, step by step (deterministic given the seed)."""

    def __init__(self, workers: int, slots: int, step_s: float, coalesce: int, seed: int) -> None:
        self.g, self.b, self.step_s, self.k = workers, slots, step_s, coalesce
        trace = resolve("paper-azure", seed=seed, limit=20_000)
        self.lengths = [(r.prompt_tokens, max(1, r.output_tokens)) for r in trace.requests]
        self.rng = random.Random(seed)
        self.next_id = 0
        self.t = T0
        self.outstanding = [0] * workers
        self.tokens = 0  # decode tokens sent
        self.frames = 0
        # stream: [cid, worker, prompt, output, generated, pending SSE text, rid, seq, age at the start]
        self.streams: list[list[Any]] = []
        self.out: list[bytes] = []
        for _ in range(workers * slots):
            self.streams.append(self._new(age=True))

    def _new(self, age: bool = False) -> list[Any]:
        s, o = self.lengths[self.next_id % len(self.lengths)]
        self.next_id += 1
        cid = self.next_id
        rid = f"r{cid}"
        g = min(range(self.g), key=lambda i: (self.outstanding[i], i))
        self.outstanding[g] += s
        gen = self.rng.randrange(o) if age else 0
        body = json.dumps({"model": "m", "prompt": "w " * s, "max_tokens": o, "stream": True}).encode()
        info = Info(cid, f"d{g}", "POST", "/v1/completions", rid, body, len(body), self.t, 200, SSE_HEADERS,
                    None)
        self.out.append(encode_info(info))
        self.out.append(START.pack(T_START, START_LEN, cid, self.t))
        self.frames += 2
        return [cid, g, s, o, gen, [], rid, 0, gen]

    def step(self) -> bytes:
        """One decode step: every stream's token (sent every `coalesce` steps), ends, new requests."""
        self.t += self.step_s
        t, k, out = self.t, self.k, self.out
        ended = 0
        for st in self.streams:
            st[4] = gen = st[4] + 1
            st[5].append(chunk(gen, st[6]))
            self.tokens += 1
            last = gen >= st[3]
            if last:
                # usage counts the tokens this stream sent (a stream under way at the start sent
                # fewer than its output): as a real engine's, whose streams the taps see whole
                st[5].append(last_chunk(st[6], st[2], st[3] - st[8]))
            if last or len(st[5]) >= k:
                payload = "".join(st[5]).encode()
                st[5] = []
                st[7] += 1
                out.append(DATA.pack(T_DATA, DATA_FIXED + len(payload), st[0], st[7], t) + payload)
                self.frames += 1
            if last:
                out.append(encode_end(st[0], t, "complete", st[7], st[0]))
                self.frames += 1
                self.outstanding[st[1]] -= st[2]
                ended += 1
        # the finished leave their slots to as many new requests (placed now, streaming next step)
        self.streams = [st for st in self.streams if st[4] < st[3]] + [self._new() for _ in range(ended)]
        data = b"".join(out)
        out.clear()
        return data


class Clock:
    """The analysis' clock: the fleet's time."""

    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


def tap_config(workers: int, slots: int, token_interval_s: float) -> MirrorConfig:
    return MirrorConfig(
        upstreams={f"d{g}": f"http://127.0.0.1:{9000 + g}" for g in range(workers)}, slots=slots,
        scrape_interval_s=0, relay="process", attach=("unix:/nonexistent.sock",),
        event_skew_s=3600.0, token_interval_s=token_interval_s)


def service(workers: int, slots: int, step_s: float, policies: str, clock: Callable[[], float],
            shards: int = 0, ray: str | None = None, token_interval_s: float = 0.0) -> ServeService:
    """`shadow serve`'s analysis objects, not started (no sockets, no threads): driven by hand."""
    tap = tap_config(workers, slots, token_interval_s)
    cfg = ServeConfig(tap=tap, policies=tuple(p for p in policies.split(",") if p), step_a=1e-12,
                      step_b=step_s, live_queue_size=100_000_000, lane_shards=shards, lane_ray=ray)
    return ServeService(cfg, clock=clock)


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reads(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


class NodeStage:
    """`--stage`: the per-node part — the relay's frames → `ChannelReader` → the analysis
    (`Analyzer`, a `Mirror` whose Tokens pass the hold) → its events as the NDJSON lines `--forward`
    posts (`Emitter`). One object stands for every node: its CPU per token is what G nodes
    spend between them."""

    def __init__(self, g: int, b: int, interval: float, clock: Callable[[], float]) -> None:
        self.svc = MirrorService(tap_config(g, b, interval), clock=clock, listeners=[self._line])
        self.reader = ChannelReader()
        self.lines: list[str] = []

    def _line(self, ev: Event) -> None:
        self.lines.append(event_line(ev))

    def feed(self, data: bytes, read: int) -> bytes:
        """The step's frames in; the events it let out, as one NDJSON body."""
        for part in reads(data, read):
            self.svc._on_items(self.reader, self.reader.feed(part))
        return self.take()

    def take(self) -> bytes:
        body = "\n".join(self.lines).encode()
        self.lines.clear()
        return body


class Run:
    """One pass over the input: the service, the reader, per-stage CPU, the lag model. With
    `stage`, the frames go through a `NodeStage` and its NDJSON into this (central) service's event
    API (`ingest_ndjson`), as `shadow serve --forward` nodes feed a central `shadow serve`."""

    def __init__(self, args: argparse.Namespace, g: int, b: int, read: int, shards: int = 0,
                 lanes_every: int = 1, stage: bool = False) -> None:
        self.args, self.read = args, read
        self.lanes_every = lanes_every  # steps between the lanes' runs (0: after every read)
        self.k = 0
        self.step_s = args.step_ms / 1e3
        self.clock = Clock()  # the analysis' clock: event time (a shard replays the lanes' moves)
        interval = args.token_interval
        self.node = NodeStage(g, b, interval, self.clock) if stage else None
        # (with a stage, the centre's own interval holds no Tokens — it has no taps — but tells its
        # lanes the Tokens come held, as `shadow serve --token-interval` at the centre of nodes does)
        self.svc = service(g, b, self.step_s, args.policies, self.clock, shards, args.ray, interval)
        self.live = self.svc.live
        self.reader = ChannelReader()
        self.fleet = FleetFrames(g, b, self.step_s, args.coalesce, args.seed)
        self.cpu = {"decode": 0.0, "analysis": 0.0, "lanes": 0.0}
        self.node_cpu = 0.0
        self.shard_cpu_warm: float | None = None  # the shard processes' CPU when the measure began
        self.shard_cpu_measured = 0.0
        self.rejected: dict[str, int] = {}
        self.events_in = 0  # events the centre took (stage)
        self.gen_s = 0.0
        self.lag = self.lag_max = 0.0
        self.last_publish = T0
        self.tokens = self.frames = 0

    def lanes(self) -> None:
        live = self.live
        live.process_now()
        live.advance_to(live.driver.now)
        if self.clock.t - self.last_publish >= PUBLISH_S:
            live._publish()
            self.last_publish = self.clock.t

    def step(self, measured: bool) -> None:
        fleet, reader, tap, cpu = self.fleet, self.reader, self.svc.tap, self.cpu
        tok0, fr0 = fleet.tokens, fleet.frames
        g0 = time.process_time()
        data = fleet.step()
        t0 = time.process_time()
        self.clock.t = fleet.t
        d = a = 0.0
        if self.node is not None:
            body = self.node.feed(data, self.read)
            c0 = time.process_time()
            if measured:
                self.node_cpu += c0 - t0
            self.events_in += body.count(b"\n") + 1 if body else 0
            ingest_ndjson(body, self.svc.tap.mirror, self.clock.t, self.rejected)
            a = time.process_time() - c0
            data = b""
        for part in reads(data, self.read):
            c0 = time.process_time()
            items = reader.feed(part)
            c1 = time.process_time()
            tap._on_items(reader, items)
            c2 = time.process_time()
            d += c1 - c0
            a += c2 - c1
            if not self.lanes_every:
                self.lanes()
        c3 = time.process_time()
        self.k += 1
        if self.lanes_every and self.k % self.lanes_every == 0:
            self.lanes()
        lanes_all = time.process_time() - c3
        if measured:
            self.gen_s += t0 - g0
            cpu["decode"] += d
            cpu["analysis"] += a
            cpu["lanes"] += lanes_all
            self.tokens += fleet.tokens - tok0
            self.frames += fleet.frames - fr0
            self.lag = max(0.0, self.lag + d + a + lanes_all - self.step_s)
            self.lag_max = max(self.lag_max, self.lag)

    def run(self) -> dict[str, Any]:
        args = self.args
        warm = round(args.warmup / self.step_s)
        meas = round(args.seconds / self.step_s)
        for k in range(warm + meas):
            if k == warm:
                self.shard_cpu_warm = self.shard_cpu_s()
            self.step(k >= warm)
        if self.svc.sharded is not None:  # what they spent on the measured steps (up to now)
            self.svc.sharded.flush()
            self.svc.sharded.shards.parts()  # (a round trip: every move sent so far is taken)
            self.shard_cpu_measured = (self.shard_cpu_s() or 0.0) - (self.shard_cpu_warm or 0.0)
        if self.node is not None:  # the nodes' input ended: their held Tokens go to the centre
            self.node.svc.mirror.release_held()
            ingest_ndjson(self.node.take(), self.svc.tap.mirror, self.clock.t, self.rejected)
        self.svc.tap.mirror.release_held()
        self.live.drain()
        sharded = self.svc.sharded
        if sharded is None:
            return self.live.report()
        c0 = time.process_time()
        rep = sharded.report()
        self.cpu["lanes"] += time.process_time() - c0
        return rep

    def shard_cpu_s(self) -> float | None:
        """CPU seconds of the shard processes (None: no shard processes)."""
        sharded = self.svc.sharded
        procs = getattr(sharded.shards, "_procs", None) if sharded is not None else None
        return sum(proc_cpu_s(p.pid) for p in procs) if procs else None

    def close(self) -> None:
        if self.svc.sharded is not None:
            self.svc.sharded.close()


def strip(x: Any) -> Any:
    """The report without what measures this process rather than the traffic."""
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k not in VOLATILE and not k.startswith(VOLATILE_PREFIX)}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += diff(a.get(k), b.get(k), f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b or (a != a and b != b) else [f"{path}: {a!r} != {b!r}"]


def one(args: argparse.Namespace, fleet: str) -> bool:
    g, b = (int(x) for x in fleet.lower().split("x"))
    step_s = args.step_ms / 1e3
    fast = Run(args, g, b, READ, args.lane_shards, stage=args.stage)
    rep = fast.run()
    shard_cpu = fast.shard_cpu_s()
    fast.close()
    cpu = sum(fast.cpu.values())
    secs = args.seconds
    rate = fast.tokens / secs
    load = os.getloadavg()[0]
    print(f"G×B={g}×{b} step={args.step_ms:g} ms coalesce={args.coalesce} lanes=actual,{args.policies} "
          f"seed={args.seed}: {secs:g} s measured after {args.warmup:g} s; fed {rate:,.0f} tokens/s "
          f"({fast.frames / secs:,.0f} frames/s); load average {load:.2f}")
    per = "  ".join(f"{k} {v:.2f} s ({fast.tokens / v / 1e3:,.0f}k tok/s)"
                    for k, v in fast.cpu.items() if v > 0)
    where = "central process" if args.stage else "analysis"
    print(f"  {where} CPU {cpu:.2f} s = {cpu / secs:.2f} core: {fast.tokens / cpu:,.0f} tokens per {where} "
          f"CPU-second  [{per}]")
    if args.stage:
        events = fast.events_in / (secs + args.warmup)
        rejected = sum(fast.rejected.values())
        print(f"  its input: {events:,.0f} events per fleet-second from the nodes (one Token per stream per "
              f"{args.token_interval:g} s), NDJSON lines rejected {rejected}")
        node = fast.node_cpu
        print(f"  per-node part (frames → analysis → held Tokens → NDJSON, every node together): "
              f"{node:.2f} s = {node / secs:.2f} core: {fast.tokens / node:,.0f} tokens per CPU-second, "
              f"{node / fast.tokens * 1e6:.2f} µs per token; {node / secs / g:.4f} core per worker")
    slope = cpu / secs - 1.0
    bound = f"bounded, max {fast.lag_max * 1e3:.0f} ms" if slope <= 0 else f"unbounded, +{slope:.2f} s per s"
    print(f"  lag (one core, steps in order): {bound}; last {fast.lag * 1e3:.0f} ms; "
          f"step {step_s * 1e3:g} ms")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    print(f"  RSS peak {peak:.0f} MB, now {rss_mb():.0f} MB; "
          f"(frame generation, not counted: {fast.gen_s:.2f} s)")
    lanes = ", ".join(f"{k} {v['steps']} steps" for k, v in rep["lanes"].items())
    print(f"  lanes: {lanes}; open requests {rep['requests']['open']}")
    if args.lane_shards:
        where = f"Ray actors at {args.ray}" if args.ray else "processes"
        cpu_txt = (f"; their CPU {fast.shard_cpu_measured:.2f} s in the measured seconds "
                   f"({fast.shard_cpu_measured / secs:.2f} core), {shard_cpu:.2f} s in all"
                   if shard_cpu is not None else "")
        print(f"  lanes of the policies in {args.lane_shards} shards ({where}){cpu_txt}; the central "
              "process's lanes figure above: the actual lane, the moves' pickling and the merge")
    if args.no_check:
        return True
    del fast
    ref = Run(args, g, b, args.check_read, lanes_every=args.check_lanes_every)  # one process
    rep_ref = ref.run()
    d = diff(strip(rep), strip(rep_ref))
    every = {0: "after every read", 1: "every step"}.get(args.check_lanes_every,
                                                       f"every {args.check_lanes_every} steps")
    print(f"  check against a reference run (one process, {args.check_read}-byte reads, lanes {every}): "
          + ("report figures equal" if not d else f"{len(d)} DIFFERENT"))
    for line in d[:20]:
        print("    " + line)
    return not d


def main() -> None:
    tune_gc(ANALYSIS_YOUNG)  # as `shadow serve` runs once started (shadow.app.process.announce)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet", action="append", help="G×B as GxB (repeatable; default 64x256 and 256x256)")
    ap.add_argument("--step-ms", type=float, default=60.0)
    ap.add_argument("--seconds", type=float, default=1.0, help="measured fleet seconds (default 1)")
    ap.add_argument("--warmup", type=float, default=0.3, help="fleet seconds not measured (default 0.3)")
    ap.add_argument("--coalesce", type=int, default=1, help="SSE chunks per data frame (default 1)")
    ap.add_argument("--policies", default="jsq-bytes,br0,brh:survival")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", action="store_true", help="skip the reference run's comparison")
    ap.add_argument("--lane-shards", type=int, default=0, help="the policies' lanes in this many processes "
                    "(shadow serve --lane-shards; default 0: in the analysis process)")
    ap.add_argument("--ray", default=None, metavar="ADDRESS", help="with --lane-shards: as Ray actors there")
    ap.add_argument("--token-interval", type=float, default=0.0, metavar="S",
                    help="Tokens held per stream per S seconds of event time (shadow serve --token-interval; "
                    "default 0: one per chunk); the reference run holds them the same")
    ap.add_argument("--stage", action="store_true", help="run the per-node part apart (its CPU printed on "
                    "its own) and feed its NDJSON events to a central service (--token-interval > 0 thins "
                    "them); the check's reference is the one-process run")
    ap.add_argument("--check-read", type=int, default=READ, help="the reference run's read size in bytes "
                    "(default: the fast run's)")
    ap.add_argument("--check-lanes-every", type=int, default=1, metavar="K",
                    help="the reference run's lanes take their queue every K steps (default 1, as the fast "
                    "run; 0: after every read)")
    args = ap.parse_args()
    ok = True
    for fleet in args.fleet or ["64x256", "256x256"]:
        ok = one(args, fleet) and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
