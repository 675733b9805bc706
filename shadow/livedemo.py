"""`shadow demo --live`: the whole loop on the embedded default, on loopback.

A simulated P/D fleet (1 prefill, G decode ranks) → taps in front of every worker → a real
vllm-router (PyPI) in P/D mode pointed at the taps → a trace sent through the router with the
official openai client. The mirror records the session; then the recording replays through the
engine with the router's real decisions as the `actual` lane beside BR-0/BR-H and the baselines,
and the fleet's measured step time is shown next to the model's.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from shadow._tools import find_executable
from shadow.fleet import FleetConfig, FleetThread
from shadow.loadgen import LoadOptions, run_load
from shadow.mirror.service import TapConfig
from shadow.mirror.thread import TapThread
from shadow.replay.experiment import ReplaySetup, run_replay
from shadow.replay.render import render_report
from shadow.traces import Trace, at_load, estimate_capacity_rps, load_trace, resolve


@dataclass(frozen=True)
class LiveDemoOptions:
    """Size of the live demo (defaults: ≈ 20 s of traffic at ≈ 30 ms steps)."""

    workers: int = 4
    slots: int = 16
    requests: int = 240
    output_divisor: int = 10  # paper-like outputs (≈ 1,050 tokens) / 10, to keep the client light
    load: float = 1.05
    policy: str = "round_robin"  # the vllm-router policy under observation
    seed: int = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _workload(opts: LiveDemoOptions, fleet: FleetConfig) -> Trace:
    base = resolve("paper-azure", seed=opts.seed, limit=opts.requests)
    reqs = tuple(
        replace(r, output_tokens=max(1, r.output_tokens // opts.output_divisor)) for r in base.requests
    )
    trace = replace(
        base,
        name=f"paper-azure (synthetic), outputs / {opts.output_divisor}",
        requests=reqs,
    )
    model = fleet.step_model
    cap = estimate_capacity_rps(
        trace,
        workers=opts.workers,
        slots=opts.slots,
        step_a=model.a * fleet.time_scale,
        step_b=model.b * fleet.time_scale,
    )
    return at_load(trace, opts.load, cap)


class _Router:
    """A vllm-router process in P/D mode, stopped on exit."""

    def __init__(self, prefill: str, decode: list[str], policy: str, log: Path) -> None:
        exe = find_executable("vllm-router")
        if exe is None:
            raise RuntimeError("the live demo needs vllm-router: pip install vllm-router (or '.[test]')")
        self.port, self.metrics_port = _free_port(), _free_port()
        args = [
            exe,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--vllm-pd-disaggregation",
            "--prefill",
            prefill,
            "--policy",
            policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.metrics_port),
            "--worker-startup-check-interval",
            "1",
        ]
        for d in decode:
            args += ["--decode", d]
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with code {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("vllm-router did not become healthy in time")

    def decisions(self) -> dict[str, float]:
        """vllm_router_policy_decisions_total per worker URL."""
        out: dict[str, float] = {}
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("vllm_router_policy_decisions_total{") and 'worker="' in line:
                labels, _, value = line.rpartition(" ")
                worker = labels.split('worker="', 1)[1].split('"', 1)[0].rstrip("/")
                out[worker] = out.get(worker, 0.0) + float(value)
        return out

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


def _fleet_counts(url: str) -> tuple[float, float, float]:
    """(requests succeeded, step-duration sum, step count) from one rank's /metrics."""
    ok = steps_sum = steps = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            ok += float(line.rsplit(" ", 1)[1])
        elif line.startswith("shadow_fleet_step_duration_seconds_sum"):
            steps_sum = float(line.rsplit(" ", 1)[1])
        elif line.startswith("shadow_fleet_step_duration_seconds_count"):
            steps = float(line.rsplit(" ", 1)[1])
    return ok, steps_sum, steps


def run_live_demo(opts: LiveDemoOptions, console: Console, err: Console) -> int:
    """Run the live loop, print what the mirror saw and the counterfactual; 0 when all agree."""
    fleet_cfg = FleetConfig(prefill=1, decode=opts.workers, slots=opts.slots, base_port=0, time_scale=1.0)
    trace = _workload(opts, fleet_cfg)
    work = Path(tempfile.mkdtemp(prefix="shadow-demo-"))
    record = work / "session.ndjson"
    err.print(
        f"live demo: {len(trace)} requests of {trace.name} at ρ={opts.load} through vllm-router "
        f"({opts.policy}) into a simulated fleet of {opts.workers} decode ranks × {opts.slots} slots; "
        f"files in {work}"
    )
    with FleetThread(fleet_cfg) as fleet:
        decode = {f"d{g}": u for g, u in enumerate(fleet.decode_urls)}
        cfg = TapConfig(
            decode, prefill={"p0": fleet.prefill_urls[0]}, record=str(record), scrape_interval_s=1.0
        )
        with TapThread(cfg) as taps:
            tap_urls = taps.ready["taps"]
            router = _Router(tap_urls["p0"], [tap_urls[n] for n in decode], opts.policy, work / "router.log")
            try:
                router.wait_ready()
                report = asyncio.run(run_load(trace, router.url, LoadOptions(concurrency=None)))
                taps.wait_for(lambda: taps.svc.state.live() == 0 and not len(taps.svc.queue), timeout=15)
                decisions = router.decisions()
                state = httpx.get(taps.ready["api"] + "/v1/state", timeout=5).json()
            finally:
                router.close()
        counts = {n: _fleet_counts(u) for n, u in decode.items()}
    summary = report.summary
    console.print(
        f"[bold]Live:[/] {summary.ok}/{summary.planned} requests ok through vllm-router; "
        f"mirror phantoms {state['phantoms']}"
    )
    table = Table(title="decode decisions: router's own counter vs mirror vs fleet")
    for col in ("worker", "vllm-router decisions", "mirrored finished", "fleet succeeded"):
        table.add_column(col, justify="left" if col == "worker" else "right")
    agree = summary.ok == summary.planned and state["phantoms"] == 0
    for name in decode:
        mine = state["workers"][name]["finished"]
        theirs = decisions.get(tap_urls[name].rstrip("/"), 0.0)
        served = counts[name][0]
        agree = agree and mine == theirs == served
        table.add_row(name, f"{theirs:.0f}", str(mine), f"{served:.0f}")
    console.print(table)
    _, step_sum, steps = counts["d0"]
    measured_ms = 1e3 * step_sum / steps if steps else float("nan")
    replay = run_replay(
        load_trace(record),
        ReplaySetup(
            slots=opts.slots,
            policies=("jsq", "jsq-bytes", "br0", "brh:survival", "brh:oracle"),
            step=fleet_cfg.step_model,
        ),
    )
    render_report(replay, console)
    actual = replay.results["actual"]
    console.print(
        f"fleet measured mean step {measured_ms:.1f} ms (all steps, incl. ramp-up and drain); "
        f"the actual lane's model says {actual.mean_step_ms:.1f} ms over its busy steps"
    )
    console.print(
        "[green]decisions recovered exactly[/]" if agree else "[red]the mirror disagrees: see above[/]"
    )
    return 0 if agree else 1
