"""`shadow fleet` as a process: the simulated fleet, or real vLLM CPU servers, until a signal.

With `--otlp-traces-endpoint URL` the simulated fleet exports its `llm_request` spans as vLLM 0.32
does with that flag: to URL over the protocol OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names (grpc by
default, as vLLM; http/protobuf wants the full `.../v1/traces` URL), sampled by OTEL_TRACES_SAMPLER
(default parentbased_always_on, the SDK's), named by OTEL_SERVICE_NAME (default `shadow-fleet`);
`OTEL_SDK_DISABLED=true` turns it off. Without the flag nothing is traced, whatever OTEL_* says.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace import TracerProvider

from shadow.app.process import announce, stop_event
from shadow.fleet.config import FleetConfig
from shadow.fleet.fleet import Fleet
from shadow.telemetry.tracing import make_provider

if TYPE_CHECKING:
    from shadow.realvllm.launcher import VllmFleet

SERVICE_NAME = "shadow-fleet"


def traces_provider(endpoint: str | None, environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """The provider of `--otlp-traces-endpoint` (see module docstring); None without an endpoint."""
    if not endpoint:
        return None
    env = dict(os.environ if environ is None else environ)
    env.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    env.setdefault("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    env.setdefault("OTEL_TRACES_SAMPLER_ARG", "1.0")
    env.setdefault("OTEL_SERVICE_NAME", SERVICE_NAME)
    env |= {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}
    return make_provider(env)


async def serve(config: FleetConfig, tracing: TracerProvider | None = None) -> None:
    """Serve every server of the simulated fleet until SIGINT/SIGTERM (OSError: a port); `tracing`:
    the provider its request spans go to."""
    stop = stop_event()
    tracer = tracing.get_tracer("shadow.fleet") if tracing is not None else None
    async with Fleet(config, tracer) as fleet:
        announce(fleet.ready_line())
        await stop.wait()


def run(config: FleetConfig, otlp_traces_endpoint: str | None = None) -> None:
    tracing = traces_provider(otlp_traces_endpoint)
    try:
        asyncio.run(serve(config, tracing))
    finally:
        if tracing is not None:
            tracing.shutdown()  # the last spans are exported


class _Stop(Exception):
    """SIGINT/SIGTERM while the servers start."""


def run_vllm(fleet: VllmFleet) -> None:
    """Start every real server, announce them, run until SIGINT/SIGTERM; every server is stopped
    (its whole process group) on the way out. RuntimeError: one did not come up (`StartError`,
    naming it and quoting its log) or exited."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stop.is_set():
            stop.set()
            raise _Stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        fleet.start()
        announce(fleet.ready_line())
        while not stop.wait(1.0):
            dead = [s.name for s in fleet.servers if s.proc is not None and s.proc.poll() is not None]
            if dead:
                raise RuntimeError(f"vLLM server {dead[0]} exited; stopping the fleet")
    except _Stop:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the stop below is not to be interrupted
        fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
