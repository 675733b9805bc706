"""`shadow tap` as a process (the data plane): the ready line, its own /metrics and /health, an
analysis attaching later and getting what happened before it came, two analyses attached side by
side under their names (replicas behind the same taps), a relay killed and replaced, the group's
commands, clean stop on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.base.procs import read_json_line, shadow_argv
from shadow.dataplane.rundir import RunDir, unix_connect
from tests.mirror.helpers import attach_by_hand
from tests.mirror.stub_worker import ThreadServer, create_stub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _tap(*args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    p = subprocess.Popen(shadow_argv("tap", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, read_json_line(p, "shadow tap", 60)


def _metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not in /metrics")


def _wait(cond: Any, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_shadow_tap_serves_alone_and_an_analysis_attaching_later_sees_what_it_relayed(
    tmp_path: Path, state_dir: Path
) -> None:
    rec = tmp_path / "events.ndjson"
    with ThreadServer(create_stub("d0", tokens=3)) as up:
        p, ready = _tap("--upstream", f"d0={up.url}", "--name", "fleet")
        serve = None
        try:
            assert set(ready) == {"taps", "metrics", "attach", "pid", "group", "dir"}
            assert ready["group"] == "fleet" and ready["pid"] == p.pid
            assert ready["dir"] == str(state_dir / "taps" / "fleet")
            assert ready["taps"]["d0"].startswith("http://127.0.0.1:")
            assert (os.stat(ready["dir"]).st_mode & 0o777) == 0o700  # request bodies go through here
            r = httpx.post(
                ready["taps"]["d0"] + "/v1/completions",
                json={"model": "m", "prompt": "x", "stream": True},
                headers={"X-Request-Id": "cli-1"},
            )
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert httpx.get(ready["metrics"] + "/health").text == "ok\n"
            text = httpx.get(ready["metrics"] + "/metrics").text
            assert _metric(text, 'shadow_tap_requests_total{worker="d0"}') == 1
            assert _metric(text, "shadow_tap_analysis_attached") == 0
            assert _metric(text, "shadow_tap_kept_requests") == 1  # no analysis has it yet
            # an analysis attaching now still gets that request (the relay kept it)
            serve = subprocess.Popen(
                shadow_argv(
                    "serve",
                    "--attach",
                    ready["dir"],
                    "--upstream",
                    f"d0={up.url}",
                    "--slots",
                    "8",
                    "--scrape-interval",
                    "0.1",
                    "--record",
                    str(rec),
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            api = read_json_line(serve, "shadow serve", 60)["api"]
            state = _wait(
                lambda: (s := httpx.get(api + "/v1/state").json())["workers"]["d0"]["finished"] == 1 and s,
                "the snapshot's request mirrored",
            )
            assert state["workers"]["d0"]["active"] == 0 and state["phantoms"] == 0
            (att,) = state["attached"]
            assert att["attached"] and att["snapshot"]["requests"] == 1 and att["relay_pid"] != p.pid
            text = _wait(
                lambda: (
                    (t := httpx.get(ready["metrics"] + "/metrics").text)
                    and _metric(t, "shadow_tap_kept_requests") == 0
                    and t
                ),
                "the end acknowledged",
            )
            assert _metric(text, "shadow_tap_analysis_attached") == 1
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(30) == 0
            # the tap never noticed the analysis go away
            r = httpx.post(ready["taps"]["d0"] + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200
        finally:
            if serve is not None and serve.poll() is None:
                serve.kill()
                serve.wait(10)
            p.send_signal(signal.SIGTERM)
            rc = p.wait(30)
        assert rc == 0, p.stderr.read() if p.stderr else ""
        assert not (state_dir / "taps" / "fleet" / "tap.json").exists()  # a clean stop leaves no record
    kinds = [json.loads(x)["type"] for x in rec.read_text().splitlines()]
    assert kinds == ["session", "request"]  # compact recording: a header, one line per request


def test_bad_arguments_fail_cleanly() -> None:
    p = subprocess.run(shadow_argv("tap", "--upstream", "nope"), capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "NAME=URL" in p.stderr + p.stdout
    p = subprocess.run(
        shadow_argv("tap", "--upstream", "d0=http://127.0.0.1:9", "--attach-listen", "127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "--attach-token" in p.stderr


def _serve_attached(group_dir: str, upstream: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(shadow_argv("serve", "--attach", group_dir, "--upstream", f"d0={upstream}",
                                     "--slots", "8", "--scrape-interval", "0", *extra),
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return p, str(read_json_line(p, "shadow serve", 60)["api"])


def _finished(api: str) -> int:
    return int(httpx.get(api + "/v1/state").json()["workers"]["d0"]["finished"])


def _hello(path: Path, name: Any) -> tuple[socket.socket, bytes]:
    """Attach by hand under `name`: the connection (held: it stays attached) and what the relay
    sent first (b"" = refused)."""
    sock = unix_connect(path)
    sock.settimeout(30)
    return sock, attach_by_hand(sock, name)


def test_replicas_attach_side_by_side_each_sees_everything_and_a_name_replaces_only_its_own(
    state_dir: Path, tmp_path: Path
) -> None:
    with ThreadServer(create_stub("d0", tokens=3)) as up:
        p, ready = _tap("--upstream", f"d0={up.url}", "--name", "shared")
        procs: list[subprocess.Popen[str]] = []
        try:
            apis = {}
            for name in ("x", "y"):
                proc, apis[name] = _serve_attached(ready["dir"], up.url, "--replica-id", name)
                procs.append(proc)
            for i in range(3):
                r = httpx.post(ready["taps"]["d0"] + "/v1/completions", json={"model": "m", "prompt": str(i)})
                assert r.status_code == 200
            for api in apis.values():  # each replica's mirror has every request, the other's too
                _wait(lambda api=api: httpx.get(api + "/v1/state").json()["workers"]["d0"]["finished"] == 3,
                      f"{api} to mirror all 3 requests")
            text = _wait(lambda: ((t := httpx.get(ready["metrics"] + "/metrics").text)
                                  and _metric(t, "shadow_tap_kept_requests") == 0 and t),
                         "both analyses to acknowledge every end")
            assert _metric(text, "shadow_tap_analysis_attached") == 2
            assert _metric(text, "shadow_tap_attaches_total") == 2
            # a serve under x's name replaces x (a restart), not y (from another state directory: on
            # one, a second serve of a name is refused while the first runs)
            proc, api_x2 = _serve_attached(ready["dir"], up.url, "--replica-id", "x",
                                           "--state-dir", str(tmp_path / "elsewhere"))
            procs.append(proc)
            text = _wait(lambda: ((t := httpx.get(ready["metrics"] + "/metrics").text)
                                  and _metric(t, "shadow_tap_attaches_total") == 3 and t), "the third attach")
            assert _metric(text, "shadow_tap_analysis_attached") == 2
            r = httpx.post(ready["taps"]["d0"] + "/v1/completions", json={"model": "m", "prompt": "after"})
            assert r.status_code == 200
            # (the new x started after every end was acknowledged: it has only the new request)
            for api, n in ((apis["y"], 4), (api_x2, 1)):
                _wait(lambda api=api, n=n: _finished(api) == n, f"{api} to see the request after")
            x_state = httpx.get(apis["x"] + "/v1/state").json()
            assert x_state["workers"]["d0"]["finished"] == 3 and x_state["attached"][0]["replaced"]
            # at most 8 analyses at once: 2 attached + 6 by hand; the next name is refused and counted,
            # as is a name that is not a string
            attach = Path(ready["dir"]) / "attach.sock"
            metrics = ready["metrics"] + "/metrics"
            full, bad = (f'shadow_tap_attach_refused_total{{reason="{r}"}}' for r in ("full", "hello"))
            refused = _metric(httpx.get(metrics).text, full), _metric(httpx.get(metrics).text, bad)
            held = [_hello(attach, f"n{i}") for i in range(6)]
            assert all(first for _, first in held)
            _wait(lambda: _metric(httpx.get(metrics).text, "shadow_tap_analysis_attached") == 8, "8 attached")
            for name in ("n6", 7):
                sock, first = _hello(attach, name)
                sock.close()
                assert first == b"", name
            text = httpx.get(metrics).text
            assert (_metric(text, full), _metric(text, bad)) == (refused[0] + 1, refused[1] + 1)
            for sock, _ in held:
                sock.close()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(30)
            p.send_signal(signal.SIGTERM)
            p.wait(30)


def test_a_killed_relay_is_replaced_on_the_same_sockets_and_the_group_answers_commands(
    state_dir: Path,
) -> None:
    with ThreadServer(create_stub("d0", tokens=3)) as up:
        p, ready = _tap("--upstream", f"d0={up.url}")
        try:
            rd = RunDir(state_dir, ready["group"])
            relay = _wait(lambda: (rd.read() or {}).get("relay_pid"), "the relay's pid")
            os.kill(relay, signal.SIGKILL)
            fresh = _wait(
                lambda: (r := (rd.read() or {}).get("relay_pid")) not in (None, relay) and r, "a new relay"
            )
            # the same URL, never refused: the listening socket stayed open in the supervisor
            r = httpx.post(ready["taps"]["d0"] + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200
            text = httpx.get(ready["metrics"] + "/metrics").text
            assert _metric(text, "shadow_tap_relay_restarts_total") == 1
            status = subprocess.run(
                shadow_argv("tap", "--status"), capture_output=True, text=True, timeout=30
            )
            (doc,) = [json.loads(x) for x in status.stdout.splitlines()]
            assert doc["ok"] and doc["relay_pid"] == fresh and doc["restarts"] == 1
            stop = subprocess.run(shadow_argv("tap", "--stop"), capture_output=True, text=True, timeout=60)
            assert stop.returncode == 0 and json.loads(stop.stdout)["ok"]
            assert p.wait(30) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        assert p.stderr is not None and "restarting it" in p.stderr.read()
