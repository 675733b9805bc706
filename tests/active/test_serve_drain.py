"""`shadow serve --active` drains on SIGTERM and SIGHUP, `shadow tap` on SIGTERM (SIGHUP is its
reload): requests in flight on the proxy and on the taps finish within `--drain-timeout`; what is
still open at the deadline is cut so that the client sees the cut.

The upstream holds every stream open until `HOLD_S` after the signal (longer than the proxy's old
fixed 5 s grace), then finishes it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.base.procs import read_json_line, shadow_argv
from tests.active.raw_upstream import SSE_HEAD, Exchange, RawUpstream

HOLD_S = 7.0
STREAMS = 3


class Hold:
    """The upstream's script: one event, then wait until `HOLD_S` after `signalled`, then the rest."""

    def __init__(self) -> None:
        self.signalled: float | None = None
        self.started = 0
        self.lock = threading.Lock()

    async def script(self, ex: Exchange) -> None:
        if ex.method != "POST":
            await ex.send(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        await ex.send(SSE_HEAD)
        await ex.chunk(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
        with self.lock:
            self.started += 1
        while self.signalled is None or time.monotonic() < self.signalled + HOLD_S:
            await asyncio.sleep(0.05)
        await ex.chunk(b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\n')
        await ex.chunk(b"data: [DONE]\n\n")
        await ex.end_chunks()


def _spawn(args: list[str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(shadow_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, read_json_line(proc, args[0], 60)


def _stream(url: str, out: list[str]) -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 2, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            text = b"".join(r.iter_raw())
        out.append("complete" if text.rstrip().endswith(b"data: [DONE]") else f"short: {text!r}")
    except httpx.HTTPError as exc:
        out.append(f"cut: {type(exc).__name__}")


def _end(proc: subprocess.Popen[str]) -> str:
    """Kill `proc` if it still runs; its stderr."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    err = proc.stderr.read() if proc.stderr is not None else ""
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    return err


def _run(args: list[str], urls: list[str], sig: signal.Signals, hold: Hold) -> tuple[list[str], int, str]:
    proc, ready = _spawn(args)
    results: list[str] = []
    try:
        targets = [u(ready) for u in urls]
        threads = [threading.Thread(target=_stream, args=(t, results))
                   for t in targets for _ in range(STREAMS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while hold.started < len(threads):
            assert time.monotonic() < deadline, f"only {hold.started} streams started"
            time.sleep(0.02)
        hold.signalled = time.monotonic()
        proc.send_signal(sig)
        for t in threads:
            t.join(120)
        code = proc.wait(60)
    finally:
        err = _end(proc)
    return results, code, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("shape", ["group", "stop-taps", "thread"])
def test_serve_drains_the_proxy_and_the_taps(sig: signal.Signals, shape: str, tmp_path: Path) -> None:
    """The proxy's streams finish within --drain-timeout. The taps' streams finish whatever the
    shape: a tap group of its own (the default) is not serve's to stop and goes on serving after
    serve exits; with --stop-taps serve then stops it, and the group drains them; taps on a thread
    of serve (--relay thread) drain with the proxy."""
    hold = Hold()
    extra = {"group": [], "stop-taps": ["--stop-taps"], "thread": ["--relay", "thread"]}[shape]
    state = ["--state-dir", str(tmp_path)]
    with RawUpstream(hold.script) as up:
        args = ["serve", "--upstream", f"d0={up.url}", "--slots", "16", "--scrape-interval", "3600",
                "--policies", "br0", "--active", "--mode", "active", "--pin-mode", "--drain-timeout", "60",
                *state, *extra]
        taps: dict[str, str] = {}
        try:
            tap_url = lambda r: taps.setdefault("d0", r["taps"]["d0"])  # noqa: E731
            results, code, err = _run(args, [lambda r: r["active"], tap_url], sig, hold)
            assert results == ["complete"] * (2 * STREAMS), (results, err[-2000:])
            assert code == 0, err[-2000:]
            assert f"{sig.name}: draining (up to 60 s" in err
            status = subprocess.run(shadow_argv("tap", "--status", "--all", *state), capture_output=True,
                                    text=True, timeout=60)
            if shape == "group":  # the data plane outlived the analysis: it still relays
                assert status.returncode == 0 and '"relay_id"' in status.stdout, status
                hold.signalled = time.monotonic() - HOLD_S  # a new stream is held no longer
                after: list[str] = []
                _stream(taps["d0"], after)
                logs = "".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("taps/*/tap.log"))
                assert after == ["complete"], (after, logs)  # the group's log says what the relay did
            else:  # nothing of serve's is left running
                assert '"relay_id"' not in status.stdout, status
        finally:
            subprocess.run(shadow_argv("tap", "--stop", "--all", *state), capture_output=True, timeout=120)


def test_tap_drains_on_sigterm() -> None:
    hold = Hold()
    with RawUpstream(hold.script) as up:
        args = ["tap", "--upstream", f"d0={up.url}", "--drain-timeout", "60"]
        results, code, err = _run(args, [lambda r: r["taps"]["d0"]], signal.SIGTERM, hold)
    assert results == ["complete"] * STREAMS, (results, err[-2000:])
    assert code == 0 and "stopping: the relay drains its streams (up to 60 s)" in err, err[-2000:]


def test_tap_reloads_on_sighup_and_its_streams_finish() -> None:
    """SIGHUP is the data plane's reload (systemd's ExecReload): a new relay takes the sockets, the
    old one finishes its streams; the process keeps serving."""
    hold = Hold()
    with RawUpstream(hold.script) as up:
        proc, ready = _spawn(["tap", "--upstream", f"d0={up.url}", "--drain-timeout", "60"])
        results: list[str] = []
        try:
            threads = [threading.Thread(target=_stream, args=(ready["taps"]["d0"], results))
                       for _ in range(STREAMS)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while hold.started < STREAMS:
                assert time.monotonic() < deadline, f"only {hold.started} streams started"
                time.sleep(0.02)
            hold.signalled = time.monotonic()
            proc.send_signal(signal.SIGHUP)
            for t in threads:
                t.join(120)
            assert results == ["complete"] * STREAMS, results
            assert proc.poll() is None  # still serving
            r = httpx.get(ready["taps"]["d0"] + "/v1/models", timeout=30)
            assert r.status_code == 404  # relayed by the new relay: the upstream's own answer
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            err = _end(proc)
    assert "reloaded: relay pid" in err, err[-2000:]


def test_a_stream_still_open_at_the_drain_deadline_is_seen_cut() -> None:
    hold = Hold()
    with RawUpstream(hold.script) as up:
        args = ["serve", "--upstream", f"d0={up.url}", "--slots", "16", "--scrape-interval", "3600",
                "--policies", "br0", "--active", "--mode", "active", "--pin-mode", "--drain-timeout", "1"]
        results, code, err = _run(args, [lambda r: r["active"]], signal.SIGTERM, hold)
    # the old proxy ended such a stream with its final chunk: the client read a short, "complete" body
    assert all(r.startswith("cut: ") for r in results), results
    assert code == 0 and f"({STREAMS} requests cut at the drain deadline)" in err, err[-2000:]
