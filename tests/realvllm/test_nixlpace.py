"""NIXL's progress thread paced (shadow.realvllm.nixlpace): unit tests on a stand-in for NIXL's
bindings, and on the tier's real P/D pair (NixlConnector) that every server applied it and that
the idle pair does not keep the machine's cores busy (it did: each NIXL worker spun a core)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from shadow.realvllm.launcher import NIXL_PROGRESS_DELAY_US, nixl_available
from shadow.realvllm.nixlpace import ENV, delay_from_env, pace
from tests.realvllm.conftest import Tier


class Config:
    pthrDelay = 0


class Bindings:
    """NIXL's pybind module as far as the pacing touches it: nixlAgent(name, config)."""

    def __init__(self) -> None:
        self.built: list[tuple[str, int]] = []

    def nixlAgent(self, name: str, config: Config) -> str:
        self.built.append((name, config.pthrDelay))
        return name


def test_every_agent_built_after_pacing_gets_the_delay_and_pacing_twice_changes_nothing() -> None:
    b: Any = Bindings()
    assert pace(b, 1000) is True
    assert b.nixlAgent("a", Config()) == "a"
    assert pace(b, 5) is False  # vLLM loads general plugins once per process, maybe more: idempotent
    b.nixlAgent("b", Config())
    assert b.built == [("a", 1000), ("b", 1000)]


@pytest.mark.parametrize(("raw", "want"), [(None, None), ("", None), (" 250 ", 250), ("0", 0)])
def test_the_delay_comes_from_the_environment(raw: str | None, want: int | None) -> None:
    assert delay_from_env({} if raw is None else {ENV: raw}) == want


@pytest.mark.parametrize("raw", ["-1", "soon", "1.5"])
def test_a_bad_delay_is_an_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=ENV if raw == "-1" else "invalid literal"):
        delay_from_env({ENV: raw})


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ...), None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _tree(root: int) -> list[int]:
    """`root` and every process descended from it (the servers run in process groups of their own)."""
    parent = {int(p.name): int(f[1]) for p in Path("/proc").iterdir() if p.name.isdigit()
              and (f := _stat(int(p.name))) is not None}
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return sorted(tree)


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and all their threads (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def test_the_idle_real_pd_pair_paced_its_nixl_threads_and_leaves_the_cores_alone(tier: Tier) -> None:
    if not nixl_available(tier.venv):
        pytest.fail("the tier's P/D pair runs NixlConnector only where NIXL imports (scripts/install-vllm.sh "
                    "installs it); this test is about NIXL's progress thread")
    logs = sorted((tier.logs / "pd").glob("*.log"))
    assert len(logs) == 2, logs
    for log in logs:  # each server's engine core and worker built its agent paced
        paced = [ln for ln in log.read_text(errors="replace").splitlines()
                 if f"NIXL progress thread paced at {NIXL_PROGRESS_DELAY_US} µs" in ln]
        assert any("Worker" in ln for ln in paced), (log.name, paced)
    pids = _tree(tier.pd.pid)
    assert len(pids) >= 6, pids  # the CLI, and per server its API server, engine core and worker
    window = 5.0
    before, t0 = _cpu_seconds(pids), time.monotonic()
    time.sleep(window)  # the interval measured (the pair idle), not a wait for something to happen
    used = _cpu_seconds(pids) - before
    elapsed = time.monotonic() - t0
    # Two spinning NIXL threads took ~2 CPU-s per second of it (one core each); paced, the idle
    # pair's whole process tree uses a few % of one.
    assert used < 0.25 * elapsed, f"the idle P/D pair used {used:.2f} CPU-s in {elapsed:.1f} s"
