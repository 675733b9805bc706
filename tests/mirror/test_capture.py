"""Passive capture: TCP reassembly (any segmentation, order, duplicates; holes counted, never
guessed), and `shadow capture` on loopback beside the taps, on the same traffic through the real
vllm-router: the same routing decisions and token counts per request, and killing it changes
nothing for the clients."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.base.procs import shadow_argv
from shadow.capture.packets import PacketSocket, bpf_program
from shadow.capture.reassembly import GAP, Direction
from shadow.fleet import FleetConfig
from shadow.mirror.config import MirrorConfig
from tests.harness import FleetThread, TapThread
from tests.live.stack import Procs, Streams, router, wait

ROOT = os.geteuid() == 0


def _segments(data: bytes, cuts: list[int], isn: int) -> list[tuple[int, bytes]]:
    points = sorted({0, len(data), *[c % (len(data) + 1) for c in cuts]})
    return [((isn + a) % (1 << 32), data[a:b]) for a, b in itertools.pairwise(points) if b > a]


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=3000),
    cuts=st.lists(st.integers(0, 5000), max_size=20),
    isn=st.integers(0, (1 << 32) - 1),
    seed=st.integers(0, 1000),
    dups=st.integers(0, 5),
)
def test_reassembly_delivers_every_byte_once_whatever_the_order(
    data: bytes, cuts: list[int], isn: int, seed: int, dups: int
) -> None:
    segs = _segments(data, cuts, isn)
    rng = random.Random(seed)
    segs += [rng.choice(segs) for _ in range(dups)]  # retransmissions
    rng.shuffle(segs)
    d = Direction()
    out: list[bytes | None] = []
    out += d.add((isn - 1) % (1 << 32), b"", syn=True)
    for seq, payload in segs:
        out += d.add(seq, payload)
    assert GAP not in out and b"".join(x for x in out if x is not None) == data
    assert d.delivered == len(data) and d.gap_bytes == 0 and not d.pending


def test_a_hole_is_a_counted_gap_then_the_stream_goes_on() -> None:
    d = Direction(max_pending=10)
    d.add(99, b"", syn=True)
    assert d.add(100, b"abc") == [b"abc"]
    assert d.add(108, b"0123456789ab") == [GAP, b"0123456789ab"]  # 103..107 never came
    assert (d.gap_bytes, d.gaps, d.delivered) == (5, 1, 15)
    assert d.add(103, b"xyzzy") == []  # too late: behind the stream now (a retransmission)
    assert d.add(120, b"end", fin=True) == [b"end"]


def test_the_bpf_program_keeps_only_the_given_ports() -> None:
    prog = bpf_program([8000, 18100])
    assert prog[-1] == (0x06, 0, 0, 0) and prog[-2][3] > 0  # drop, keep
    with pytest.raises(ValueError):
        bpf_program([])


def test_without_root_the_capture_fails_with_one_clear_line() -> None:
    if ROOT:
        # as root the socket opens; check the message by asking for a packet socket as nobody
        res = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                *shadow_argv("capture", "--interface", "lo", "--upstream", "d0=http://127.0.0.1:9"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SHADOW_STATE_DIR": "/tmp", "HOME": "/tmp"},
        )
    else:
        res = subprocess.run(
            shadow_argv("capture", "--interface", "lo", "--upstream", "d0=http://127.0.0.1:9"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert res.returncode == 1, res.stderr
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("shadow capture:")]
    assert "CAP_NET_RAW" in line and "root" in line, res.stderr


def _by_request(path: Path) -> dict[str, tuple[Any, ...]]:
    out = {}
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        if doc.get("type") == "request":
            out[doc["request_id"]] = (doc["worker"], doc["output_tokens"], doc["end"])
    return out


@pytest.mark.integration
@pytest.mark.timeout(420)
@pytest.mark.skipif(
    not ROOT, reason="a packet socket needs root (CI runs as root); the error path is tested without it"
)
def test_capture_beside_the_taps_sees_the_same_decisions_and_tokens_and_can_die_freely(
    tmp_path: Path,
) -> None:
    procs = Procs(tmp_path)
    try:
        with FleetThread(FleetConfig(prefill=1, decode=2, slots=16, base_port=0, time_scale=0.25)) as ft:
            decode = {f"d{i}": u for i, u in enumerate(ft.decode_urls)}
            tap_rec, cap_rec = tmp_path / "tap.ndjson", tmp_path / "capture.ndjson"
            cfg = MirrorConfig(
                decode, prefill={"p0": ft.prefill_urls[0]}, scrape_interval_s=0, record=str(tap_rec)
            )
            with TapThread(cfg) as taps:
                args = [
                    "capture",
                    "--interface",
                    "lo",
                    "--scrape-interval",
                    "0",
                    "--record",
                    str(cap_rec),
                    "--prefill",
                    f"p0={ft.prefill_urls[0]}",
                ]
                for n, u in decode.items():
                    args += ["--upstream", f"{n}={u}"]  # the workers: the taps' side of the traffic
                cap, ready = procs.start("capture", shadow_argv(*args))
                url = router(procs, taps.ready["taps"])
                with Streams(url, 1000, tokens=8, concurrency=32) as streams:
                    pass
                assert streams.results.count("ok") == 1000, [r for r in streams.results if r != "ok"][:5]
                assert taps.wait_for(lambda: taps.svc.state.live() == 0 and not len(taps.svc.queue), 60)
                state = wait(
                    lambda: (
                        (s := httpx.get(ready["api"] + "/v1/state", timeout=10).json())
                        and sum(w["finished"] for w in s["workers"].values()) >= 1000
                        and s
                    ),
                    "the capture's mirror to see every request",
                    60,
                )
                # the recordings: one line per decode leg, the router's decision and the tokens
                taps.call(taps.svc.settle())
                taps.sync(lambda: taps.svc.recorder.flush())  # type: ignore[union-attr]
                seen = wait(
                    lambda: len(r := _by_request(cap_rec)) >= 1000 and r, "the capture's recording", 30
                )
                want = _by_request(tap_rec)
                assert len(want) == 1000
                same = sum(1 for rid, v in want.items() if seen.get(rid) == v)
                print(
                    f"capture vs tap: {same}/1000 identical (worker, tokens, end); "
                    f"seen_ratio {state['capture']['seen_ratio']:.6f}, kernel drops "
                    f"{state['capture']['kernel_drops']}, gaps {state['capture']['bytes']['gap']} bytes"
                )
                assert same >= 999, [
                    (rid, v, seen.get(rid)) for rid, v in want.items() if seen.get(rid) != v
                ][:5]
                assert state["capture"]["seen_ratio"] >= 0.999
                # killing the capture mid-traffic changes nothing for the clients
                with Streams(url, 200, tokens=8, concurrency=32) as more:
                    wait(lambda: more.done >= 20, "traffic flowing", 60)
                    os.kill(cap.pid, signal.SIGKILL)
                assert more.results.count("ok") == 200 and cap.wait(10) == -signal.SIGKILL
    finally:
        procs.close()


NOISE = """
import socket
srv = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(srv.getsockname())
a, _ = srv.accept()
print("ready", flush=True)
while True:
    c.sendall(b"noise")
    a.recv(64)
