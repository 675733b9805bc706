"""The JSQ stand-in router (`shadow router`) as a real process over real HTTP: the vllm-ascend
proxy's decode rule (least outstanding body bytes, ties to the first registered), P/D legs as the
proxy sends them, release of reservations, and its one-line errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from shadow.active.prefill import prefill_score
from shadow.fleet import FleetConfig
from tests.active.procs import shadow_process
from tests.harness import FleetThread

pytestmark = pytest.mark.integration

# Slow enough that a long request stays outstanding while the test sends others.
FLEET = {"base_port": 0, "time_scale": 0.25, "prefill_c0": 0.004}


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetThread]:
    with FleetThread(FleetConfig(prefill=1, decode=2, **FLEET)) as ft:  # type: ignore[arg-type]
        yield ft


def _metric(url: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _running(url: str) -> float:
    """vllm:num_requests_running of one fleet rank (the ground truth of where requests went)."""
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running")


def _open_stream(client: openai.OpenAI, words: int) -> Any:
    """A long streamed completion; returns once its first token arrived (so it is outstanding)."""
    stream = client.completions.create(
        model="sim-llm",
        prompt="word " * words,
        max_tokens=20000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    assert first.choices and first.choices[0].text
    return stream


def test_decode_choice_by_outstanding_bytes_ties_to_first(fleet: FleetThread) -> None:
    d0, d1 = fleet.decode_urls
    # Registered b first: with nothing outstanding the tie goes to b (= rank 1).
    args = ["router", "--port", "0", "--decode", f"b={d1}", "--decode", f"a={d0}"]
    with shadow_process(args) as (_, ready):
        url = ready["url"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        big = _open_stream(client, 2000)  # → b (tie, first registered)
        assert _running(d1) == 1 and _running(d0) == 0
        small1 = _open_stream(client, 10)  # b holds more bytes → a
        small2 = _open_stream(client, 10)  # a: 1 small body < b: 1 big body → a again
        small3 = _open_stream(client, 10)  # still a (3 small < 1 big): bytes, not request counts
        assert _running(d0) == 3 and _running(d1) == 1
        assert _metric(url, "shadow_router_decisions_total", stage="decode", backend="b") == 1
        assert _metric(url, "shadow_router_decisions_total", stage="decode", backend="a") == 3
        b_bytes = _metric(url, "shadow_router_outstanding_score", stage="decode", backend="b")
        a_bytes = _metric(url, "shadow_router_outstanding_score", stage="decode", backend="a")
        assert b_bytes > a_bytes > 0
        for s in (big, small1, small2, small3):
            s.close()  # the client goes away: the router releases and aborts upstream
        fleet.call(_until_idle(fleet))
        # Everything released: a tie again, which goes to the first registered (b).
        assert _metric(url, "shadow_router_outstanding_score", stage="decode", backend="a") == 0
        assert _metric(url, "shadow_router_outstanding_score", stage="decode", backend="b") == 0
        done = client.completions.create(
            model="sim-llm", prompt="x", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert done.choices[0].text
        assert _metric(url, "shadow_router_decisions_total", stage="decode", backend="b") == 2


async def _until_idle(fleet: FleetThread) -> None:
    """Wait (on the fleet's loop) until no decode rank runs or queues a request."""
    import asyncio

    for _ in range(2000):
        if all(not s.engine.running and not s.engine.waiting for s in fleet.fleet.decode_servers):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("fleet did not go idle")


def test_pd_mode_through_the_simulated_fleet(fleet: FleetThread) -> None:
    """Prefill then decode: the fleet refuses a decode leg without a live KV handle, so a full
    stream through the router proves the handle was passed on."""
    p0 = fleet.prefill_urls[0]
    args = [
        "router",
        "--port",
        "0",
        "--prefill",
        p0,
        *(a for d in fleet.decode_urls for a in ("--decode", d)),
    ]
    with shadow_process(args) as (_, ready):
        url = ready["url"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="sim-llm",
            messages=[{"role": "user", "content": "hello " * 30}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
        assert _metric(url, "shadow_router_decisions_total", stage="prefill", backend="p0") == 1
        assert _metric(url, "shadow_router_outstanding_score", stage="prefill", backend="p0") == 0
        assert _metric(url, "shadow_router_outstanding_score", stage="decode", backend="d0") == 0


class _Recorder:
    """A stub prefill/decode pair that records what the router sends (bodies and headers)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.app = Starlette(routes=[Route("/{role}/v1/completions", self._complete, methods=["POST"])])

    async def _complete(self, request: Request) -> Response:
        role = request.path_params["role"]
        body = json.loads(await request.body())
        self.seen.append((role, body, dict(request.headers)))
        if role == "p":
            return JSONResponse(
                {
                    "id": "x",
                    "choices": [{"text": "t"}],
                    "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1]},
                }
            )

        async def events() -> Any:
            yield b'data: {"choices":[{"text":"a"}]}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def recorder() -> Iterator[tuple[_Recorder, str]]:
    rec = _Recorder()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(rec.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while not server.started:  # a readiness condition, bounded: fail rather than test a dead server
        assert thread.is_alive() and time.monotonic() < deadline, "recorder server did not start"
        threading.Event().wait(0.01)
    yield rec, url
    server.should_exit = True
    thread.join(10)


def test_pd_legs_as_the_vllm_ascend_proxy_sends_them(recorder: tuple[_Recorder, str]) -> None:
    rec, base = recorder
    args = ["router", "--port", "0", "--prefill", base + "/p", "--decode", base + "/d"]
    with shadow_process(args) as (_, r):
        body = {
            "model": "m",
            "prompt": "hi there",
            "max_tokens": 50,
            "min_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        raw = json.dumps(body).encode()
        resp = httpx.post(
            r["url"] + "/v1/completions",
            content=raw,
            headers={"Content-Type": "application/json"},
            timeout=10,
        )
        assert resp.status_code == 200 and b"[DONE]" in resp.content
    (prole, pbody, phead), (drole, dbody, dhead) = rec.seen
    assert (prole, drole) == ("p", "d")
    assert pbody["stream"] is False and pbody["max_tokens"] == 1 and pbody["min_tokens"] == 1
    assert "stream_options" not in pbody
    assert pbody["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert dbody == {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1]}}
    assert phead["x-request-id"] == dhead["x-request-id"] == resp.headers["x-request-id"]
    assert len(phead["x-request-id"]) == 32
    assert prefill_score(len(raw)) == pytest.approx(0.0345 * len(raw) / 4 + 120.0745)


def test_errors_are_one_line() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "shadow", "router", "--decode", "ftp://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "must start with http://" in bad.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "shadow", "router", "--decode", "http://127.0.0.1:9", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1 and f"127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def test_unreachable_decode_is_a_502_and_released() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with shadow_process(["router", "--port", "0", "--decode", dead]) as (_, r):
        resp = httpx.post(r["url"] + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
        assert resp.status_code == 502 and "unreachable" in resp.json()["error"]["message"]
        assert _metric(r["url"], "shadow_router_outstanding_score", stage="decode", backend="d0") == 0
        assert _metric(r["url"], "shadow_router_errors_total", reason="decode_unreachable") == 1
