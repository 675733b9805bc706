"""Mode flips under load lose nothing (issue 10 acceptance 2).

Real processes: `shadow fleet` (2 prefill servers, 4 decode ranks × 16 slots, time-scale 0.25),
`shadow serve --active` (the proxy; taps in front of every worker; in shadow mode it passes
requests to the existing router) and the existing router pointed at shadow's taps (the
deployment's port layout), so every mode mirrors what really routed: a real vllm-router (PyPI) in
P/D mode, and `shadow router` (the JSQ stand-in, built from the active proxy's own pieces). 200 concurrent
closed-loop streams from the official `openai` client; while they run, the admin API flips
shadow → canary → active → fallback → active → ... twice round, each time another 40 streams
have completed (a condition, not a timer). Every stream ends with exactly its `max_tokens`
tokens; once idle, the fleet runs nothing, the Prompt Pool is empty and the mirror holds no live
request; every request was counted once, under the mode it started in.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from shadow.base.procs import shadow_argv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOKEN = "flip-test-admin-token-0123456789"
CYCLE = ("shadow", "canary", "active", "fallback", "active")
N, EVERY = 200, 40


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head = line.rsplit(" ", 1)[0]
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(pred: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def logged_process(args: list[str], log: Path) -> Iterator[dict[str, Any]]:
    """`python -m shadow ARGS` with stderr to `log` (never a full pipe); yields its ready line."""
    with log.open("wb") as fh:
        proc = subprocess.Popen(shadow_argv(*args), stdout=subprocess.PIPE, stderr=fh, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip(), f"{args[0]} did not start: {log.read_text()[-2000:]}"
            yield json.loads(line)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def router_exe() -> str:
    """vllm-router from PyPI (the test extra installs it next to this Python)."""
    here = Path(sys.executable).parent / "vllm-router"
    exe = str(here) if here.exists() else shutil.which("vllm-router")
    assert exe, "vllm-router is not installed (scripts/test.sh installs it with the test extras)"
    return exe


@contextmanager
def running(args: list[str], log: Path) -> Iterator[None]:
    """A process with output to `log`, stopped (SIGINT, then kill) when the block ends."""
    with log.open("wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            yield
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def free_run(n: int) -> int:
    """A base port with base..base+n free on loopback (the sidecar's documented port layout)."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
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
    raise AssertionError("no run of free loopback ports")


@pytest.mark.parametrize("router", ["vllm-router", "shadow-router"])
def test_flipping_modes_under_200_streams_loses_nothing(tmp_path: Path, router: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    G, P = 4, 2
    fleet_args = ["fleet", "--prefill", str(P), "--decode", str(G), "--slots", "16", "--port", "0",
                  "--time-scale", "0.25"]
    with logged_process(fleet_args, tmp_path / "fleet.log") as fleet:
        prefill, decode = fleet["prefill"], fleet["decode"]
        # the router is pointed at shadow's taps (API on base, decode taps on base+1.., prefill taps
        # after them), so every mode mirrors what really routed
        base = free_run(2 + G + P)
        rport = free_run(1)  # the router on rport (vllm-router: its Prometheus endpoint on rport + 1)
        if router == "vllm-router":
            router_args = [router_exe(), "--host", "127.0.0.1", "--port", str(rport),
                           "--vllm-pd-disaggregation", "--policy", "round_robin",
                           "--prometheus-host", "127.0.0.1",
                           "--prometheus-port", str(rport + 1), "--worker-startup-check-interval", "1"]
        else:  # shadow's own JSQ stand-in (the active proxy's pieces in a fixed mode)
            router_args = shadow_argv("router", "--port", str(rport))
        router_args += [x for i in range(P) for x in ("--prefill", f"http://127.0.0.1:{base + 1 + G + i}")]
        router_args += [x for g in range(G) for x in ("--decode", f"http://127.0.0.1:{base + 1 + g}")]
        router_url = f"http://127.0.0.1:{rport}"
        serve_args = ["serve", "--port", str(base), "--active", "--front", f"router={router_url}",
                      "--slots", "16", "--mode", "shadow", "--canary-fraction", "0.5",
                      "--admin-token-file", str(token_file), "--scrape-interval", "0.5",
                      # the flips are the operator's: at this saturation the requests shadow routes
                      # wait longer for their first token than the router's (the canary analysis'
                      # figures, tests/active/test_canary_analysis.py), so the SLO trip may rightly
                      # fire, which is not what this test is about (the losses it asserts are)
                      "--trip-slo-min-requests", "1000000000"]
        serve_args += [x for g, u in enumerate(decode) for x in ("--upstream", f"d{g}={u}")]
        serve_args += [x for i, u in enumerate(prefill) for x in ("--prefill", f"p{i}={u}")]
        # the sidecar first (the router checks its workers, shadow's taps, at start)
        with logged_process(serve_args, tmp_path / "serve.log") as ready, \
                running(router_args, tmp_path / "router.log"):
            wait_for(lambda: _healthy(router_url), f"{router} healthy", timeout=120)
            api, proxy = ready["api"], ready["active"]
            assert ready["taps"]["d0"].endswith(f":{base + 1}"), ready
            try:
                done, flips = asyncio.run(_drive(proxy, api))
            except Exception as exc:
                t = httpx.get(api + "/metrics", timeout=5).text
                bad = [x for x in t.splitlines() if not x.startswith("#") and any(
                    k in x for k in ("reject", "evict", "idle", "busy", "error", "timeout"))]
                raise AssertionError(f"{exc!r}: {bad}") from exc
            assert flips == 2 * len(CYCLE) and done >= N

            def idle() -> bool:  # nothing left anywhere
                fleet_busy = sum(httpx.get(u + "/load", timeout=5).json()["server_load"] for u in decode)
                text = httpx.get(api + "/metrics", timeout=5).text
                live = httpx.get(api + "/v1/state", timeout=5).json()
                return (fleet_busy == 0 and metric_sum(text, "shadow_pool_requests") == 0
                        and _mirror_live(live) == 0)

            wait_for(idle, "fleet, pool and mirror at zero")
            text = httpx.get(api + "/metrics", timeout=5).text
            # every request counted once, under the mode it started in, as ok (a client that
            # closes right after [DONE] had the whole stream)
            by_mode = {m: metric_sum(text, "shadow_router_requests_total", mode=m)
                       for m in ("shadow", "active", "fallback")}
            lines = [x for x in text.splitlines() if x.startswith("shadow_router_requests_total")]
            assert sum(by_mode.values()) == done, (by_mode, lines)
            assert all(by_mode[m] > 0 for m in ("shadow", "active", "fallback")), by_mode
            assert metric_sum(text, "shadow_router_requests_total", outcome="ok") == done, lines
            report = httpx.get(api + "/v1/report", timeout=10).json()["mode"]
            ops = [t for t in report["transitions"] if t.get("reason") == "operator"]
            assert [t["to"] for t in ops] == [CYCLE[i % len(CYCLE)] for i in range(1, flips + 1)]
            assert report["trips"] == {}  # flips are operator transitions, no automatic fallback
            print(f"\n{done} streams, {flips} flips, by mode {by_mode}")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _mirror_live(state: dict[str, Any]) -> int:
    """Requests the mirror still holds: live, pending, and any worker's active count or KV tokens."""
    workers = state["workers"].values()
    return int(state["live"] + state["pending"] + sum(w["active"] + w["kv_tokens"] for w in workers))


async def _drive(proxy: str, api: str) -> tuple[int, int]:
    """200 closed-loop streams (each sends its next request when the last one ended) while the
    flipper walks the cycle twice, one flip per EVERY completions; then the loops stop."""
    client = openai.AsyncOpenAI(base_url=proxy + "/v1", api_key="x", max_retries=0, timeout=120)
    rng = random.Random(10)
    completed = 0
    flips = 0
    target = 2 * len(CYCLE)
    errors: list[str] = []

    async def one(words: int, max_tokens: int) -> None:
        stream = await client.completions.create(
            model="sim-llm", prompt="w " * words, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        tokens, usage = 0, None
        async for ch in stream:
            if ch.choices and ch.choices[0].text:
                tokens += 1
            if ch.usage is not None:
                usage = ch.usage.completion_tokens
        if tokens != max_tokens or usage != max_tokens:
            errors.append(f"{tokens} chunks, usage {usage}, wanted {max_tokens}")

    async def loop() -> None:
        nonlocal completed
        while flips < target:
            await one(rng.randint(8, 200), rng.randint(10, 60))
            completed += 1

    def flipper() -> None:
        """On its own thread: the 200 streams saturate the test's event loop on a loaded machine
        (connects from that loop were seen taking > 10 s), the admin calls must not wait on it."""
        nonlocal flips
        mark = 0
        stop = threading.Event()
        # one connection per PUT: a kept-alive connection idle past the server's keep-alive
        # timeout can be closed just as the next PUT goes out (a client-side race)
        with httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            while flips < target:
                if completed >= mark + EVERY:
                    mark = completed
                    body = {"mode": CYCLE[(flips + 1) % len(CYCLE)], "policy": "br0"}
                    r = http.put(api + "/v1/mode", json=body, headers={"authorization": f"Bearer {TOKEN}"})
                    assert r.status_code == 200, r.text
                    flips += 1
                stop.wait(0.02)  # polls the completion count (the condition), not a timer

    await asyncio.gather(asyncio.to_thread(flipper), *(loop() for _ in range(N)))
    await client.close()
    assert not errors, errors[:5]
    return completed, flips
