"""No single point of failure: two `shadow serve --active` replicas with a leader lease on a real
etcd, both behind the same taps (one `shadow tap` group in front of a simulated P/D fleet and of the
`shadow router` stand-in, the existing router), clients spread over both replicas (as a Kubernetes
Service spreads them).

Replica A leads (mode active: it routes), replica B stands by (it passes every request to the
router). Both attach to the same tap group, so the standby's mirror is hot: before the kill it
holds every stream on the fleet, the leader's included (and the leader's holds the router's).
Under 100 streams, A is killed with SIGKILL (its process group: proxy and analysis; the taps live on):
- B holds the lease within 2 x the lease TTL of the kill, and the next request it gets is routed by
  it (the gate is read per request); requests sent to B in the gap are passed to the router, served;
- the streams on A fail visibly (no `[DONE]`), none is retried or duplicated (each request's tokens
  arrive at most once, on one stream);
- the fleet, B's pool and B's mirror end at 0;
- never two leaders at once: B became leader only after the kill, and after the last deadline A
  reported for its lease.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.base.procs import shadow_argv
from tests.etcdserver import EtcdServer
from tests.telemetry.active_stack import _free_run
from tests.telemetry.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TTL = 2.0
STREAMS = 100


class Replica:
    """`shadow serve` in a process group of its own (so SIGKILL takes proxy, taps and relay)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        fh = log.open("wb")
        self.proc = subprocess.Popen(shadow_argv(*args), stdout=subprocess.PIPE, stderr=fh, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "OTEL_SDK_DISABLED": "true"},
                                     start_new_session=True)
        fh.close()
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip():
            self.kill()
            raise AssertionError(f"replica did not start: {log.read_text()[-2000:]}")
        self.ready: dict[str, Any] = json.loads(line)

    @property
    def api(self) -> str:
        return str(self.ready["api"])

    @property
    def front(self) -> str:
        return str(self.ready["active"])

    def leader(self) -> dict[str, Any]:
        doc: dict[str, Any] = httpx.get(self.api + "/v1/report", timeout=10).json()["leader"]
        return doc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def started(args: list[str], log: Path) -> Iterator[Replica]:
    r = Replica(args, log)
    try:
        yield r
    finally:
        r.stop()
        if r.proc.stdout is not None:
            r.proc.stdout.close()


