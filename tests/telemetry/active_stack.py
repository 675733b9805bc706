"""`shadow serve --active` as operators run it, for telemetry tests: a simulated P/D fleet, the
`shadow router` stand-in for the existing router (pointed at shadow's taps, so every mode mirrors
what really routed), and the real `shadow serve --active` process in front of it, started through
the command line only (the contract of issue 10; no internal API).

Port layout as shipped in deploy/: `--port P` puts the API on P, the decode taps on P+1.., the
prefill taps after them, and the front tap (to the router) last, so the router can be given the tap
URLs before the sidecar starts; shadow's proxy listens on its own port (`--active-port`).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.base.tools import find_executable
from shadow.fleet import FleetConfig
from tests.harness import FleetThread

ADMIN_TOKEN = "telemetry-test-admin-token-0123456789"


def serve_options() -> set[str]:
    """The option strings `shadow serve` accepts."""
    import argparse

    from shadow.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in sub.choices["serve"]._actions for o in a.option_strings}


def require_active(proxy: bool = True) -> None:
    """Skip (with the reason) until `shadow serve --active` (`proxy`) and the mode controller exist."""
    wanted = {"--mode", "--admin-token", "--oracle-interval"}
    if proxy:
        wanted |= {"--active", "--active-port", "--active-policy"}
    missing = wanted - serve_options()
    if missing:
        pytest.skip(f"shadow serve has no {sorted(missing)} yet (issue 10: the active proxy and the "
                    "mode controller); this test runs once they are on main")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for port 0 (ip_local_port_range; 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_run(n: int) -> int:
    """A run of n+1 free loopback ports, below the ephemeral range when there is room: a port found
    free can still be taken before its process binds it, and the processes started with port 0 (of
    this test and of others running beside it) take theirs from the ephemeral range."""
    low = _ephemeral_low()
    lo, hi = (10000, low) if low - n > 10000 else (20000, 60000)
    for _ in range(200):
        base = random.randrange(lo, hi - n)
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


class _Proc:
    """A child process whose first stdout line is its JSON ready line; stderr to a log file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**os.environ, **(env or {})})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip():
            self.close()
            raise AssertionError(f"{args[:2]} did not start: {log.read_text()[-2000:]}")
        self.ready: dict[str, Any] = json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()  # SIGKILL cannot be refused: on a loaded host reaping may take a while
        self._log.close()


@dataclass
class FleetProcess:
    """A `shadow fleet` process's URLs (from its ready line)."""

    prefill_urls: list[str]
    decode_urls: list[str]
    pid: int | None = None  # the `shadow fleet` process (to signal it)


@dataclass
class ActiveStack:
    fleet: FleetThread | FleetProcess
    serve: dict[str, Any]  # shadow serve's ready line
    router_url: str

    @property
    def api(self) -> str:
        return str(self.serve["api"])

    @property
    def front(self) -> str:
        """Where clients send requests: shadow's active proxy (`active` in the ready line), or
        without --active the front tap in front of the router."""
        return str(self.serve.get("active") or self.serve["taps"]["router"])

    def set_mode(self, mode: str, **extra: Any) -> httpx.Response:
        return httpx.put(self.api + "/v1/mode", json={"mode": mode, **extra}, timeout=10,
                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})


@contextmanager
def active_stack(tmp: Path, *, prefill: int = 1, decode: int = 2, slots: int = 8, mode: str = "canary",
                 policy: str = "br0", proxy: bool = True,
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 processes_env: dict[str, str] | None = None, fleet_args: tuple[str, ...] = (),
                 fleet_env: dict[str, str] | None = None,
                 time_scale: float = 1.0) -> Iterator[ActiveStack]:
    """Fleet + `shadow router` + `shadow serve --active` (canary: half the requests routed by shadow);
    without `proxy`, `shadow serve` with the mode controller only (clients reach the router through
    the front tap; the mode, its admin API and its metrics work, nothing routes actively). `env`:
    more environment of `shadow serve` (tracing is off unless it says otherwise). `processes_env`:
    the fleet runs as a `shadow fleet` process too, and it and `shadow router` get this environment
    (else the fleet is a thread of the test and the router's tracing is off); `fleet_args` and
    `fleet_env`: more options and environment of that `shadow fleet` process. `time_scale`: the
    fleet's (2.0: steps twice as long)."""
    require_active(proxy)
    shadow = find_executable("shadow")
    assert shadow, "the shadow console script is missing"
    fenv = None if processes_env is None else {**processes_env, **(fleet_env or {})}
    with _fleet(tmp, shadow, prefill, decode, slots, fenv, time_scale, fleet_args) as fleet:
        base = _free_run(2 + decode + prefill)
        dtaps = [f"d{g}=http://127.0.0.1:{base + 1 + g}" for g in range(decode)]
        ptaps = [f"p{i}=http://127.0.0.1:{base + 1 + decode + i}" for i in range(prefill)]
        router = _Proc([shadow, "router", "--port", "0", *[x for t in dtaps for x in ("--decode", t)],
                        *[x for t in ptaps for x in ("--prefill", t)]], tmp / "router.log",
                       env=processes_env if processes_env is not None else {"OTEL_SDK_DISABLED": "true"})
        procs = [router]
        try:
            args = [shadow, "serve", "--port", str(base), "--front", f"router={router.ready['url']}",
                    "--slots", str(slots), "--scrape-interval", "0.5", "--mode", mode,
                    "--canary-fraction", "0.5", "--oracle-interval", "2", *extra]
            if proxy:
                args += ["--active", "--active-policy", policy]
            for g, url in enumerate(fleet.decode_urls):
                args += ["--upstream", f"d{g}={url}"]
            for i, url in enumerate(fleet.prefill_urls):
                args += ["--prefill", f"p{i}={url}"]
            serve = _Proc(args, tmp / "serve.log",
                          env={"SHADOW_SERVE_ADMIN_TOKEN": ADMIN_TOKEN, "OTEL_SDK_DISABLED": "true",
                               **(env or {})})
            procs.append(serve)
            assert serve.ready["taps"]["d0"].endswith(f":{base + 1}"), serve.ready  # the layout above
            yield ActiveStack(fleet, serve.ready, str(router.ready["url"]))
        finally:
            for p in reversed(procs):
                p.close()


@contextmanager
def _fleet(tmp: Path, shadow: str, prefill: int, decode: int, slots: int,
           env: dict[str, str] | None, time_scale: float = 1.0,
           args: tuple[str, ...] = ()) -> Iterator[FleetThread | FleetProcess]:
    """The simulated fleet: a thread of the test, or (`env` given) a `shadow fleet` process (with
    `args` more options)."""
    if env is None:
        cfg = FleetConfig(prefill=prefill, decode=decode, slots=slots, base_port=0, time_scale=time_scale)
        with FleetThread(cfg) as fleet:
            yield fleet
        return
    proc = _Proc([shadow, "fleet", "--prefill", str(prefill), "--decode", str(decode), "--slots", str(slots),
                  "--port", "0", "--time-scale", str(time_scale), *args], tmp / "fleet.log", env=env)
    try:
        yield FleetProcess(list(proc.ready["prefill"]), list(proc.ready["decode"]), proc.proc.pid)
    finally:
        proc.close()
