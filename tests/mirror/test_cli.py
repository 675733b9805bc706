"""`shadow tap` as a process: the ready line, the API, recording, clean stop on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.mirror.stub_worker import ThreadServer, create_stub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_shadow_tap_process(tmp_path: Path) -> None:
    rec = tmp_path / "events.ndjson"
    with ThreadServer(create_stub("d0", tokens=3)) as up:
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shadow",
                "tap",
                "--upstream",
                f"d0={up.url}",
                "--scrape-interval",
                "0.1",
                "--record",
                str(rec),
                "--slots",
                "8",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert p.stdout is not None
            ready = json.loads(p.stdout.readline())
            assert set(ready) == {"taps", "api"} and ready["taps"]["d0"].startswith("http://127.0.0.1:")
            r = httpx.post(
                ready["taps"]["d0"] + "/v1/completions",
                json={"model": "m", "prompt": "x", "stream": True},
                headers={"X-Request-Id": "cli-1"},
            )
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            # Wait on conditions, not a clock: the finish has been applied (the mirrored state says
            # so), then two more scrape rounds, so the drift below was computed after the finish.
            # The test's timeout bounds the wait.
            scrapes_after = None
            while True:
                state = httpx.get(ready["api"] + "/v1/state").json()
                scrapes = state["watermark"]["scrapes"]
                if scrapes_after is None and state["workers"]["d0"]["finished"] == 1:
                    scrapes_after = scrapes + 2
                if scrapes_after is not None and scrapes >= scrapes_after:
                    break
                time.sleep(0.05)
            assert state["workers"]["d0"] == {
                "active": 0,
                "kv_tokens": 0,
                "finished": 1,
                "cancelled": 0,
                "reaped": 0,
                "slots": 8,
                "free_slots": 8,
            }
            assert state["drift"]["d0"] == 0
            metrics = httpx.get(ready["api"] + "/metrics").text
            assert 'shadow_mirror_requests_finished_total{worker="d0"} 1.0' in metrics
            assert httpx.get(ready["api"] + "/v1/events/schema").json()["oneOf"]
        finally:
            p.send_signal(signal.SIGTERM)
            rc = p.wait(10)
        assert rc == 0, p.stderr.read() if p.stderr else ""
    kinds = [json.loads(x)["type"] for x in rec.read_text().splitlines()]
    assert kinds == ["session", "request"]  # compact recording: a header, one line per request


def test_bad_arguments_fail_cleanly() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "shadow", "tap", "--upstream", "nope"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode != 0 and "NAME=URL" in p.stderr + p.stdout


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_shadow_tap_exits_when_its_relay_process_dies() -> None:
    """The taps relay in a child process; if it dies the taps are down, so `shadow tap` says so
    and exits 1 instead of serving an API about traffic it no longer sees."""
    with ThreadServer(create_stub("d0", tokens=3)) as up:
        p = subprocess.Popen(
            [sys.executable, "-m", "shadow", "tap", "--upstream", f"d0={up.url}", "--scrape-interval", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert p.stdout is not None
            ready = json.loads(p.stdout.readline())
            r = httpx.post(ready["taps"]["d0"] + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200  # relayed by the child
            (relay,) = _children(p.pid)
            os.kill(relay, signal.SIGKILL)
            rc = p.wait(30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        assert rc == 1
        assert p.stderr is not None and "relay process exited" in p.stderr.read()
