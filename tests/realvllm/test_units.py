"""The engine tier's parts that need no engine (the step sender against a real event API, the CLI's
errors) and the model builder's determinism and cache (in the engine venv)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from shadow.base.procs import shadow_argv
from shadow.contracts.events import load_schema
from shadow.mirror.api import create_app, parse_event
from shadow.mirror.hub import Mirror
from shadow.mirror.state import MirrorState
from shadow.realvllm.stepsender import EngineSched, StepSample, StepSender, sample_of, sender_from_env
from tests.realvllm.helpers import wait_for

TOKEN = "unit-events-token"


@pytest.fixture(scope="module")
def event_api() -> Iterator[tuple[str, Mirror]]:
    """The real mirror event API (token required) served by uvicorn on a free port."""
    mirror = Mirror(MirrorState(["d0", "d1"], ttl_s=30))
    app = create_app(mirror, CollectorRegistry(), ingest_token=TOKEN)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_for(lambda: server.started, "uvicorn to start", timeout=30, step=0.05)
    yield url, mirror
    server.should_exit = True
    thread.join(10)
    sock.close()


def _steps(url: str) -> list[dict[str, object]]:
    r = httpx.get(f"{url}/v1/events", params={"after": 0, "limit": 100000}, timeout=10, trust_env=False)
    return [e for e in map(json.loads, r.text.splitlines()) if e["type"] == "step"]


def _valid_steps(url: str, before: int) -> list[dict[str, object]]:
    """The step events after the first `before`, each valid by the schema and the parser."""
    got = _steps(url)[before:]
    validator = jsonschema.Draft202012Validator(load_schema())
    for e in got:
        validator.validate(e)
        parse_event(e)
    return got


def sample(t: float, running: int = 3, elapsed: float | None = 0.004, engine: int = 0) -> StepSample:
    return StepSample(t, engine, elapsed, running, 1, 0.25, running, 0)


def test_sender_posts_valid_step_events_with_the_token(event_api: tuple[str, Mirror]) -> None:
    url, _ = event_api
    before = len(_steps(url))
    sender = StepSender(url, token=TOKEN, worker="d{engine}", flush_s=0.01)
    try:
        t0 = time.monotonic()  # the engine's clock is the host's (events within the skew of it)
        for s in (sample(t0), sample(t0 + 0.01), sample(t0 + 0.02, running=0), sample(t0 + 0.5, elapsed=None),
                  sample(t0 + 0.6, engine=1)):
            assert sender.offer(s)
        wait_for(lambda: sender.counts.sent == 5, "5 steps sent", timeout=30)
    finally:
        sender.close()
    got = _valid_steps(url, before)
    assert [e["worker"] for e in got] == ["d0", "d0", "d0", "d0", "d1"]
    assert [e["source"] for e in got] == ["probe", "probe", "probe", "probe_interval", "probe"]
    # the time since the previous step only where the engine was busy through it
    assert ["interval_s" in e for e in got] == [False, True, True, False, False]
    assert got[1]["interval_s"] == pytest.approx(0.01)
    assert got[3]["duration_s"] == 0.0  # no elapsed and no busy predecessor: nothing measured
    assert sender.counts.rejected == {}


def test_sender_without_the_token_is_refused_and_counts_the_loss(event_api: tuple[str, Mirror]) -> None:
    url, _ = event_api
    sender = StepSender(url, flush_s=0.01)
    try:
        sender.offer(sample(1.0))
        wait_for(lambda: sender.counts.dropped_failed == 1, "the refused batch counted", timeout=30)
    finally:
        sender.close()
    assert sender.counts.sent == 0 and "401" in sender.counts.last_error


def test_offer_never_blocks_when_the_sink_hangs() -> None:
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # accepts (kernel backlog) and never answers
    sender = StepSender(f"http://127.0.0.1:{hole.getsockname()[1]}", max_queue=2, flush_s=0.01,
                        timeout_s=5.0)
    try:
        assert sender.offer(sample(1.0))
        wait_for(lambda: not sender._queue, "the sender to take the first step into its post", timeout=30)
        results = [sender.offer(sample(2.0 + i)) for i in range(50)]
        assert results == [True, True] + [False] * 48
        assert sender.counts.dropped_full == 48
    finally:
        sender.close(timeout_s=0.1)
        hole.close()
    c = sender.counts
    assert c.sent + c.dropped_full + c.dropped_failed + c.dropped_closed == 51


def test_sender_from_env_is_inert_without_a_url_and_checks_it() -> None:
    assert sender_from_env({}) is None
    assert sender_from_env({"SHADOW_PROBE_URL": "  "}) is None
    with pytest.raises(ValueError, match="probe URL"):
        sender_from_env({"SHADOW_PROBE_URL": "ftp://x"})
    s = sender_from_env({"SHADOW_PROBE_URL": "http://127.0.0.1:9/", "SHADOW_PROBE_QUEUE": "7",
                         "SHADOW_PROBE_WORKER": "d3"})
    assert s is not None
    try:
        assert s.url == "http://127.0.0.1:9/v1/events" and s.max_queue == 7 and s.worker_name(0) == "d3"
    finally:
        s.close(timeout_s=0.1)


def test_fleet_cli_names_a_missing_engine_venv_and_sim_only_flags(tmp_path: Path) -> None:
    done = subprocess.run(shadow_argv("fleet", "--engine", "vllm", "--vllm-venv", str(tmp_path / "none")),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "scripts/install-vllm.sh" in done.stderr, done.stderr
    done = subprocess.run(shadow_argv("fleet", "--engine", "vllm", "--fault", "decode/0:stall_s=1"),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "--fault" in done.stderr and "--engine sim" in done.stderr


def _build(venv: Path, out: Path, size: str, seed: int) -> str:
    subprocess.run([str(venv / "bin" / "python"), "-m", "shadow.realvllm.model", "--size", size,
                    "--seed", str(seed), "--out", str(out)],
                   capture_output=True, text=True, timeout=600, check=True)
    digest: str = json.loads((out / "shadow-model.json").read_text())["content_sha256"]
    return digest


def test_model_builder_is_deterministic_and_its_cache_checks_content(engine_venv: Path, tmp_path: Path,
                                                                     ) -> None:
    a = _build(engine_venv, tmp_path / "a", "tiny", 7)
    b = _build(engine_venv, tmp_path / "b", "tiny", 7)
    c = _build(engine_venv, tmp_path / "c", "tiny", 8)
    assert a == b != c
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    py = str(engine_venv / "bin" / "python")
    cache = tmp_path / "cache"
    argv = [py, "-m", "shadow.realvllm.model", "--size", "tiny", "--seed", "7", "--models-dir", str(cache)]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    path = Path(first.stdout.strip())
    assert "building" in first.stderr and path.parent == cache
    assert json.loads((path / "shadow-model.json").read_text())["content_sha256"] == a
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    assert again.stdout == first.stdout and "building" not in again.stderr  # a cache hit
    (path / "tokenizer.json").write_text("{}")  # a damaged copy is rebuilt, not served
    fixed = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    assert "building" in fixed.stderr and fixed.stdout == first.stdout
    assert json.loads((path / "shadow-model.json").read_text())["content_sha256"] == a
    chat = subprocess.run([py, "-c", "import sys; from transformers import AutoTokenizer; "
                           "t = AutoTokenizer.from_pretrained(sys.argv[1]); "
                           "print(t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False, "
                           "add_generation_prompt=True))", str(path)],
                          capture_output=True, text=True, timeout=300, check=True)
    assert chat.stdout == "<|user|>\nhi<|end|>\n<|assistant|>\n\n"



def _details(**kw: object) -> SimpleNamespace:
    base: dict[str, object] = {"iteration_index": 7, "num_ctx_requests": 1, "num_ctx_tokens": 120,
                               "num_generation_requests": 5, "num_generation_tokens": 5, "elapsed_ms": 3.0,
                               "is_dummy": False}
    return SimpleNamespace(**{**base, **kw})


def _stats(details: object) -> SimpleNamespace:
    return SimpleNamespace(iteration_details=details, num_running_reqs=6, num_waiting_reqs=2,
                           kv_cache_usage=0.25)


def _iteration() -> SimpleNamespace:
    return SimpleNamespace(num_generation_tokens=6, num_preempted_reqs=0,
                           prompt_token_stats=SimpleNamespace(computed=96, total=120),
                           time_to_first_tokens_iter=[0.05],
                           inter_token_latencies_iter=[0.0061, 0.0060, 0.0090])


def test_a_step_sample_takes_what_the_engine_scheduled_and_its_own_period() -> None:
    """With iteration details: the scheduler's counts of the step (`compute_iteration_details`);
    without: the iteration's computed prompt tokens and first/next tokens. Either way the period
    on the engine's clock is the shortest inter-token latency (the requests that decoded in the
    previous step too)."""
    s = sample_of(10.0, 1, _stats(_details()), _iteration())
    assert (s.elapsed_s, s.running, s.waiting, s.tokens) == (0.003, 6, 2, 6)
    scheduled = (s.prefill_tokens, s.prefill_requests, s.decode_requests, s.iteration, s.dummy)
    assert scheduled == (120, 1, 5, 7, False)
    assert s.engine_interval_s == 0.0060
    bare = sample_of(10.0, 0, _stats(None), _iteration())
    assert bare.elapsed_s is None and bare.iteration is None
    assert (bare.prefill_tokens, bare.prefill_requests, bare.decode_requests) == (96, 1, 3)
    dummy = sample_of(10.0, 0, _stats(_details(is_dummy=True, num_ctx_tokens=0, num_ctx_requests=0,
                                               num_generation_requests=0)), None)
    assert dummy.dummy and dummy.engine_interval_s is None and dummy.tokens == 0
    old = sample_of(10.0, 0, _stats(None), SimpleNamespace(num_generation_tokens=1, num_preempted_reqs=0))
    assert (old.prefill_tokens, old.prefill_requests, old.decode_requests) == (0, 0, 0)  # an older vLLM


class _Sched:
    """EngineSched's sender-side interface: counts the looks the sender thread makes."""

    wanting = False

    def __init__(self) -> None:
        self.looks = 0

    def look(self, now: float) -> None:
        self.looks += 1


