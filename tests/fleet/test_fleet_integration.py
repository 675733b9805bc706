"""Real peers in front of and behind the fleet: vllm-router (plain and P/D), Prometheus
scraping vllm:* series, and the `shadow fleet` command as a process."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fleet_helpers import check_stream, free_port, metric_value, wait_http, words
from openai import OpenAI

from shadow.base.tools import find_executable
from shadow.fleet import FleetConfig
from tests.harness import FleetThread

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
MODEL = "sim-llm"


class Proc:
    """A child process with its output in a file; stopped by pid on exit."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self._fh = log.open("wb")
        self.p = subprocess.Popen(args, stdout=self._fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        self._fh.close()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


def start(procs: list[Proc], args: list[str], log: Path) -> Proc:
    p = Proc(args, log)
    procs.append(p)
    return p


def router_bin() -> str:
    exe = find_executable("vllm-router")
    if exe is None:
        pytest.fail("vllm-router is not installed (pip install -e '.[test]')")
    return exe


def stream_through(url: str, chat: bool, n: int) -> list[str]:
    """Stream `n` requests through `url` with the openai client; return their ids."""
    c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    ids = []
    for i in range(n):
        kwargs: dict = {"model": MODEL, "max_tokens": 5, "stream": True,
                        "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
        if chat:
            s = c.chat.completions.create(messages=[{"role": "user", "content": words(10 + i)}], **kwargs)
        else:
            s = c.completions.create(prompt=words(10 + i), **kwargs)
        payloads = [json.dumps(ch.to_dict()) for ch in s] + ["[DONE]"]
        assert check_stream(payloads, chat=chat, include_usage=True) == 5
        ids.append(json.loads(payloads[0])["id"])
    return ids


def test_vllm_router_plain_mode(procs: list[Proc], tmp_path: Path) -> None:
    cfg = FleetConfig(prefill=0, decode=2, base_port=0, time_scale=0.25)
    with FleetThread(cfg) as ft:
        port, mport = free_port(), free_port()
        r = start(procs, [router_bin(), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                          *ft.decode_urls, "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
                          "--prometheus-port", str(mport), "--worker-startup-check-interval", "1"],
                  tmp_path / "router.log")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health", 30)
        except TimeoutError:
            pytest.fail(r.tail())
        stream_through(url, chat=False, n=2)
        stream_through(url, chat=True, n=2)
        served = [metric_value(httpx.get(u + "/metrics").text, "vllm:request_success_total")
                  for u in ft.decode_urls]
        assert served == [2, 2], served  # round robin over both ranks


def test_vllm_router_pd_mode(procs: list[Proc], tmp_path: Path) -> None:
    cfg = FleetConfig(prefill=1, decode=2, base_port=0, time_scale=0.25)
    with FleetThread(cfg) as ft:
        port, mport = free_port(), free_port()
        args = [router_bin(), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                "--prefill", ft.prefill_urls[0]]
        for d in ft.decode_urls:
            args += ["--decode", d]
        args += ["--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport)]
        r = start(procs, args, tmp_path / "router.log")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health", 30)
        except TimeoutError:
            pytest.fail(r.tail())
        ids = stream_through(url, chat=False, n=2) + stream_through(url, chat=True, n=2)
        # the routing decision is readable from the request id the router sent to both legs
        assert all("___prefill_addr_" in i and "___decode_addr_" in i for i in ids)
        pm = httpx.get(ft.prefill_urls[0] + "/metrics").text
        assert metric_value(pm, "vllm:request_success_total", finished_reason="length") == 4
        assert metric_value(pm, "vllm:kv_cache_usage_perc") == 0  # every handle was pulled
        pulled = sum(metric_value(httpx.get(d + "/metrics").text, "vllm:prompt_tokens_by_source_total",
                                  source="external_kv_transfer") for d in ft.decode_urls)
        assert pulled == metric_value(pm, "vllm:prompt_tokens_total")
        assert metric_value(httpx.get(ft.decode_urls[0] + "/metrics").text, "vllm:request_success_total") >= 1


def test_prometheus_scrapes_vllm_series(procs: list[Proc], tmp_path: Path) -> None:
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.fail("prometheus is not installed (apt-get install -y prometheus)")
    cfg = FleetConfig(prefill=1, decode=2, base_port=0, time_scale=0.25)
    with FleetThread(cfg) as ft:
        for u in ft.decode_urls:
            httpx.post(u + "/v1/completions", json={"prompt": words(8), "max_tokens": 3, "ignore_eos": True})
        targets = [u.removeprefix("http://") for u in ft.decode_urls + ft.prefill_urls]
        conf = tmp_path / "prometheus.yml"
        conf.write_text(
            "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n"
            "scrape_configs:\n  - job_name: fleet\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n")
        port = free_port()
        p = start(procs, [exe, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{port}"], tmp_path / "prometheus.log")
        try:
            wait_http(f"http://127.0.0.1:{port}/-/ready", 30)  # 503 while starting
        except TimeoutError:
            pytest.fail(p.tail())
        api = f"http://127.0.0.1:{port}/api/v1/query"
        deadline = time.monotonic() + 30
        result: list = []
        while time.monotonic() < deadline:
            try:
                query = 'vllm:generation_tokens_total{job="fleet"}'
                q = httpx.get(api, params={"query": query}, timeout=2)
                result = q.json()["data"]["result"] if q.status_code == 200 else []
                if len(result) == 3:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        assert len(result) == 3, p.tail()
        by_target = {r["metric"]["instance"]: float(r["value"][1]) for r in result}
        assert sorted(by_target.values()) == [0.0, 3.0, 3.0]
        for r in result:
            assert r["metric"]["model_name"] == MODEL and "engine" in r["metric"]
        for query in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                      'vllm:request_success_total{finished_reason="length"}',
                      "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                      "vllm:e2e_request_latency_seconds_sum", "vllm:prompt_tokens_total"):
            q = httpx.get(api, params={"query": query}).json()
            assert q["status"] == "success" and q["data"]["result"], query
        up = httpx.get(api, params={"query": "up"}).json()["data"]["result"]
        assert all(r["value"][1] == "1" for r in up)


def test_cli_prints_urls_and_stops_on_sigterm(procs: list[Proc], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "shadow", "fleet", "--prefill", "1", "--decode", "2",
                          "--port", "0", "--time-scale", "0.25", "--fault", "decode/1:slow=2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        urls = json.loads(line)
        assert set(urls) == {"prefill", "decode"} and len(urls["prefill"]) == 1 and len(urls["decode"]) == 2
        r = httpx.post(urls["decode"][0] + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200
        assert httpx.get(urls["decode"][1] + "/fleet/faults").json()["faults"]["slow"] == 2
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0
        assert p.stdout.read() == ""  # exactly one line on stdout
        with pytest.raises(httpx.ConnectError):
            httpx.get(urls["decode"][0] + "/health")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)


def _outside_ephemeral_range(span: int, rng: random.Random) -> int:
    """A random BASE with BASE..BASE+span below the kernel's ephemeral range (so no port-0 bind or
    outgoing connection anywhere on the machine is handed one of them meanwhile)."""
    try:
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    return rng.randrange(10000, max(10001, lo - span - 1))


def start_fleet_on_fixed_layout(
    args: list[str], offsets: tuple[int, ...]
) -> tuple[subprocess.Popen[str], int, dict]:
    """Start `shadow fleet --port BASE ...` on a BASE whose BASE+offset ports are free. A port can
    still be taken between the check and the fleet's bind (by any process on the machine): the
    fleet then exits with "address already in use", and only that failure is retried on a new BASE."""
    rng = random.Random()
    last_err = ""
    for _ in range(20):
        base = _outside_ephemeral_range(max(offsets), rng)
        try:
            for off in offsets:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
        except OSError:
            continue
        p = subprocess.Popen([sys.executable, "-m", "shadow", "fleet", *args, "--port", str(base)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stderr is not None
        line = p.stdout.readline()
        if line:
            return p, base, json.loads(line)
        p.wait(15)
        last_err = p.stderr.read()
        assert "address already in use" in last_err.lower(), (
            f"fleet did not start on ports near {base}: {last_err}")
    raise AssertionError(f"no free fixed-port layout in 20 tries; last error: {last_err}")


def test_cli_fixed_ports_layout(tmp_path: Path) -> None:
    p, base, urls = start_fleet_on_fixed_layout(
        ["--prefill", "2", "--decode", "2", "--dp-front", "--time-scale", "0.25"], (0, 1, 100, 101, 200))
    try:
        assert urls["prefill"] == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        assert urls["decode"] == [f"http://127.0.0.1:{base + 100}", f"http://127.0.0.1:{base + 101}"]
        assert urls["dp"] == f"http://127.0.0.1:{base + 200}"
        r = httpx.post(urls["dp"] + "/v1/completions", json={"prompt": "a", "max_tokens": 2},
                       headers={"X-data-parallel-rank": "1"}, timeout=60)  # a hang guard, not a bound
        assert r.status_code == 200
        m1 = httpx.get(urls["decode"][1] + "/metrics").text
        assert metric_value(m1, "vllm:request_success_total") == 1
        dp_metrics = httpx.get(urls["dp"] + "/metrics").text
        assert metric_value(dp_metrics, "vllm:request_success_total", engine="1") == 1
        assert metric_value(dp_metrics, "vllm:request_success_total", engine="0") == 0
        p.send_signal(signal.SIGINT)
        assert p.wait(15) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
