"""Flags that say what traffic does: a mode the process cannot carry out is refused (409 from the
API, a flag error from the flag file, exit 2 at start), `/v1/mode` says whether active routing is
available, bad start-up values exit 2 with one line naming the flag (and where its value came
from), the mode's start source is labelled truthfully, and every write of the flag file applies it
(the last writer wins against PUT)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.active.flagfile import FlagFileWatcher
from shadow.active.modes import ModeConfig, ModeController, ModeSetting, ModeUnavailable
from shadow.base.procs import shadow_argv
from tests.active.procs import shadow_process
from tests.harness import stop_tap_groups

TOKEN = "honest-flags-admin-token-0123"
SERVE = ["serve", "--worker", "d0=http://127.0.0.1:9", "--slots", "4", "--scrape-interval", "0",
         "--policies", "br0"]


def _until(fn: Any, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        out = fn()
        if out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_without_a_proxy_only_shadow_is_carried_out() -> None:
    c = ModeController(ModeConfig(mode="shadow", active_available=False))
    for mode in ("active", "canary", "fallback"):
        with pytest.raises(ModeUnavailable, match="without --active"):
            c.apply(ModeSetting(mode), "operator")
    snap = c.snapshot()
    assert snap["current"] == "shadow" and snap["active_routing"]["available"] is False
    assert snap["active_routing"]["modes"] == ["shadow"] and "--active" in snap["active_routing"]["reason"]
    c.apply(ModeSetting("shadow", pin=True), "operator")
    assert c.snapshot()["pinned"] is True and c.snapshot()["last_writer"] == "operator"
    on = ModeController(ModeConfig(mode="canary"))
    assert on.snapshot()["active_routing"] == {"available": True, "modes": ["shadow", "canary", "active",
                                                                           "fallback"], "reason": None}
    # configured in process (not through the command): an impossible start mode is a flag error
    odd = ModeController(ModeConfig(mode="active", active_available=False))
    assert odd.snapshot()["current"] == "shadow" and "refused" in odd.snapshot()["last_flag_error"]


def test_every_write_of_the_flag_file_applies_it_and_the_last_writer_wins(tmp_path: Path) -> None:
    flag = tmp_path / "mode.yaml"
    flag.write_text("mode: canary\ncanary_fraction: 0.1\n")
    c = ModeController(ModeConfig(mode="shadow"))
    w = FlagFileWatcher(str(flag), c)
    w.poll()
    assert c.snapshot()["configured"] == "canary" and c.snapshot()["last_writer"] == "flag_file"
    c.apply(ModeSetting("active"), "operator")  # a PUT: holds ...
    w.poll()
    assert c.snapshot()["configured"] == "active" and c.snapshot()["last_writer"] == "operator"
    n = len(c.snapshot()["transitions"])
    (tmp_path / "new").write_text("mode: canary\ncanary_fraction: 0.1\n")  # ... until the file is written,
    os.replace(tmp_path / "new", flag)  # even with the same bytes (atomically, as documented)
    w.poll()
    snap = c.snapshot()
    assert snap["configured"] == "canary" and snap["last_writer"] == "flag_file"
    assert len(snap["transitions"]) == n + 1 and snap["transitions"][-1]["reason"] == "flag_file"
    w.poll()  # untouched: nothing applied again
    assert len(c.snapshot()["transitions"]) == n + 1


def test_a_flag_file_mode_the_process_cannot_carry_out_is_a_flag_error(tmp_path: Path) -> None:
    flag = tmp_path / "mode.yaml"
    flag.write_text("mode: active\n")
    c = ModeController(ModeConfig(mode="shadow", active_available=False))
    FlagFileWatcher(str(flag), c).poll()
    snap = c.snapshot()
    assert snap["current"] == "shadow" and snap["transitions"][-1]["reason"] == "flag_error"
    assert str(flag) in snap["last_flag_error"] and "without --active" in snap["last_flag_error"]


def test_a_serve_process_without_active_refuses_put_409_and_says_why(tmp_path: Path) -> None:
    flag = tmp_path / "mode.yaml"
    flag.write_text("mode: shadow\n")
    argv = [*SERVE, "--mode-file", str(flag), "--mode-file-interval", "0.05", "--admin-token", TOKEN]
    auth = {"authorization": f"Bearer {TOKEN}"}
    with shadow_process(argv) as (_, ready):
        api = ready["api"]
        doc = httpx.get(api + "/v1/mode", timeout=10).json()
        assert doc["active_routing"]["available"] is False and doc["current"] == "shadow"
        for mode in ("active", "canary", "fallback"):
            r = httpx.put(api + "/v1/mode", json={"mode": mode}, headers=auth, timeout=10)
            assert r.status_code == 409, r.text
            assert "without --active" in r.json()["error"]
        doc = httpx.get(api + "/v1/mode", timeout=10).json()
        assert doc["current"] == "shadow" and doc["admin"]["rejected"] == {"unavailable": 3}
        assert httpx.put(api + "/v1/mode", json={"mode": "shadow", "pin": True}, headers=auth,
                         timeout=10).status_code == 200
        (tmp_path / "new").write_text("mode: active\n")
        os.replace(tmp_path / "new", flag)
        doc = _until(lambda: (d := httpx.get(api + "/v1/mode", timeout=10).json())["last_flag_error"] and d,
                     "the flag file's refused mode")
        assert doc["current"] == "shadow" and "without --active" in doc["last_flag_error"]
        metrics = httpx.get(api + "/metrics", timeout=10).text
        assert 'shadow_mode{mode="shadow"} 1.0' in metrics
        assert 'shadow_mode_transitions_total{mode="shadow",reason="flag_error"} 1.0' in metrics


BAD_START = [
    (["--mode", "bogus"], {}, "--mode must be one of shadow, canary, active, fallback, got 'bogus'"),
    (["--mode", "active"], {}, "--mode active needs --active"),
    (["--mode", "canary"], {}, "--mode canary needs --active"),
    ([], {"SHADOW_SERVE_MODE": "bogus"}, "--mode (from env SHADOW_SERVE_MODE) must be one of"),
    (["--canary-fraction", "2"], {}, "--canary-fraction must be a fraction in [0, 1], got 2.0"),
    (["--canary-fraction", "nan"], {}, "--canary-fraction must be a fraction in [0, 1]"),
    ([], {"SHADOW_SERVE_CANARY_FRACTION": "-0.5"},
     "--canary-fraction (from env SHADOW_SERVE_CANARY_FRACTION)"),
    (["--scrape-interval", "-1"], {}, "--scrape-interval must be >= 0 s"),
    (["--active", "--scrape-interval", "0"], {}, "--scrape-interval 0 turns reconciliation off"),
    (["--ttl", "-5"], {}, "--ttl must be > 0 s"),
    (["--header-timeout", "0"], {}, "--header-timeout must be > 0 s"),
    (["--mode-file-interval", "-0.1"], {}, "--mode-file-interval must be > 0 s"),
    (["--mode-check-interval", "0"], {}, "--mode-check-interval must be > 0 s"),
    (["--trip-stale", "-1"], {}, "--trip-stale must be > 0 s"),
    (["--trip-window", "0"], {}, "--trip-window must be > 0 s"),
    (["--holddown", "20", "--holddown-max", "10"], {}, "--holddown-max 10.0 is below --holddown 20.0"),
    (["--pool-ttl", "0"], {}, "--pool-ttl must be > 0 s"),
    (["--kv-pause", "0.5", "--kv-resume", "0.7"], {}, "--kv-resume 0.7 is above --kv-pause 0.5"),
    (["--oracle-interval", "-1"], {}, "--oracle-interval must be >= 0 s"),
    (["--replica-id", "r" * 129], {}, "--replica-id must be 1 to 128 printable characters"),
    (["--replica-id", ""], {}, "--replica-id must be 1 to 128 printable characters"),
    (["--replica-id", "a\nb"], {}, "--replica-id must be 1 to 128 printable characters"),
]


@pytest.mark.parametrize(("extra", "env", "message"), BAD_START)
def test_every_bad_start_up_value_exits_2_with_one_line_naming_its_flag(
        extra: list[str], env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from shadow.commands.serve import main

    for k in [k for k in os.environ if k.startswith("SHADOW_SERVE_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main([*SERVE[1:], *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_bad_value_from_the_config_file_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from shadow.commands.serve import main

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("mode: turbo\n")
    assert main([*SERVE[1:], "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--mode (from config {cfg}) must be one of" in err and len(err.splitlines()) == 1


def test_the_real_command_exits_2_before_binding_anything() -> None:
    res = subprocess.run(shadow_argv(*SERVE, "--mode", "bogus"), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == ("shadow serve: --mode must be one of shadow, canary, active, fallback, "
                                  "got 'bogus'")


@pytest.mark.parametrize(("explicit", "env", "label", "detail"), [
    ({"mode": "shadow"}, {}, "flag", "mode from flag"),
    ({}, {"SHADOW_SERVE_MODE": "shadow"}, "env", "mode from env SHADOW_SERVE_MODE"),
    ({"active": True}, {"SHADOW_SERVE_CANARY_FRACTION": "0.2"}, "default",
     "canary_fraction from env SHADOW_SERVE_CANARY_FRACTION"),
])
def test_the_start_source_is_labelled_truthfully(explicit: dict[str, Any], env: dict[str, str], label: str,
                                                 detail: str) -> None:
    from shadow.commands.serve import config_from_args, resolve_args

    args = resolve_args({"worker": ["d0=http://127.0.0.1:9"], "slots": 4, **explicit}, env)
    mc = config_from_args(args).mode_config
    assert mc is not None and mc.source == label
    first = ModeController(mc).snapshot()["transitions"][0]
    assert first["reason"] == label and detail in first["detail"], first


ACTIVE = ["--active", "--scrape-interval", "1"]
FRONT = ["--front", "r=http://127.0.0.1:9", "--relay", "thread"]
LEASE = [*ACTIVE, *FRONT, "--lease-etcd", "http://127.0.0.1:9"]

#: (extra flags, environment, what the one line on stderr says) of `shadow serve` started for real.
BAD_START_PROCESS = [
    ([*LEASE, "--lease-ttl", "1.5"], {}, "--lease-ttl must be a whole number of seconds >= 2"),
    ([*LEASE, "--lease-ttl", "1"], {}, "--lease-ttl must be a whole number of seconds >= 2"),
    ([*LEASE, "--lease-ttl", "inf"], {}, "--lease-ttl must be a whole number of seconds >= 2"),
    (LEASE, {"SHADOW_SERVE_LEASE_TTL": "1"},
     "--lease-ttl (from env SHADOW_SERVE_LEASE_TTL) must be a whole number of seconds >= 2"),
    ([*ACTIVE, "--degrade-calibration", "0"], {},
     "--degrade-calibration must be a fraction in (0, 1], got 0.0"),
    ([*ACTIVE, "--degrade-oracle-gap", "0"], {}, "--degrade-oracle-gap must be > 0, got 0.0"),
    ([*ACTIVE, "--degrade-net-gain", "nan"], {}, "--degrade-net-gain must be a finite number, got nan"),
    ([*ACTIVE, "--active-max-connections", "0"], {}, "--active-max-connections must be >= 1, got 0"),
    ([*ACTIVE, "--canary-steps", "0.5,0.2"], {}, "--canary-steps must be increasing fractions in (0, 1), "
     "got '0.5,0.2'"),
    ([*ACTIVE, "--canary-steps", "0"], {}, "--canary-steps must be increasing fractions in (0, 1), got '0'"),
    ([*ACTIVE, "--canary-steps", "1.5"], {}, "--canary-steps must be increasing fractions in (0, 1)"),
    (["--canary-steps", "abc"], {}, "--canary-steps must be comma-separated fractions, got 'abc'"),
    ([*ACTIVE, "--canary-min-step", "60", "--canary-max-step", "30"], {},
     "--canary-max-step 30.0 is below --canary-min-step 60.0"),
    (["--port", "70000"], {}, "--port must be a port in 0..65535 (0 = a free one), got 70000"),
    (["--port", "-1"], {}, "--port must be a port in 0..65535 (0 = a free one), got -1"),
    ([*ACTIVE, "--active-port", "70000"], {}, "--active-port must be a port in 0..65535"),
    (["--tap-metrics-port", "70000"], {}, "--tap-metrics-port must be a port in 0..65535"),
    (["--worker", "d1=http://127.0.0.1:70000"], {},
     "--worker 'd1=http://127.0.0.1:70000': the port must be in 1..65535"),
    (["--upstream", "u0=http://127.0.0.1:70000", "--relay", "thread"], {},
     "--upstream 'u0=http://127.0.0.1:70000': the port must be in 1..65535"),
    (["--prefill", "p0=http://127.0.0.1:-1", "--relay", "thread"], {},
     "--prefill 'p0=http://127.0.0.1:-1': the port must be in 1..65535"),
    (["--front", "r=http://127.0.0.1:70000", "--relay", "thread"], {},
     "--front 'r=http://127.0.0.1:70000': the port must be in 1..65535"),
    (["--metrics-of", "d0=http://127.0.0.1:70000"], {},
     "--metrics-of 'd0=http://127.0.0.1:70000': the port must be in 1..65535"),
    (["--forward", "http://127.0.0.1:70000"], {}, "--forward 'http://127.0.0.1:70000': the port must be in "
     "1..65535"),
    ([*ACTIVE, *FRONT, "--lease-etcd", "http://127.0.0.1:70000"], {},
     "--lease-etcd 'http://127.0.0.1:70000': the port must be in 1..65535"),
    (["--attach", "tcp://127.0.0.1:70000"], {}, "--attach 'tcp://127.0.0.1:70000': the port must be in "
     "1..65535"),
    (["--attach", "tcp://127.0.0.1:9"], {}, "--attach 'tcp://127.0.0.1:9': attaching over TCP needs "
     "--attach-token"),
    (["--worker", "d1"], {}, "--worker must be NAME=URL, got 'd1'"),
    (["--worker", "d0=http://127.0.0.1:8"], {}, "--worker name 'd0' given twice"),
    (["--policies", "br0,nope"], {}, "--policies: unknown policy 'nope'"),
    (["--step-a", "-1"], {}, "--step-a must be >= 0 s, got -1.0"),
    (["--step-b", "nan"], {}, "--step-b must be >= 0 s, got nan"),
    (["--step-window", "inf"], {}, "--step-window must be > 0 s, got inf"),
    (["--analysis-nice", "20"], {}, "--analysis-nice must be in 0..19, got 20"),
    (["--max-body", "0"], {}, "--max-body must be >= 1, got 0"),
    (["--max-head", "0"], {}, "--max-head must be >= 1, got 0"),
    (["--api-max-connections", "0"], {}, "--api-max-connections must be >= 1, got 0"),
    (["--queue-bytes", "0"], {}, "--queue-bytes must be >= 1, got 0"),
    # 0 as the tap group it starts refuses it (one bound, `RelayBounds`: it passed here before)
    (["--retain-bytes", "0"], {}, "--retain-bytes must be >= 1, got 0"),
    (["--retain-ended", "0"], {}, "--retain-ended must be >= 1, got 0"),
    (["--ring-bytes", "-1"], {}, "--ring-bytes must be >= 0, got -1"),
    (["--max-id-len", "0"], {}, "--max-id-len must be >= 1, got 0"),
    (["--max-live", "0"], {}, "--max-live must be >= 1, got 0"),
    (["--record-max-bytes", "100"], {}, "--record-max-bytes must be >= 4096 bytes, got 100"),
]

#: How long a `shadow serve` that is refused may take to exit (a deadline, not a speed limit).
REFUSED_WITHIN_S = 120.0


@pytest.mark.parametrize(("extra", "env", "message"), BAD_START_PROCESS)
def test_the_real_command_refuses_every_bad_start_up_value_with_exit_2_and_one_line_naming_its_flag(
        extra: list[str], env: dict[str, str], message: str, tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SHADOW_SERVE_")}
    try:
        res = subprocess.run(shadow_argv(*SERVE, "--state-dir", str(tmp_path), *extra), capture_output=True,
                             text=True, timeout=REFUSED_WITHIN_S, env={**environ, **env})
    finally:
        stop_tap_groups(tmp_path)  # none was started (nothing starts before the checks), if one was
    lines = res.stderr.strip().splitlines()
    assert (res.returncode, res.stdout, len(lines)) == (2, "", 1), res.stderr[-2000:]
    assert lines[0].startswith("shadow serve: ") and message in lines[0], lines[0]


@pytest.mark.parametrize("command", ["serve", "tap"])
def test_a_command_given_no_worker_to_tap_is_a_usage_error_naming_the_flags(command: str,
                                                                            tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SHADOW_SERVE_", "SHADOW_TAP_"))}
    res = subprocess.run(shadow_argv(command, "--state-dir", str(tmp_path)), capture_output=True, text=True,
                         timeout=REFUSED_WITHIN_S, env=environ)
    lines = res.stderr.strip().splitlines()
    assert (res.returncode, res.stdout, len(lines)) == (2, "", 1), res.stderr[-2000:]
    assert lines[0].startswith(f"shadow {command}: give --upstream NAME=URL"), lines[0]