def test_sender_posts_the_scheduled_counts_and_the_engines_cpu_times(event_api: tuple[str, Mirror]) -> None:
    """The engine's (run, wait) seconds read at a step's record time go out with it as they are;
    a step read without them has none; the sender thread looks for the engines at each post."""
    url, _ = event_api
    before = len(_steps(url))
    sched = _Sched()
    sender = StepSender(url, token=TOKEN, worker="d{engine}", flush_s=0.01, sched=sched)  # type: ignore[arg-type]
    try:
        t0 = time.monotonic()
        assert sender.offer(sample_of(t0, 0, _stats(_details()), _iteration()))
        wait_for(lambda: sender.counts.sent == 1, "the first step sent", timeout=30)
        assert sender.offer(sample_of(time.monotonic(), 0, _stats(_details()), _iteration(), (1.5, 4.0)))
        wait_for(lambda: sender.counts.sent == 2, "the second step sent", timeout=30)
    finally:
        sender.close()
    got = _valid_steps(url, before)
    assert got[0]["prefill_tokens"] == 120 and got[0]["decode_requests"] == 5 and got[0]["iteration"] == 7
    assert got[0]["engine_interval_s"] == 0.006 and "dummy" not in got[0]
    assert "engine_wait_s" not in got[0] and "engine_run_s" not in got[0]  # not read at that step
    assert (got[1]["engine_run_s"], got[1]["engine_wait_s"]) == (1.5, 4.0)
    assert sched.looks >= 2


