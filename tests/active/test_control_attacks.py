"""The control plane of `shadow serve` against hostile inputs, each on a real serve process.

A flag file replaced by a FIFO (never waited on), admin bodies beyond what a JSON reader should
take (400/422, never 500); evidence a client or an unauthenticated peer could forge (a client's
own 4xx, token-less events) trips nothing; fallback routes only to ranks that are up; a worker
reporting NaN trips fallback and breaks no endpoint.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.active.procs import shadow_process
from tests.active.raw_upstream import Exchange, RawUpstream
from tests.active.test_fallback_e2e import SERVE_FLAGS, mode, scrapes, wait_for

TOKEN = "t" * 24
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


def test_a_flag_file_replaced_by_a_fifo_is_a_flag_error_and_the_api_keeps_answering(tmp_path: Path) -> None:
    flag = tmp_path / "mode.yaml"
    flag.write_text("mode: shadow\n")
    argv = [*SERVE, "--mode-file", str(flag), "--mode-file-interval", "0.05"]
    with shadow_process(argv) as (_, ready):
        api = ready["api"]
        assert httpx.get(api + "/v1/mode", timeout=10).json()["last_flag_error"] is None
        fifo = tmp_path / "mode.fifo"
        os.mkfifo(fifo)
        os.replace(fifo, flag)  # nobody ever opens it for writing

        def flagged() -> dict[str, Any] | None:
            # each GET must be answered: the old watcher blocked the API's loop in open() for good
            doc: dict[str, Any] = httpx.get(api + "/v1/mode", timeout=10).json()
            return doc if doc["last_flag_error"] else None

        doc = _until(flagged, "the FIFO to be reported")
        assert "not a regular file (a FIFO)" in doc["last_flag_error"], doc["last_flag_error"]
        assert doc["current"] == "shadow" and doc["transitions_total"].get("shadow/flag_error") == 1
        # a regular file again: applied as before
        (tmp_path / "new").write_text("mode: shadow\npin: true\n")
        os.replace(tmp_path / "new", flag)
        _until(lambda: httpx.get(api + "/v1/mode", timeout=10).json()["pinned"] is True,
               "the fixed file to apply")


def test_admin_bodies_beyond_a_json_reader_answer_400_and_flag_files_are_flag_errors(tmp_path: Path) -> None:
    flag = tmp_path / "mode.yaml"
    flag.write_text("mode: shadow\n")
    argv = [*SERVE, "--mode-file", str(flag), "--mode-file-interval", "0.05", "--admin-token", TOKEN]
    auth = {"authorization": f"Bearer {TOKEN}"}
    with shadow_process(argv) as (_, ready):
        api = ready["api"]

        def put(body: bytes) -> httpx.Response:
            return httpx.put(api + "/v1/mode", content=body, headers=auth, timeout=10)

        huge = b'{"mode": "canary", "canary_fraction": ' + b"9" * 4000 + b"}"
        deep = b"[" * 2000 + b"]" * 2000
        for body in (huge, deep, b'{"mode": "canary", "canary_fraction": 1e400}',
                     b'{"mode": "active", "pin": ' + b"[" * 1500 + b"]" * 1500 + b"}", b"\xff\xfe"):
            r = put(body)
            assert r.status_code == 400, (body[:60], r.status_code, r.text)
            assert "error" in r.json()
        r = put(b'{"mode": "canary", "canary_fraction": 12345678901234567890}')  # a number, out of range
        assert r.status_code == 422, r.text
        doc = httpx.get(api + "/v1/mode", timeout=10).json()
        assert doc["current"] == "shadow" and doc["admin"]["rejected"] == {"malformed": 5, "invalid": 1}
        # the same through the flag file: a flag error each time (the old watcher raised, unseen)
        for n, text in enumerate(("mode: canary\ncanary_fraction: " + "9" * 4000 + "\n",
                                  "[" * 2000 + "]" * 2000 + "\n"), start=1):
            (tmp_path / "new").write_text(text)
            os.replace(tmp_path / "new", flag)
            doc = _until(lambda n=n: (d := httpx.get(api + "/v1/mode", timeout=10).json())
                         ["transitions_total"].get("shadow/flag_error", 0) >= n and d, f"flag error {n}")
        assert "nested too deep" in doc["last_flag_error"]


@contextmanager
def fleet_and_serve(extra: list[str]) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """A `shadow fleet` of 2 decode ranks and a `shadow serve` in mode active in front of them
    (test_fallback_e2e's flags), once the first scrapes are in; yields (decode URLs, ready doc)."""
    with shadow_process(["fleet", "--decode", "2", "--slots", "8", "--port", "0"]) as (_, fleet):
        decode = fleet["decode"]
        args = ["serve", *SERVE_FLAGS, *extra]
        for i, u in enumerate(decode):
            args += ["--upstream", f"d{i}={u}"]
        with shadow_process(args) as (_, ready):
            api = ready["api"]
            wait_for(lambda: mode(api)["current"] == "active" and scrapes(api) >= 2, "first scrapes, active")
            yield decode, ready


def _complete(proxy: str, **body: Any) -> httpx.Response:
    payload = {"model": "sim-llm", "prompt": "w " * 20, "max_tokens": 4, **body}
    return httpx.post(proxy + "/v1/completions", json=payload, timeout=60)


def test_a_clients_own_bad_requests_are_not_upstream_failures() -> None:
    with fleet_and_serve(["--active"]) as (_, ready):
        api, proxy = ready["api"], ready["active"]
        for _ in range(16):  # over the trip's 10 calls in its 10 s window, all failing
            r = _complete(proxy, max_tokens="abc")
            assert r.status_code == 400, r.text
        assert _complete(proxy).status_code == 200
        m = mode(api)
        assert m["current"] == "active" and m["fallback_reason"] is None, m["transitions"]
        assert m["observed"]["upstream_failures"] == 0 and m["observed"]["upstream_calls"] >= 17
        text = httpx.get(api + "/metrics", timeout=10).text
        assert 'outcome="rejected"' in text and "shadow_active_upstream_errors_total{" not in text


def test_token_less_events_cannot_trip_the_mode_when_an_admin_token_is_set() -> None:
    t = time.monotonic()
    lines = [{"type": "route", "request_id": f"ghost-{i}", "t": t, "worker": "d0", "prompt_tokens": 10}
             for i in range(20)]
    body = "".join(json.dumps(x) + "\n" for x in lines).encode()
    with fleet_and_serve(["--admin-token", TOKEN]) as (_, ready):
        api = ready["api"]
        r = httpx.post(api + "/v1/events", content=body, timeout=10)  # loopback, no token
        assert r.status_code == 403 and "--events-token" in r.json()["error"], r.text
        s0 = scrapes(api)
        wait_for(lambda: scrapes(api) >= s0 + 5, "five scrapes")  # (drift over 4 trips at the next)
        m = mode(api)
        assert m["current"] == "active" and m["trips"] == {}, m["transitions"]
    events_token = "e" * 24
    with fleet_and_serve(["--admin-token", TOKEN, "--events-token", events_token]) as (_, ready):
        api = ready["api"]
        assert httpx.post(api + "/v1/events", content=body, timeout=10).status_code == 401
        ok = httpx.post(api + "/v1/events", content=body, timeout=10,
                        headers={"authorization": f"Bearer {events_token}"})
        assert ok.status_code == 200 and ok.json()["accepted"] == 20  # with its own token: in


def test_fallback_routes_only_to_ranks_that_are_up() -> None:
    with fleet_and_serve(["--active"]) as (decode, ready):
        api, proxy = ready["api"], ready["active"]
        assert _complete(proxy).status_code == 200
        httpx.post(decode[0] + "/fleet/faults", json={"target": "decode/1", "crash_s": -1},
                   timeout=5).raise_for_status()
        wait_for(lambda: mode(api)["current"] == "fallback", "fallback")
        before = mode(api)["observed"]["upstream_failures"]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _complete(proxy).status_code, range(40)))
        assert answers == [200] * 40, answers  # the old round-robin sent every other one to d1
        failures = mode(api)["observed"]["upstream_failures"] - before
        assert failures == 0, failures


