"""The real-engine tier: real vLLM CPU servers, started once per test run and concurrently, on free
loopback ports, shared by the tests of this folder (all marked `vllm`).

What runs (4 servers of the tiny model, one of them with two engines, ~24 CPU-s each to start, ~1.5 GiB each):
- `probe`: one decode server whose step probe posts to a real `shadow serve` (events token), with a
  tap of that serve in front of it;
- `drop`: one decode server with two DP engines (`--data-parallel-size 2`, one core each) whose
  probe has a queue of 1 and posts to a socket that never answers; the same serve has a tap (`dp`)
  in front of it;
- `pd`: `shadow fleet --engine vllm --prefill 1 --decode 1` as a command (P/D pair; NixlConnector
  when NIXL imports, ExampleConnector otherwise).

Rule when the engine venv is missing: every test here FAILS with the command that installs it
(`scripts/install-vllm.sh`), so a run that was meant to cover the real engine cannot pass without
it; deselect the tier explicitly with `-m "not vllm"`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shadow.base.procs import Child, read_json_line, shadow_argv
from shadow.realvllm.launcher import (
    INSTALL_HINT,
    VllmFleet,
    VllmFleetConfig,
    ensure_model,
    find_engine_venv,
    quiet_port,
)

EVENTS_TOKEN = "tier-events-token"
PROBE_TOKEN = "tier-probe-token"  # the probe's: it admits step events only
MODEL_NAME = "sim-llm"  # the simulated fleet's name: clients are interchangeable


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that need the engine (the `engine_venv` fixture, directly or through `tier`) are
    marked `vllm` and `integration`; the unit tests beside them are not. A test marked
    `stops_tier` ends a server the others share, so it runs after all of them."""
    for item in items:
        if "engine_venv" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.timeout(1200))  # the first one waits for 4 servers to start
    last = [item for item in items if item.get_closest_marker("stops_tier")]
    items[:] = [item for item in items if not item.get_closest_marker("stops_tier")] + last


@dataclass
class Tier:
    venv: Path
    model: Path
    logs: Path
    serve: Child
    api: str
    tap: str
    dp_tap: str
    probe: VllmFleet
    drop: VllmFleet
    blackhole: socket.socket
    pd: subprocess.Popen[str]
    pd_ready: dict[str, Any]


def _engine_venv() -> Path:
    try:
        return find_engine_venv()
    except FileNotFoundError as exc:
        pytest.fail(f"the real-engine tier needs vLLM: {exc}\n  ({INSTALL_HINT}; "
                    "or deselect these tests with -m 'not vllm')", pytrace=False)


@pytest.fixture(scope="session")
def engine_venv() -> Path:
    return _engine_venv()


@pytest.fixture(scope="session")
def tiny_model(engine_venv: Path) -> Path:
    return ensure_model(engine_venv, "tiny", 0)


@pytest.fixture(scope="session")
def tier(engine_venv: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    logs = tmp_path_factory.mktemp("vllm-tier")
    # below the ephemeral range: the DP server binds its port minutes later, after the probe server
    # is up, and a port from bind(0) may meanwhile go to any socket (a tap took one once)
    d0_port, dp_port = quiet_port(), quiet_port()
    serve = Child("shadow serve", shadow_argv(
        "serve", "--upstream", f"d0=http://127.0.0.1:{d0_port}", "--upstream", f"dp=http://127.0.0.1:{dp_port}",
        "--slots", "64", "--events-token", EVENTS_TOKEN, "--probe-token", PROBE_TOKEN,
        "--scrape-interval", "0.5", "--state-dir", str(logs / "state"), "--stop-taps"),
        logs / "serve.log")  # outlives one test
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(64)  # accepted by the kernel, never answered: every post times out
    hole = f"http://127.0.0.1:{blackhole.getsockname()[1]}"
    quiet = lambda msg: None  # noqa: E731
    probe = VllmFleet(VllmFleetConfig(
        decode=1, model_path=tiny_model, ports=(d0_port,), cores=(0,), probe_url=serve.ready["api"],
        probe_token=PROBE_TOKEN, log_dir=logs / "probe"), log=quiet)
    drop = VllmFleet(VllmFleetConfig(
        decode=1, data_parallel=2, model_path=tiny_model, ports=(dp_port,), cores=(1, 0), probe_url=hole,
        log_dir=logs / "drop",
        env=(("SHADOW_PROBE_QUEUE", "1"),)), log=quiet)
    for f in (probe, drop):
        f.log_dir.mkdir(parents=True, exist_ok=True)
    pd_log = (logs / "pd-cli.log").open("w")
    pd = subprocess.Popen(
        shadow_argv("fleet", "--engine", "vllm", "--prefill", "1", "--decode", "1",
                    "--model-path", str(tiny_model), "--log-dir", str(logs / "pd")),
        stdout=subprocess.PIPE, stderr=pd_log, stdin=subprocess.DEVNULL, text=True, process_group=0,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    errors: list[BaseException] = []

    def start(f: VllmFleet) -> None:
        try:
            f.start()
        except BaseException as exc:
            errors.append(exc)

    def start_after(first: threading.Thread, f: VllmFleet) -> None:
        # The DP server's coordinator must report within vLLM's fixed 120 s of its start: started
        # while three other servers import vLLM on a loaded 2-core machine, it missed that
        # window; after the probe server is up it competes with the P/D pair only.
        first.join()
        start(f)

    first = threading.Thread(target=start, args=(probe,))
    threads = [first, threading.Thread(target=start_after, args=(first, drop))]
    for t in threads:
        t.start()
    pd_ready: dict[str, Any] = {}
    try:
        try:
            pd_ready = read_json_line(pd, "shadow fleet --engine vllm (P/D)", 900)
        except RuntimeError as exc:
            errors.append(RuntimeError(f"{exc}; its stderr: {(logs / 'pd-cli.log').read_text()[-3000:]}"))
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        yield Tier(engine_venv, tiny_model, logs, serve, serve.ready["api"], serve.ready["taps"]["d0"],
                   serve.ready["taps"]["dp"], probe, drop, blackhole, pd, pd_ready)
    finally:
        for t in threads:
            t.join()
        if pd.poll() is None:
            pd.send_signal(signal.SIGTERM)
            try:
                pd.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(pd.pid, signal.SIGKILL)
                pd.wait(10)
        pd_log.close()
        if pd.stdout is not None:
            pd.stdout.close()
        probe.stop()
        drop.stop()
        serve.stop()
        blackhole.close()

