"""vLLM's shared-memory queue readers paced (shadow.realvllm.shmpace): unit tests on a stand-in for
vLLM 0.32's `SpinCondition` (what the plugin touches: `wait`, `last_read`, `busy_loop_s`)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from shadow.realvllm import shmpace
from shadow.realvllm.launcher import SHM_SPIN_SLEEP_US, VllmFleet, VllmFleetConfig
from shadow.realvllm.shmpace import ENV, pace, sleep_from_env


def _spin_condition() -> Any:
    class SpinCondition:
        """vLLM's reader: within `busy_loop_s` of its last read it yields, past it it polls."""

        polled: ClassVar[list[int | None]] = []

        def __init__(self) -> None:
            self.last_read = time.monotonic()
            self.busy_loop_s = 1.0

        def wait(self, timeout_ms: int | None = None) -> None:
            if time.monotonic() > self.last_read + self.busy_loop_s:
                self.polled.append(timeout_ms)

    return SpinCondition


def test_a_reader_sleeps_while_vllm_would_spin_and_waits_as_vllm_does_past_it(monkeypatch: Any) -> None:
    slept: list[float] = []
    monkeypatch.setattr(shmpace.time, "sleep", slept.append)
    cls = _spin_condition()
    made_before = cls()
    assert pace(cls, 250) is True
    made_before.wait(50)  # instances made before the plugin ran are paced too
    assert slept == [250e-6] and cls.polled == []
    idle = cls()
    idle.last_read = -math.inf  # idle: vLLM's own wait on the notify socket, untouched
    idle.wait(50)
    assert slept == [250e-6] and cls.polled == [50]


def test_pacing_twice_changes_nothing(monkeypatch: Any) -> None:
    slept: list[float] = []
    monkeypatch.setattr(shmpace.time, "sleep", slept.append)
    cls = _spin_condition()
    assert pace(cls, 100) is True
    assert pace(cls, 5) is False  # vLLM loads general plugins once per process, maybe more
    cls().wait()
    assert slept == [100e-6]


@pytest.mark.parametrize(("raw", "want"), [(None, None), ("", None), (" 250 ", 250), ("1", 1)])
def test_the_sleep_comes_from_the_environment(raw: str | None, want: int | None) -> None:
    assert sleep_from_env({} if raw is None else {ENV: raw}) == want


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "1.5"])
def test_a_bad_sleep_is_an_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=ENV if raw in ("0", "-1") else "invalid literal"):
        sleep_from_env({ENV: raw})


def test_register_is_inert_when_unset_and_warns_on_a_bad_value(monkeypatch: Any, caplog: Any) -> None:
    monkeypatch.delenv(ENV, raising=False)
    shmpace.register()  # no vLLM here: returns before importing it
    monkeypatch.setenv(ENV, "-3")
    with caplog.at_level("WARNING", logger=shmpace.LOG.name):
        shmpace.register()
    assert ENV in caplog.text and "left as they are" in caplog.text


def test_the_launcher_paces_the_servers_it_starts_unless_their_environment_says(tmp_path: Path,
                                                                               monkeypatch: Any) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for exe in ("vllm", "python"):
        (venv / "bin" / exe).touch()
    fleet = VllmFleet(VllmFleetConfig(decode=1, venv=str(venv), log_dir=tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    assert fleet._env(0, "d0")[ENV] == str(SHM_SPIN_SLEEP_US)
    monkeypatch.setenv(ENV, "")  # the operator's own value wins: empty turns the plugin off
    assert fleet._env(0, "d0")[ENV] == ""
    assert sleep_from_env(fleet._env(0, "d0")) is None