NAN_PAGE = (b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running NaN\n"
            b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n")


async def _nan_worker(ex: Exchange) -> None:
    if ex.path.startswith("/metrics"):
        await ex.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(NAN_PAGE), NAN_PAGE))
    else:
        await ex.send(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")


def test_a_worker_reporting_nan_trips_fallback_and_every_endpoint_keeps_answering() -> None:
    with RawUpstream(_nan_worker) as up, shadow_process(["serve", *SERVE_FLAGS, "--upstream",
                                                         f"d0={up.url}"]) as (_, ready):
        api = ready["api"]
        wait_for(lambda: sum(ex.path.startswith("/metrics") for ex in up.exchanges) >= 3, "three scrapes")
        for path in ("/v1/mode", "/v1/report", "/v1/state"):  # the old code answered 500 (NaN in JSON)
            r = httpx.get(api + path, timeout=30)
            assert r.status_code == 200, (path, r.text[:300])
        # a NaN load is no good scrape: the telemetry goes stale and trips fallback (abs(NaN) > 16
        # was false, so the old NaN drift tripped nothing)
        wait_for(lambda: mode(api)["current"] == "fallback", "fallback on a NaN-reporting worker")
        assert mode(api)["fallback_reason"] == "telemetry_stale"
        assert httpx.get(api + "/v1/state", timeout=30).status_code == 200
