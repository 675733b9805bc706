"""The demo hands its children their tokens through the environment, never on a command line: a
command line is any local user's to read (`/proc/PID/cmdline`), and argparse took a token that
starts with "-" for a flag (`secrets.token_urlsafe` gives one in 64: the fleet exited with code 2
before it was ready, seen in a real-engine demo run)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from shadow.app.demo import Demo, DemoOptions
from shadow.base.procs import Child
from shadow.commands import fleet as fleet_command
from shadow.commands._help import ShadowArgumentParser

TOKEN = "-looks-like-a-flag_0123456789"


def test_a_child_gets_the_variables_it_is_given_and_not_on_its_command_line(tmp_path: Path) -> None:
    code = "import json, os; print(json.dumps({'token': os.environ['SHADOW_PROBE_TOKEN']}), flush=True)"
    child = Child("echo", [sys.executable, "-c", code], tmp_path / "echo.log",
                  env={"SHADOW_PROBE_TOKEN": TOKEN}, timeout_s=30)
    try:
        assert child.ready == {"token": TOKEN}
        assert TOKEN not in str(child.proc.args)
    finally:
        child.stop()


class _Spawned:
    def __init__(self, ready: dict[str, Any]) -> None:
        self.ready = ready


def test_the_vllm_demo_passes_its_token_by_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shadow.app.demo.secrets.token_urlsafe", lambda n: TOKEN)
    demo = Demo(DemoOptions(fleet="vllm", vllm_fleet="independent"), tmp_path)
    spawned: list[tuple[str, list[str], dict[str, str] | None]] = []

    def spawn(name: str, argv: list[str], json_ready: bool = True, timeout_s: float | None = None,
              env: dict[str, str] | None = None) -> _Spawned:
        spawned.append((name, argv, env))
        return _Spawned({"decode": ["http://127.0.0.1:9", "http://127.0.0.1:9"]})  # (nothing answers)

    monkeypatch.setattr(demo, "_spawn", spawn)
    serve_args: list[str] = []
    try:
        demo._start_vllm(lambda line: None, serve_args)
    finally:
        demo._release_port()
    [(name, argv, env)] = spawned
    assert name == "fleet" and env == {"SHADOW_PROBE_TOKEN": TOKEN}
    assert not any(TOKEN in a for a in argv + serve_args), (argv, serve_args)
    assert "--probe-token" not in argv and "--events-token" not in serve_args
    assert demo._serve_env == {"SHADOW_EVENTS_TOKEN": TOKEN}


def test_the_fleet_takes_a_dash_token_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHADOW_PROBE_TOKEN", TOKEN)
    parser = ShadowArgumentParser()
    fleet_command.register(parser.add_subparsers())
    assert parser.parse_args(["fleet", "--engine", "vllm"]).probe_token == TOKEN
