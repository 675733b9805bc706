"""Test harnesses: the simulated fleet, `shadow tap` and `shadow serve` in process, each on an event
loop thread of its own (`shadow.base.loopthread.LoopThread`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from opentelemetry.sdk.trace import TracerProvider

from shadow.app.serve import ServeConfig, ServeService
from shadow.base.loopthread import LoopThread
from shadow.dataplane.rundir import groups, pid_alive
from shadow.dataplane.supervisor import control
from shadow.fleet import Fleet, FleetConfig
from shadow.mirror.config import MirrorConfig
from shadow.mirror.service import MirrorService

T = TypeVar("T")


def stop_tap_groups(state_dir: Path, timeout_s: float = 20.0) -> list[str]:
    """Stop every tap group running under `state_dir` (drain, then SIGKILL after `timeout_s`);
    the names of those that were running."""
    stopped = []
    for rd in groups(state_dir):
        rec = rd.read() or {}
        pids = [int(p) for p in (rec.get("pid"), rec.get("relay_pid")) if p]
        if not rd.locked_by_someone():
            continue
        stopped.append(rd.name)
        with contextlib.suppress(OSError):
            control(rd, "stop", timeout_s=5.0)
        deadline = time.monotonic() + timeout_s
        while rd.locked_by_someone() and time.monotonic() < deadline:
            time.sleep(0.02)
        for pid in pids:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return stopped


class FleetThread:
    """`with FleetThread(config) as ft:` — a running `Fleet`; `ft.call(coro)` runs on its loop."""

    def __init__(self, config: FleetConfig, start_timeout_s: float = 30.0) -> None:
        self.config = config
        self._timeout = start_timeout_s
        self._loop = LoopThread("shadow-fleet")
        self._fleet: Fleet | None = None

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            raise RuntimeError("fleet not started")
        return self._fleet

    @property
    def prefill_urls(self) -> list[str]:
        return self.fleet.prefill_urls

    @property
    def decode_urls(self) -> list[str]:
        return self.fleet.decode_urls

    @property
    def dp_url(self) -> str | None:
        return self.fleet.dp_url

    def __enter__(self) -> FleetThread:
        self._loop.start()

        async def _start() -> Fleet:
            fleet = Fleet(self.config)
            await fleet.start()
            return fleet

        try:
            self._fleet = self.call(_start(), self._timeout)
        except TimeoutError:
            self._loop.stop()
            raise TimeoutError("simulated fleet did not start in time") from None
        except BaseException as exc:
            self._loop.stop()
            raise RuntimeError("simulated fleet failed to start") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fleet is not None and self._loop.running:
            try:
                self.call(self._fleet.stop(), 15)
            finally:
                self._loop.stop()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run `coro` on the fleet's loop and return its result."""
        if not self._loop.running:
            raise RuntimeError("fleet not started")
        return self._loop.call(coro, timeout)

    def inject(self, target: str, **settings: Any) -> list[str]:
        return self.call(self.fleet.inject(target, **settings))


class TapThread:
    """`with TapThread(config) as t:` — `t.ready` is the ready document, `t.svc` the service.

    The service starts on this thread's loop (the taps relay there with `relay="thread"`, in a child
    process with `relay="process"`); `sync`/`wait_for` run on the service's analysis loop, where the
    mirrored state lives; `settle()` waits for the analysis watermark.
    """

    def __init__(self, config: MirrorConfig) -> None:
        self.config = config
        self.relay = LoopThread("shadow-tap")
        self.svc: Any = None
        self.ready: dict[str, Any] = {}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self.relay.loop is not None
        return self.relay.loop

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run a coroutine on the relay loop and wait for its result."""
        return self.relay.call(coro, timeout)

    def sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Call `fn(*args)` on the analysis loop (state is only touched from there)."""
        return self.svc.analysis.sync(fn, *args)  # type: ignore[no-any-return]

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until the analysis has consumed everything the taps offered so far."""
        return self.call(self.svc.settle(timeout), timeout + 5)  # type: ignore[no-any-return]

    def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Settle the analysis, then poll `pred` on its loop until it holds or `timeout` passes."""
        self.settle(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sync(pred):
                return True
            time.sleep(0.02)
        return bool(self.sync(pred))

    def _build(self) -> Any:
        """The service to run (built on its loop): here the tap service, which is also `svc`."""
        self.svc = MirrorService(self.config)
        return self.svc

    def __enter__(self) -> TapThread:
        self.relay.start()

        async def _start() -> dict[str, Any]:
            self._running = self._build()
            return await self._running.start()  # type: ignore[no-any-return]

        self.ready = self.call(_start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self._running.stop())
        finally:
            self.relay.stop()

    def drain(self) -> None:
        self.call(self.svc.drain())


class ServeThread(TapThread):
    """`shadow serve` (taps + live lanes) off the caller's thread, with TapThread's `sync`,
    `settle` and `wait_for` on its tap service (`svc`); `serve` is the ServeService, tracing into
    `tracing` when given."""

    def __init__(self, config: ServeConfig, tracing: TracerProvider | None = None) -> None:
        super().__init__(config.tap)
        self.serve_config = config
        self.tracing = tracing
        self.serve: ServeService

    def _build(self) -> ServeService:
        self.serve = ServeService(self.serve_config, tracing=self.tracing)
        self.svc = self.serve.tap
        return self.serve