"""


@pytest.mark.skipif(not ROOT, reason="a packet socket needs root")
def test_the_packet_socket_sees_both_directions_once_on_loopback() -> None:
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    # other loopback traffic while the packet socket opens (another process: this one holds the
    # GIL while it opens the socket): none of it may reach the socket (a packet socket made for
    # every protocol queued it unfiltered until its filter was attached)
    noisy = subprocess.Popen([sys.executable, "-c", NOISE], stdout=subprocess.PIPE, text=True)
    assert noisy.stdout is not None and noisy.stdout.readline().strip() == "ready"
    ps = PacketSocket("lo", [port])
    try:

        def talk() -> None:
            c = socket.create_connection(("127.0.0.1", port))
            a, _ = srv.accept()
            c.sendall(b"ping")
            a.sendall(b"pong")
            a.close()
            c.close()

        th = threading.Thread(target=talk)
        th.start()
        payloads: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + 10
        while len(payloads) < 2 and time.monotonic() < deadline:
            seg = ps.recv()
            if seg is not None and seg.payload:
                payloads.append((seg.dst[1], seg.payload))
        th.join()
        assert sorted(p for _, p in payloads) == [b"ping", b"pong"]  # each once
        assert dict((p, d) for d, p in payloads)[b"ping"] == port and ps.duplicates > 0  # loopback's copies
    finally:
        noisy.kill()
        noisy.wait(10)
        noisy.stdout.close()
        ps.close()
        srv.close()