class Stream:
    """One streamed completion: its tokens, whether it ended with [DONE], and on which replica."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.tokens = 0
        self.done = False
        self.error: str | None = None
        self.first = threading.Event()
        self.request_ids: set[str] = set()
        self.ended_at = 0.0

    def run(self) -> None:
        body = {"model": "sim-llm", "prompt": "x " * 64, "stream": True, "max_tokens": self.max_tokens,
                "ignore_eos": True}
        try:
            with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as client, \
                    client.stream("POST", self.url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}"
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        self.request_ids.add(str(chunk.get("id")))
                        if chunk.get("choices"):
                            self.tokens += 1
                            self.first.set()
        except httpx.HTTPError as exc:
            self.error = type(exc).__name__
        finally:
            self.ended_at = time.time()
            self.first.set()


def test_killing_the_leader_under_100_streams_hands_routing_to_the_standby(tmp_path: Path) -> None:
    with EtcdServer() as etcd, \
            started(["fleet", "--prefill", "1", "--decode", "2", "--slots", "64", "--port", "0"],
                    tmp_path / "fleet.log") as fleet:
        decode, prefill = fleet.ready["decode"], fleet.ready["prefill"]
        router_port = _free_run(1)
        router_url = f"http://127.0.0.1:{router_port}"
        # the shared taps: d0, d1, p0, then the one in front of the router, on base, base+1, ...
        base = _free_run(4)
        names = {"--upstream": [f"d{g}={u}" for g, u in enumerate(decode)],
                 "--prefill": [f"p0={prefill[0]}"], "--front": [f"router={router_url}"]}
        tap_flags = [x for flag, pairs in names.items() for p in pairs for x in (flag, p)]
        with started(["tap", "--name", "shared", "--state-dir", str(tmp_path / "state"), "--port", str(base),
                      *tap_flags], tmp_path / "taps.log") as taps:
            tap_url = {t.split("=", 1)[0]: f"http://127.0.0.1:{base + i}"
                       for i, t in enumerate([*names["--upstream"], *names["--prefill"], *names["--front"]])}
            assert taps.ready["taps"] == tap_url, taps.ready
            common = ["serve", "--active", "--attach", taps.ready["dir"], *tap_flags, "--slots", "64",
                      "--scrape-interval", "0.5", "--mode", "active", "--pin-mode", "--oracle-interval", "0",
                      "--lease-etcd", etcd.url, "--lease-ttl", str(int(TTL)), "--policies", "br0"]
            with started([*common, "--replica-id", "a"], tmp_path / "a.log") as a:
                wait_for(lambda: a.leader()["leader"], 60, "replica a to lead")
                with started([*common, "--replica-id", "b"], tmp_path / "b.log") as b, \
                        started(["router", "--port", str(router_port), "--decode", tap_url["d0"], "--decode",
                                 tap_url["d1"], "--prefill", tap_url["p0"]], tmp_path / "router.log"):
                    _the_leader_dies(a, b, decode, taps.ready["metrics"])


def _the_leader_dies(a: Replica, b: Replica, decode: list[str], tap_metrics: str) -> None:
    assert a.ready["taps"] == b.ready["taps"], (a.ready, b.ready)  # the same taps
    assert _metric(httpx.get(tap_metrics + "/metrics", timeout=5).text,
                   "shadow_tap_analysis_attached") == 2  # side by side, neither replaced
    assert not b.leader()["leader"] and b.leader()["role"] == "standby"
    # long enough (3000 tokens) to be in flight at the kill
    streams = [Stream(a.front if i % 2 == 0 else b.front, 3000) for i in range(STREAMS)]
    threads = [threading.Thread(target=s.run, daemon=True) for s in streams]
    for t in threads:
        t.start()
    for s in streams:
        assert s.first.wait(120)
    assert all(s.error is None for s in streams), [s.error for s in streams if s.error]
    # the standby's mirror is hot: it holds every stream on the fleet, the 50 the leader routed
    # included; the leader's holds the 50 the router placed
    for r in (a, b):
        wait_for(lambda r=r: _live(httpx.get(r.api + "/v1/state", timeout=5).json()) == STREAMS, 60,
                 f"{r.ready['api']}'s mirror to hold all {STREAMS} streams")
    assert _routed_count(b) == 0  # the standby placed nothing itself
    last_a = a.leader()
    assert last_a["leader"] and last_a["role"] == "leader"
    kill_wall = time.time()
    a.kill()
    # requests to b in the gap (one after another until b leads): passed to the router, served
    gap: list[Stream] = []
    leads = threading.Event()

    def in_the_gap() -> None:
        while not leads.is_set():
            s = Stream(b.front, 4)
            gap.append(s)
            s.run()

    gapper = threading.Thread(target=in_the_gap, daemon=True)
    gapper.start()
    wait_for(lambda: _metric(httpx.get(tap_metrics + "/metrics", timeout=5).text,
                             "shadow_tap_analysis_attached") == 1, 30, "the taps to see a's analysis gone")

    # b leads once a's lease lapses; every request that reaches b after that is routed
    # by b (the gate is read per request)
    wait_for(lambda: b.leader()["leader"], 30, "b to lead", step=0.05)
    t_lead_seen = time.time()
    leads.set()
    gapper.join(60)
    assert gap and all(s.done and s.tokens == 4 for s in gap), [(s.tokens, s.error) for s in gap
                                                                 if not s.done]
    before = _routed_count(b)
    probe = Stream(b.front, 4)
    probe.run()
    assert probe.done and probe.tokens == 4, probe.error
    assert _routed_count(b) == before + 1, "the request after the takeover was not routed by b"
    for t in threads:
        t.join(240)
    b_lead = [t for t in b.leader()["transitions"] if t["role"] == "leader"]
    assert b_lead, b.leader()
    if len(b_lead) > 1:  # a renewal late past its deadline on a loaded host: fenced, re-won
        print(f"b's lease flapped {len(b_lead) - 1} time(s) after the takeover: {b.leader()}")
    took_lease = b_lead[0]["t"] - kill_wall
    print(f"\ntakeover: b leads {took_lease:.2f} s after the kill (seen by polling at "
          f"{t_lead_seen - kill_wall:.2f} s; TTL {TTL:g} s); the next request was routed by b; "
          f"{len(gap)} requests sent to b in the gap, all served")
    # b routes every request that arrives once it holds the lease (the gate is read per
    # request); the probes, one after another, bound when the first one was sent
    assert took_lease <= 2 * TTL, took_lease
    assert b_lead[0]["t"] > kill_wall and b_lead[0]["t"] > last_a["valid_until"], (b_lead, last_a)
    on_a = [s for s, i in zip(streams, range(STREAMS), strict=True) if i % 2 == 0]
    on_b = [s for s, i in zip(streams, range(STREAMS), strict=True) if i % 2 == 1]
    cut = [s for s in on_a if s.ended_at >= kill_wall]  # in flight at the kill
    assert len(cut) >= 0.8 * len(on_a), f"{len(cut)} of {len(on_a)} streams in flight at the kill"
    assert all(not s.done for s in cut), "a stream on the killed leader ended cleanly"
    assert all(s.done and s.tokens == s.max_tokens for s in on_b), [
        (s.tokens, s.error) for s in on_b if not s.done]
    assert all(len(s.request_ids) <= 1 and s.tokens <= s.max_tokens for s in streams)
    # one more request routed by b after the takeover completes
    extra = Stream(b.front, 16)
    extra.run()
    assert extra.done and extra.tokens == 16, extra.error

    def idle() -> bool:
        busy = sum(httpx.get(u + "/load", timeout=5).json()["server_load"] for u in decode)
        live = httpx.get(b.api + "/v1/state", timeout=5).json()
        pool = httpx.get(b.api + "/metrics", timeout=5).text
        return busy == 0 and _metric(pool, "shadow_pool_requests") == 0 and _live(live) == 0

    wait_for(idle, 120, "fleet, pool and mirror at 0")


def _routed_count(b: Replica) -> float:
    """Requests b routed itself (mode active), all outcomes."""
    text = httpx.get(b.api + "/metrics", timeout=5).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
               if x.startswith('shadow_router_requests_total{mode="active"'))


def _metric(text: str, name: str) -> float:
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name + " ")
               or x.startswith(name + "{"))


def _live(state: dict[str, Any]) -> int:
    workers = state.get("workers", {})
    return sum(int(w.get("active", 0)) for w in workers.values()) if isinstance(workers, dict) else 0
