"""Attach-port abuse against the data plane (run on demand): the completion latency through a tap
with and without hostile traffic on its TCP attach port, and the relay's memory with analyses
attached that never read.

    python3 bench/bench_attach_hostile.py [--n 200] [--hostile-procs 2] [--before REF|DIR ...]
                                          [--never-read 8 --queue-bytes 67108864 --seconds 20]

Part 1 (hostile): `shadow tap --attach-listen 127.0.0.1:PORT --attach-token ...` in front of
bench_tap's stepped SSE upstream (8 chunks, 5 ms apart: a ~40 ms completion). `--n` completions
one after another through the tap with the attach port quiet, then `--n` more while
`--hostile-procs` processes send, each on a connection of its own, round after round: a marshal
list header claiming 2^31-1 items, a tuple header, 40,000 such frames back to back, 16 KiB of
garbage, and half a handshake left open (one per sender). Prints each phase's median, p99 and max latency, the
ratio of the medians (hostile / quiet), completions that took over 10 s (given up), the relay's
peak RSS (VmHWM) over the run and the attach refusals it counted.

Part 2 (`--never-read K`): the same tap with `--queue-bytes`; 16 clients stream large chunks
through it for half of `--seconds` with no analysis attached (its kept copies fill to
--retain-bytes), then K analyses attach on its unix socket (by hand, as each checkout's protocol
wants: each gets a snapshot of what is kept) and never read while the clients go on for the other
half. Prints the relay's RSS before, with the kept copies, at its peak, and after the attachers
left (closed their sockets, then 5 s), with its pending and kept bytes and detaches (this
checkout also detaches a stalled one after channel.STALL_S).

`--before REF` runs a git commit (or a source directory) first, for the same figures of it: on
a relay before the handshake (protocol 1) the hostile frames are decoded (marshal).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tap import ROOT, _load, _popen, _run_streams, _start_upstream, _UnderTest

TOKEN = "bench-attach-hostile-token-0123456789"
_CTL = struct.pack("<BI", 6, 5)
HOSTILE = (
    _CTL + b"[\xff\xff\xff\x7f",
    _CTL + b"(\xff\xff\xff\x7f",
    (_CTL + b"[\xff\xff\xff\x7f" + _CTL + b"(\xff\xff\xff\x7f") * 20_000,
    bytes(range(256)) * 64,
)
HALF = b"SHAT\x02\x00\x00\x00" + bytes(12)  # half of this checkout's opening
GIVE_UP_S = 10.0


# -- hostile senders ---------------------------------------------------------------------------------


def _hostile_main(port: int, stop: Any) -> None:
    held: list[socket.socket] = []
    while not stop.is_set():
        for payload in HOSTILE:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
                s.settimeout(1.0)
                s.sendall(payload)
                while s.recv(1 << 16):
                    pass
        if not held:  # one half handshake held open per sender (4 per address get in at once)
            with contextlib.suppress(OSError):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(HALF)
                held.append(s)
    for s in held:
        s.close()


# -- the tap of one checkout -------------------------------------------------------------------------


class _Tap:
    """`shadow tap` of checkout `root` (its own state directory), in front of `upstream`."""

    def __init__(self, root: Path, upstream: str, state: str, *extra: str) -> None:
        self.attach_port = _free_port()
        self.proc, self.ready = _popen(
            ["-m", "shadow", "tap", "--upstream", f"u={upstream}", "--state-dir", state, "--name", "bench",
             "--attach-listen", f"127.0.0.1:{self.attach_port}", "--attach-token", TOKEN, *extra], root)
        self.port = int(self.ready["taps"]["u"].rsplit(":", 1)[1])
        self.root = root
        record = Path(self.ready["dir"]) / "tap.json"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.relay = int(json.loads(record.read_text())["relay_pid"])
                return
            time.sleep(0.05)
        raise RuntimeError("no relay pid in " + str(record))

    def kib(self, field: str) -> int:
        for line in Path(f"/proc/{self.relay}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return 0

    def metrics(self, prefix: str) -> dict[str, float]:
        text = httpx.get(self.ready["metrics"] + "/metrics", timeout=30).text
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith(prefix)}

    def stop(self) -> None:
        _UnderTest([self.proc], self.ready).stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- part 1 ------------------------------------------------------------------------------------------


def _completion_ms(port: int, i: int) -> float:
    t0 = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(_run_streams(port, 1, None, f"b{i}", tokens=8), GIVE_UP_S))
    except TimeoutError:
        return float("inf")
    return (time.monotonic() - t0) * 1000


def _summary(xs: list[float]) -> str:
    done = sorted(x for x in xs if x != float("inf"))
    p99 = done[min(len(done) - 1, int(0.99 * len(done)))] if done else float("nan")
    return (f"median {statistics.median(done) if done else float('nan'):8.1f} ms  p99 {p99:8.1f} ms  "
            f"max {max(done, default=float('nan')):8.1f} ms  given up {len(xs) - len(done)}")


def _part1(name: str, root: Path, args: argparse.Namespace) -> None:
    up, up_port = _start_upstream(0.005, 8, 1)
    with tempfile.TemporaryDirectory() as state:
        tap = _Tap(root, f"http://127.0.0.1:{up_port}", state)
        try:
            for i in range(5):
                _completion_ms(tap.port, i)  # warm up
            quiet = [_completion_ms(tap.port, i) for i in range(args.n)]
            stop = mp.Event()
            senders = [mp.Process(target=_hostile_main, args=(tap.attach_port, stop), daemon=True)
                       for _ in range(args.hostile_procs)]
            for p in senders:
                p.start()
            time.sleep(1.0)  # (the senders connect)
            hostile = [_completion_ms(tap.port, args.n + i) for i in range(args.n)]
            stop.set()
            for p in senders:
                p.join(30)
            alive = tap.proc.poll() is None and os.path.exists(f"/proc/{tap.relay}")
            refused = tap.metrics("shadow_tap_attach_refused_total") if alive else {}
            peak = tap.kib("VmHWM") if alive else 0
        finally:
            tap.stop()
            up.terminate()
    q = statistics.median(quiet)
    h = statistics.median([x for x in hostile if x != float("inf")] or [q])
    print(f"== part 1, {name}: {args.n} completions each phase, load average {_load()}")
    print(f"  quiet attach port:   {_summary(quiet)}")
    print(f"  hostile attach port: {_summary(hostile)}")
    print(f"SUMMARY part 1 {name}: median hostile/quiet {h / q:.2f}x (N={args.n} each)  "
          f"given up {sum(x == float('inf') for x in hostile)}  relay peak RSS {peak / 1024:.0f} MiB"
          f"{'' if alive else '  (the relay died)'}")
    print("  refused:", {k.split("=", 1)[-1].rstrip("}").strip('"'): v for k, v in refused.items() if v}
          or refused)


# -- part 2 ------------------------------------------------------------------------------------------


def _fast_upstream_main(port_q: Any, chunk: int, chunks: int) -> None:
    """Answers every request with `chunks` SSE chunks of `chunk` bytes, written at once."""

    async def main() -> None:
        event = b"data: " + b"x" * (chunk - 8) + b"\n\n"
        body = b"%x\r\n%s\r\n" % (len(event), event)

        class Proto(asyncio.Protocol):
            def connection_made(self, tr: asyncio.BaseTransport) -> None:
                self.tr: Any = tr
                self.buf = b""

            def data_received(self, data: bytes) -> None:
                self.buf += data
                while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                    head = self.buf[:end].lower()
                    cl = head.split(b"content-length:", 1)
                    n = int(cl[1].split(b"\r\n", 1)[0]) if len(cl) == 2 else 0
                    if len(self.buf) < end + 4 + n:
                        return
                    self.buf = self.buf[end + 4 + n :]
                    self.tr.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                  b"transfer-encoding: chunked\r\n\r\n" + body * chunks + b"0\r\n\r\n")

        srv = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", 0)
        port_q.put(srv.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


def _attach_by_hand(root: Path, path: str, name: str) -> socket.socket:
    """An analysis that attaches to the group's unix socket and then never reads."""
    s = socket.socket(socket.AF_UNIX)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(path)
    s.settimeout(30)
    if (root / "shadow" / "mirror" / "handshake.py").exists():
        from shadow.contracts import handshake
        from shadow.contracts.frames import Hello, encode_hello

        msg, nonce = handshake.opening()
        s.sendall(msg)
        head = s.recv(handshake.HEAD, socket.MSG_WAITALL)
        handshake.answer_status(head)
        s.sendall(handshake.prove(b"", nonce, s.recv(handshake.ANSWER, socket.MSG_WAITALL)))
        s.sendall(encode_hello(Hello(name, "", 0)))
    else:  # protocol 1: a marshal-bodied hello (encoded here, for that relay to read)
        import marshal

        body = marshal.dumps(("hello", {"name": name}))
        s.sendall(struct.pack("<BI", 6, len(body)) + body)
    return s


