"""Never in the way: the data plane (taps) outlives the analysis, restarts without refusing a
connection, and a relay or upstream that dies mid-stream fails visibly.

Real processes on loopback: a simulated P/D fleet (`shadow fleet`), the real vllm-router in P/D
mode pointed at the taps, `shadow serve` in its one-command form (it starts the tap group and
adopts it after a restart), 200 streams of the official `openai` client.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.base.procs import shadow_argv
from shadow.dataplane.rundir import RunDir
from tests.live.stack import MODEL, Procs, Streams, router, wait

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.close()


def _fleet(procs: Procs) -> dict[str, Any]:
    _, ready = procs.start(
        "fleet",
        shadow_argv(
            "fleet", "--prefill", "1", "--decode", "2", "--slots", "16", "--port", "0", "--time-scale", "0.25"
        ),
    )
    return ready


def _serve_args(fleet: dict[str, Any], record: Path, *extra: str) -> list[str]:
    args = ["serve", "--slots", "16", "--scrape-interval", "0.25", "--record", str(record), *extra]
    for i, u in enumerate(fleet["decode"]):
        args += ["--upstream", f"d{i}={u}"]
    return [*args, "--prefill", f"p0={fleet['prefill'][0]}"]


def _state(api: str) -> dict[str, Any]:
    return httpx.get(api + "/v1/state", timeout=10).json()  # type: ignore[no-any-return]


def _quiet(api: str) -> dict[str, Any] | None:
    """The state once nothing is mirrored live and two more scrapes found zero drift."""
    s = _state(api)
    active = sum(w["active"] for w in s["workers"].values())
    if active or s["phantoms"] or any(s.get("drift", {}).values()):
        return None
    return s


def _recorded(path: Path) -> list[str]:
    ids = []
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        if doc.get("type") == "request":
            ids.append(doc["request_id"])
    return ids


def test_kill_9_of_the_analysis_mid_run_changes_nothing_for_200_streams(
    procs: Procs, tmp_path: Path, state_dir: Path
) -> None:
    fleet = _fleet(procs)
    rec1, rec2 = tmp_path / "rec1.ndjson", tmp_path / "rec2.ndjson"
    serve1, ready = procs.start("serve1", shadow_argv(*_serve_args(fleet, rec1)))
    url = router(procs, ready["taps"])
    with Streams(url, 200) as streams:
        wait(lambda: streams.done >= 60, "60 streams done", 180)
        os.kill(serve1.pid, signal.SIGKILL)  # the analysis dies mid-run; nothing it did can stop the relay
        serve1.wait(10)
        done_at_kill = streams.done
        wait(lambda: streams.done >= done_at_kill + 20, "streams finishing with no analysis", 120)
        _, again = procs.start("serve2", shadow_argv(*_serve_args(fleet, rec2)))
        assert again["taps"] == ready["taps"]  # the same group, adopted: the router needs no change
    assert streams.results.count("ok") == 200, [r for r in streams.results if r != "ok"][:5]
    api = again["api"]
    state = wait(lambda: _quiet(api), "the restarted analysis quiet, drift 0 and 0 phantoms", 60)
    (att,) = state["attached"]
    assert att["attached"] and att["lost_requests"] == 0 and att["snapshot"]["requests"] > 0
    assert state["tap_group"]["adopted"] is True
    # nothing lost and nothing twice: the two recordings hold every decode leg exactly once
    httpx.get(api + "/v1/report", params={"drain": 1}, timeout=60)
    ids = _recorded(rec1) + wait(
        lambda: len(r := _recorded(rec2)) + len(_recorded(rec1)) >= 200 and r, "the second recording", 30
    )
    assert len(ids) == 200 and len(set(ids)) == 200, (len(ids), len(set(ids)))
    # and the restarted analysis mirrors every later request
    with Streams(url, 10) as more:
        pass
    assert more.results.count("ok") == 10
    wait(
        lambda: (
            sum(w["finished"] for w in _state(api)["workers"].values()) == 200 - len(_recorded(rec1)) + 10
        ),
        "the later requests mirrored",
        30,
    )


def _connects(port: int, stop: threading.Event, out: dict[str, int]) -> None:
    """New connections to the tap as fast as possible, each with a request; refusals counted."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                )
                head = s.recv(64)
                out["ok" if head.startswith(b"HTTP/1.1 200") else "bad"] += 1
        except ConnectionRefusedError:
            out["refused"] += 1
        except OSError:
            out["error"] += 1


