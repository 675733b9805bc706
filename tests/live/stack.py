"""Real processes of one integration test on loopback, each in its own process group and ended by
pid; the real vllm-router in P/D mode; closed loops of official `openai` streams."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from shadow.base.procs import read_json_line
from shadow.base.tools import find_executable

MODEL = "sim-llm"


class Procs:
    """Processes of one test, each in its own process group; ended by pid at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[str]] = []

    def start(
        self, name: str, argv: list[str], ready: bool = True
    ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
        log = (self.logs / f"{name}.log").open("a")
        p = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if ready else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            process_group=0,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        log.close()
        self.procs.append(p)
        return p, (read_json_line(p, name, 90) if ready else {})

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            if p.stdout is not None:
                p.stdout.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(cond: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError, KeyError):
            got = cond()
            if got:
                return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def router(procs: Procs, taps: dict[str, str]) -> str:
    exe = find_executable("vllm-router")
    if exe is None:
        pytest.fail("vllm-router is not installed (pip install -e '.[test]')")
    port = free_port()
    argv = [
        exe,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        "--policy",
        "round_robin",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--worker-startup-check-interval",
        "1",
        "--prefill",
        taps["p0"],
    ]
    for n in ("d0", "d1"):
        argv += ["--decode", taps[n]]
    procs.start("vllm-router", argv, ready=False)
    url = f"http://127.0.0.1:{port}"
    wait(lambda: httpx.get(url + "/health", timeout=1).status_code == 200, "vllm-router healthy")
    return url


class Streams:
    """`n` openai streams through `url`, `concurrency` at a time, on a thread of their own; each
    outcome: ok (every token and a finish reason) or the error; `done` counts completions."""

    def __init__(self, url: str, n: int, tokens: int = 24, concurrency: int = 16) -> None:
        self.url, self.n, self.tokens, self.concurrency = url, n, tokens, concurrency
        self.results: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    @property
    def done(self) -> int:
        return len(self.results)

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=120)
        todo = iter(range(self.n))

        async def one(i: int) -> str:
            try:
                s = await client.completions.create(
                    model=MODEL,
                    prompt="w " * (10 + i % 50),
                    max_tokens=self.tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                got, finish = 0, None
                async for ch in s:
                    for c in ch.choices:
                        got += bool(c.text)
                        finish = c.finish_reason or finish
                return "ok" if got == self.tokens and finish == "length" else f"short {got} {finish}"
            except (openai.OpenAIError, httpx.HTTPError) as exc:  # a cut stream raises from httpx
                return f"{type(exc).__name__}: {exc}"

        async def worker() -> None:
            for i in todo:
                self.results.append(await one(i))

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        await client.close()

    def __enter__(self) -> Streams:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(300)