async def _traffic(port: int, seconds: float, clients: int) -> int:
    async def one(deadline: float) -> int:
        n = 0
        async with httpx.AsyncClient(timeout=60) as c:
            while time.monotonic() < deadline:
                async with c.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                                    json={"model": "m", "prompt": "p", "stream": True}) as r:
                    async for b in r.aiter_raw():
                        n += len(b)
        return n

    deadline = time.monotonic() + seconds
    return sum(await asyncio.gather(*(one(deadline) for _ in range(clients))))


def _part2(name: str, root: Path, args: argparse.Namespace) -> None:
    q: Any = mp.Queue()
    up = mp.Process(target=_fast_upstream_main, args=(q, 16 << 10, 64), daemon=True)
    up.start()
    up_port = q.get(timeout=30)
    with tempfile.TemporaryDirectory() as state:
        tap = _Tap(root, f"http://127.0.0.1:{up_port}", state, "--queue-bytes", str(args.queue_bytes))
        try:
            base = tap.kib("VmRSS")
            peak_rss = moved = 0

            async def run() -> None:
                nonlocal peak_rss, moved
                task = asyncio.ensure_future(_traffic(tap.port, args.seconds / 2, 16))
                while not task.done():
                    peak_rss = max(peak_rss, tap.kib("VmRSS"))
                    await asyncio.sleep(0.5)
                moved += task.result()

            asyncio.run(run())
            kept_full = tap.kib("VmRSS")
            path = tap.ready["attach"].removeprefix("unix:")
            held = [_attach_by_hand(root, path, f"deaf{i}") for i in range(args.never_read)]
            asyncio.run(run())
            during = tap.metrics("shadow_tap_")
            for s in held:
                s.close()
            time.sleep(5.0)
            after = tap.kib("VmRSS")
            detached = {k: v for k, v in tap.metrics("shadow_tap_analysis_detached_total").items() if v}
            kept = tap.metrics("shadow_tap_kept_bytes").get("shadow_tap_kept_bytes")
        finally:
            tap.stop()
            up.terminate()
    print(f"== part 2, {name}: {args.never_read} analyses attached that never read, --queue-bytes "
          f"{args.queue_bytes >> 20} MiB, {moved / 1e6:,.0f} MB through the tap in {args.seconds:g} s")
    print(f"SUMMARY part 2 {name}: relay RSS {base / 1024:.0f} MiB before, {kept_full / 1024:.0f} MiB with "
          f"the kept copies, {peak_rss / 1024:.0f} MiB at the peak, {after / 1024:.0f} MiB 5 s after they "
          "left")
    pending = during.get("shadow_tap_handoff_pending_bytes")
    mib = "n/a" if pending is None else f"{pending / 2**20:.0f} MiB"
    print(f"  pending at the end of the traffic: {mib}  copies dropped: "
          f"{during.get('shadow_tap_handoff_dropped_total', 0):,.0f}  kept after they left: "
          f"{'n/a' if kept is None else f'{kept / 2**20:.0f} MiB'} (--retain-bytes: for their return)")
    print(f"  detached: {detached or 'n/a'}")


def _roots(refs: list[str], td: str) -> list[tuple[str, Path]]:
    out = []
    for i, ref in enumerate(refs):
        if Path(ref).is_dir():
            out.append((f"before({ref})", Path(ref).resolve()))
            continue
        old = Path(td) / f"before{i}"
        old.mkdir()
        git = ["git", "-C", str(ROOT), "archive", ref]
        archive = subprocess.run(git, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        out.append((f"before({ref})", old))
    return [*out, ("this checkout", ROOT)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="completions per phase (default 200)")
    ap.add_argument("--hostile-procs", type=int, default=2)
    ap.add_argument("--never-read", type=int, default=0, metavar="K",
                    help="part 2 with K analyses (default: off)")
    ap.add_argument("--queue-bytes", type=int, default=64 << 20)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--before", action="append", default=[], metavar="REF|DIR")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        for name, root in _roots(args.before, td):
            _part1(name, root, args)
            if args.never_read:
                _part2(name, root, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
