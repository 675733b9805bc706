"""`shadow sweep --ray`: the same cells on a real local Ray instance give the local run's figures,
cell by cell; every way Ray can be missing or unreachable is a one-line error.

The Ray instance is a real one (a separate process that called `ray.init(num_cpus=2)` on
loopback); the sweep under test connects to it by ADDRESS as an operator's would.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from shadow.cli import main
from shadow.replay.sweep_ray import RayUnavailable, parse_address

pytestmark = pytest.mark.integration

# Wall-clock measurements of the decision code: they differ between any two runs, local or not.
TIMED = {"decision_p99_ms"}

HEAD = r"""
import os, sys
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
import ray
ctx = ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
print("ADDRESS " + ctx.address_info["gcs_address"], flush=True)
sys.stdin.readline()  # the test closes stdin to stop it
ray.shutdown()
"""

SWEEP = [
    "sweep",
    "mini_code.csv",  # a relative path: Ray workers do not run in our working directory
    "--workers",
    "2,4",
    "--loads",
    "0.8,1.2",
    "--seeds",
    "0,1",
    "--slots",
    "8",
    "--warmup",
    "1",
    "--window",
    "2",
    "--max-requests",
    "300",
    "--policies",
    "jsq-bytes,least-tokens,br0,brh:survival,bra",
]
LANES = ["jsq-bytes", "least-tokens", "br0", "brh-survival", "bra"]


# Token authentication (Ray's default for a new ray.init cluster), with a token of this test run
# passed in the environment, so nothing is written to ~/.ray.
TOKEN = secrets.token_hex(32)


def _env() -> dict[str, str]:
    """No inherited Ray settings; no usage reports; token authentication with this run's token;
    Ray's single-machine mode, in which the head and the drivers use loopback as node address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = TOKEN
    return env


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """A local Ray instance (2 CPUs, loopback) in its own process; yields its GCS address."""
    pytest.importorskip("ray", reason="the `ray` extra is not installed (scripts/test.sh installs it)")
    proc = subprocess.Popen(
        [sys.executable, "-c", HEAD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()  # blocks until ray.init returned (or the process died)
    if not line.startswith("ADDRESS "):
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the Ray instance did not start: {line!r} {err[-2000:]}")
    try:
        yield line.split()[1]
    finally:
        proc.stdin.close()  # ray.shutdown() in that process stops what its ray.init started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _write_trace(path: Path, n: int = 400) -> None:
    """A small Azure-format trace (code-like: long prompts, short outputs, bursty arrivals)."""
    rng = random.Random(7)
    t = datetime(2023, 11, 16, 18, 0, 0)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for _ in range(n):
        t += timedelta(seconds=rng.expovariate(4.0))
        lines.append(f"{t:%Y-%m-%d %H:%M:%S.%f}0,{rng.randint(50, 4000)},{rng.randint(1, 300)}")
    path.write_text("\n".join(lines) + "\n")


def _sweep_subprocess(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shadow", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=280,
        env=_env(),
    )


def _untimed(value: Any) -> Any:
    """`value` with the wall-clock decision timings removed, recursively."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in TIMED}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def test_ray_sweep_gives_the_local_figures_cell_by_cell(
    ray_head: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_trace(tmp_path / "mini_code.csv")
    monkeypatch.chdir(tmp_path)
    assert main([*SWEEP, "--jobs", "1", "--json", "local.json"]) == 0
    capsys.readouterr()
    ray_run = _sweep_subprocess(tmp_path, *SWEEP, "--ray", ray_head, "--json", "ray.json")
    assert ray_run.returncode == 0, ray_run.stderr[-3000:]
    # progress: one line per finished cell, and where they ran
    assert "8 cells as Ray tasks on 2 CPUs" in ray_run.stderr
    for k in range(1, 9):
        assert f"[{k}/8]" in ray_run.stderr

    local = json.loads((tmp_path / "local.json").read_text())
    remote = json.loads((tmp_path / "ray.json").read_text())
    assert local["runner"] == "local (1 process)" and remote["runner"] == f"ray ({ray_head})"
    assert len(local["runs"]) == len(remote["runs"]) == 8  # 2 G × 2 ρ × 2 seeds
    for a, b in zip(local["runs"], remote["runs"], strict=True):
        key = (a["workers"], a["load"], a["seed"])
        assert (b["workers"], b["load"], b["seed"]) == key
        assert list(a["lanes"]) == list(b["lanes"]) == LANES
        for lane in a["lanes"]:
            for fig, value in a["lanes"][lane].items():
                if fig in TIMED:
                    assert value is not None and b["lanes"][lane][fig] is not None
                    continue
                assert b["lanes"][lane][fig] == value, (key, lane, fig)  # exact, not approximate
        assert _untimed(a) == _untimed(b)
    assert _untimed(local["summary"]) == _untimed(remote["summary"])
    assert local["protocol"] == remote["protocol"]

    # the comparison is not vacuous: lanes differ from each other, and overload sheds
    spreads = {lane: r["spread_steps"] for lane, r in local["runs"][0]["lanes"].items()}
    assert len(set(spreads.values())) > 1
    assert any(r["lanes"]["jsq-bytes"]["shed"] > 0 for r in local["runs"] if r["load"] == 1.2)


def test_ray_returns_results_in_cell_order_and_names_a_failing_cell(ray_head: str, tmp_path: Path) -> None:
    _write_trace(tmp_path / "mini_code.csv")
    driver = f"""
import json, sys
from shadow.replay.protocol import Cell, Protocol, cells_for
from shadow.replay.sweep_ray import RayUnavailable, run_cells_ray
proto = Protocol(warmup_lifetimes=1, window_lifetimes=2, seeds=(0, 1), max_requests=200)
base = Cell("mini_code.csv", 2, 1.0, 0, ("jsq-bytes", "bra"), slots=8, protocol=proto)
cells = cells_for(["mini_code.csv"], [2, 3], [0.8, 1.2], ["jsq-bytes", "bra"], base)
cells = cells[::-1]  # not the order a local pool would finish them in
seen = []
out = run_cells_ray(cells, {ray_head!r}, on_done=lambda r: seen.append(r["seed"]))
print(json.dumps({{"cells": [[c.workers, c.load, c.seed] for c in cells],
                  "out": [[r["workers"], r["load"], r["seed"]] for r in out], "seen": len(seen)}}))
try:
    run_cells_ray([Cell("missing.csv", 2, 1.0, 0, ("jsq-bytes",), slots=8, protocol=proto)], {ray_head!r})
except RayUnavailable as exc:
    print("ERROR " + str(exc))
"""
    run = subprocess.run(
        [sys.executable, "-c", driver], cwd=tmp_path, capture_output=True, text=True, timeout=280, env=_env()
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    order = json.loads(lines[0])
    assert order["out"] == order["cells"] and len(order["cells"]) == 8 and order["seen"] == 8
    (error,) = [ln for ln in lines if ln.startswith("ERROR ")]
    assert "cell missing.csv G=2 ρ=1 seed=0 failed on Ray: TraceError" in error
    assert "no such file" in error


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_unreachable_address_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray", reason="the `ray` extra is not installed (scripts/test.sh installs it)")
    port = _closed_port()
    assert main(["sweep", "paper-azure", "--workers", "2", "--ray", f"127.0.0.1:{port}"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"shadow sweep: cannot reach Ray at 127.0.0.1:{port}:")
    assert "refused" in err.lower()


def test_missing_ray_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    assert main(["sweep", "paper-azure", "--workers", "2", "--ray"]) == 2
    err = _one_line_error(capsys)
    assert err == "shadow sweep: --ray needs Ray, which is not installed: pip install 'shadow[ray]'"


@pytest.mark.parametrize("address", ["paper-azure", "127.0.0.1", "host:port", "ray://h:1/x"])
def test_a_non_address_is_refused(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray", reason="the `ray` extra is not installed (scripts/test.sh installs it)")
    assert main(["sweep", "paper-azure", "--workers", "2", f"--ray={address}"]) == 2
    assert "not a Ray address" in _one_line_error(capsys)


def test_parse_address_forms() -> None:
    assert parse_address("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert parse_address("ray://head.local:10001") == ("head.local", 10001)
    assert parse_address("[::1]:6379") == ("::1", 6379)
    with pytest.raises(RayUnavailable, match="not a Ray address"):
        parse_address("6379")


def test_ray_with_whole_run_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "paper-azure", "--whole-run", "--ray"]) == 2
    assert "drop --whole-run" in _one_line_error(capsys)


def test_help_explains_ray(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    out = capsys.readouterr().out
    assert "--ray [ADDRESS]" in out and "pip install 'shadow[ray]'" in out
    assert "same figures" in out and "--jobs is then" in out
