"""The control plane of `shadow serve` against hostile inputs, each on a real serve process.

A flag file replaced by a FIFO (never waited on), admin bodies beyond what a JSON reader should
take (400/422, never 500).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx

from tests.active.procs import shadow_process

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
        (tmp_path / "new").write_text("mode: active\npin: true\n")
        os.replace(tmp_path / "new", flag)
        _until(lambda: httpx.get(api + "/v1/mode", timeout=10).json()["current"] == "active",
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