def test_a_planned_tap_reload_refuses_nothing_and_cuts_nothing(
    procs: Procs, tmp_path: Path, state_dir: Path
) -> None:
    fleet = _fleet(procs)
    _, ready = procs.start("serve", shadow_argv(*_serve_args(fleet, tmp_path / "rec.ndjson")))
    url = router(procs, ready["taps"])
    (group,) = [p.name for p in (state_dir / "taps").iterdir()]
    rd = RunDir(state_dir, group)
    old_relay = rd.read()["relay_pid"]  # type: ignore[index]
    counts = {"ok": 0, "bad": 0, "refused": 0, "error": 0}
    stop = threading.Event()
    prober = threading.Thread(
        target=_connects, args=(int(ready["taps"]["d0"].rsplit(":", 1)[1]), stop, counts)
    )
    with Streams(url, 200, tokens=60) as streams:
        wait(lambda: streams.done >= 10, "streams flowing", 120)
        prober.start()
        reload = subprocess.run(
            shadow_argv("tap", "--reload", "--name", group), capture_output=True, text=True, timeout=180
        )
        assert reload.returncode == 0, reload.stderr
        answer = json.loads(reload.stdout)
        assert answer["ok"] and answer["relay_pid"] != old_relay
        wait(lambda: streams.done >= 60, "streams after the reload", 180)
        stop.set()
        prober.join(30)
    assert streams.results.count("ok") == 200, [r for r in streams.results if r != "ok"][:5]
    assert counts["refused"] == 0 and counts["error"] == 0 and counts["bad"] == 0, counts
    assert counts["ok"] > 0
    # the old relay drained and exited; the analysis followed the new one
    wait(lambda: not os.path.exists(f"/proc/{old_relay}"), "the old relay gone", 60)
    state = wait(lambda: _quiet(ready["api"]), "quiet after the reload", 60)
    assert state["phantoms"] == 0 and state["attached"][0]["relay_pid"] == answer["relay_pid"]


def test_kill_9_of_a_relay_fails_its_streams_visibly_and_new_requests_succeed_within_a_second(
    procs: Procs, tmp_path: Path, state_dir: Path
) -> None:
    fleet = _fleet(procs)
    _, ready = procs.start("serve", shadow_argv(*_serve_args(fleet, tmp_path / "rec.ndjson")))
    tap = ready["taps"]["d0"]
    (group,) = [p.name for p in (state_dir / "taps").iterdir()]
    relay = RunDir(state_dir, group).read()["relay_pid"]  # type: ignore[index]
    with Streams(tap, 8, tokens=4000, concurrency=8) as streams:  # long streams, straight to the tap
        wait(
            lambda: (
                len(_state(ready["api"])["workers"])
                and sum(w["active"] for w in _state(ready["api"])["workers"].values()) == 8
            ),
            "8 streams live",
            60,
        )
        os.kill(relay, signal.SIGKILL)
        killed = time.monotonic()
        first_ok = None
        while first_ok is None and time.monotonic() - killed < 30:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.post(
                    tap + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=10
                )
                if r.status_code == 200:
                    first_ok = time.monotonic()
    assert first_ok is not None and first_ok - killed <= 1.0, first_ok and first_ok - killed
    # every stream on the killed relay raised in the client (an aborted body), none looked complete
    assert len(streams.results) == 8 and all(
        r.startswith(("RemoteProtocolError", "APIConnectionError")) for r in streams.results
    ), streams.results
    for _ in range(20):  # and they keep succeeding
        r = httpx.post(
            tap + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=10
        )
        assert r.status_code == 200
    # the analysis ended the relay's requests (cut), none left as phantoms
    state = wait(lambda: _quiet(ready["api"]), "the lost streams ended in the mirror", 60)
    assert state["attached"][0]["lost_requests"] == 8 and state["attached"][0]["relay_pid"] != relay