def test_engine_sched_finds_the_engine_cores_below_the_api_server(tmp_path: Path) -> None:
    """A /proc tree: the API server 100, its engine cores 101 (DP rank 1, under a helper 102) and
    103 (no DP), another process 104 titled like an engine but not below 100."""

    def proc(pid: int, ppid: int, title: bytes, sched: str | None = None) -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (x y) S {ppid} 1 1\n")
        (d / "cmdline").write_bytes(title + b"\0--flag\0")
        if sched is not None:
            (d / "schedstat").write_text(sched)

    proc(100, 1, b"vllm")
    proc(102, 100, b"helper")
    proc(101, 102, b"VLLM::EngineCore_DP1", "2500000000 500000000 42\n")
    proc(103, 100, b"VLLM::EngineCore", "1000000000 0 7\n")
    proc(104, 1, b"VLLM::EngineCore_DP0", "9 9 9\n")
    sched = EngineSched(root=100, proc=str(tmp_path))
    # the probe's side polls (never scans /proc): nothing until the sender's side has looked
    assert sched.poll(1) is None and sched.poll(0) is None
    sched.look(0.0)
    assert sched.poll(1) == (2.5, 0.5) and sched.poll(0) == (1.0, 0.0)
    (tmp_path / "101" / "schedstat").write_text("2600000000 900000000 43\n")
    assert sched.poll(1) == (2.6, 0.9)  # read again through the file kept open
    assert sched.read(2, 0.0) is None  # no such engine here
    (tmp_path / "101" / "schedstat").write_text("")  # the engine went away (its file reads nothing)
    assert sched.poll(1) is None and sched.read(1, 1.0) is None  # not looked for again before 5 s
    (tmp_path / "101" / "schedstat").write_text("2700000000 1000000000 44\n")
    assert sched.read(1, 10.0) == (2.7, 1.0)  # found again
    assert EngineSched(root=100, proc=str(tmp_path / "none")).read(0, 0.0) is None


def test_engine_sched_reads_the_worker_that_runs_the_forward_pass(tmp_path: Path) -> None:
    """vLLM's CPU build runs each engine's forward pass in a worker process below its engine core
    (the engine core spins, runnable, while it waits): the worker's main thread is the measure; of
    tensor-parallel workers the first started."""

    def proc(pid: int, ppid: int, title: bytes, sched: str) -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (x) S {ppid} 1 1\n")
        (d / "cmdline").write_bytes(title + b"\0")
        (d / "schedstat").write_text(sched)

    proc(100, 1, b"vllm", "1 1 1\n")
    proc(101, 100, b"VLLM::EngineCore_DP0", "4000000000 6000000000 9\n")  # the spinning loop
    proc(103, 101, b"VLLM::Worker_DP0_TP1", "5000000000 0 9\n")
    proc(102, 101, b"VLLM::Worker_DP0_TP0", "8700000000 1300000000 9\n")
    proc(104, 101, b"python", "9 9 9\n")  # (a helper of the engine core: not a worker)
    proc(105, 100, b"VLLM::EngineCore_DP1", "2000000000 0 9\n")  # no worker: the engine core itself
    sched = EngineSched(root=100, proc=str(tmp_path))
    assert sched.read(0, 0.0) == (8.7, 1.3) and sched.pid(0, 0.0) == 102
    assert sched.read(1, 0.0) == (2.0, 0.0) and sched.pid(1, 0.0) == 105


def test_the_engines_are_found_once_they_are_up_before_their_first_step(tmp_path: Path) -> None:
    """The probe wants its engines when vLLM says they are up (`log_engine_initialized`); the sender
    thread looks for them then, so the first step polled already has their CPU times (a burst of
    steps shorter than the sender's first post had none: found by the real-engine tier on a fast host)."""
    d = tmp_path / "101"
    d.mkdir()
    (d / "stat").write_text("101 (x) S 100 1 1\n")
    (d / "cmdline").write_bytes(b"VLLM::EngineCore\0")
    (d / "schedstat").write_text("3000000000 250000000 9\n")
    sched = EngineSched(root=100, proc=str(tmp_path))
    assert not sched.wanting
    sched.want([0])
    assert sched.wanting
    sender = StepSender("http://127.0.0.1:9/v1/events", flush_s=0.01, sched=sched)
    try:
        wait_for(lambda: not sched.wanting, "the sender thread's look", timeout=30)
    finally:
        sender.close(0.1)
    assert sched.poll(0) == (3.0, 0.25)  # the first poll of a step: already found


LISTEN_IN_OWN_GROUP = ("import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
                       "print(s.getsockname()[1], flush=True); sys.stdin.read()")


def test_a_health_answer_counts_only_from_a_port_the_servers_group_listens_on() -> None:
    """The launcher takes a server's health answer as its own only while a process of the server's
    group listens on the port (a tap once held a DP server's port: the server exited, the tap
    answered its health check and the tier's tests ran against the tap)."""
    from shadow.realvllm.launcher import group_listens_on

    ours = socket.socket()
    ours.bind(("127.0.0.1", 0))
    port = ours.getsockname()[1]
    assert not group_listens_on(os.getpgrp(), port), "bound, not listening: no listener yet"
    ours.listen()
    assert group_listens_on(os.getpgrp(), port)
    ours.close()
    assert not group_listens_on(os.getpgrp(), port)
    other = subprocess.Popen([sys.executable, "-c", LISTEN_IN_OWN_GROUP], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, process_group=0)
    try:
        assert other.stdout is not None
        theirs = int(other.stdout.readline())
        assert group_listens_on(other.pid, theirs)
        assert not group_listens_on(os.getpgrp(), theirs), "another group's listener taken for ours"
    finally:
        other.kill()
        other.wait(10)
