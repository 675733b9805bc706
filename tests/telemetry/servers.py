"""Real Prometheus and Alertmanager (Debian packages) on loopback, configured from the shipped files
in deploy/ with only addresses (and, for alert tests, timings) templated; and a webhook receiver."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Any, timeout: float, what: str, step: float = 0.2) -> Any:
    """Poll `pred` until truthy (returned) or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _exe(name: str, package: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        pytest.fail(f"{name} is not installed (apt-get install -y {package}; scripts/test.sh does)")
    return exe


class _Process:
    def __init__(self, args: list[str], log: Path) -> None:
        self._log = log.open("wb")
        self.log_path = log
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.proc.args[0]} exited with {self.proc.returncode}: "
                                 f"{self.log_path.read_text()[-2000:]}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


class Prometheus(_Process):
    """deploy/prometheus/prometheus.yml with the `shadow` (and `shadow-tap`) job's targets, the rule
    files (copied, optionally with every `for:` set to `rule_for` and every `keep_firing_for:` to
    `keep_firing_for`) and the Alertmanager address templated."""

    def __init__(self, tmp: Path, targets: list[str], *, interval: str = "1s",
                 alertmanager: str | None = None, rule_for: str | None = None,
                 keep_firing_for: str | None = None, tap_targets: list[str] | None = None) -> None:
        conf = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
        rules = tmp / "rules"
        rules.mkdir()
        for p in (ROOT / "alerts" / "rules").glob("*.yaml"):
            text = p.read_text()
            if rule_for is not None:
                text = re.sub(r"(?m)^(\s+for:) \S+$", rf"\1 {rule_for}", text)
            if keep_firing_for is not None:
                text = re.sub(r"(?m)^(\s+keep_firing_for:) \S+$", rf"\1 {keep_firing_for}", text)
            (rules / p.name).write_text(text)
        conf["global"].update(scrape_interval=interval, evaluation_interval=interval)
        conf["rule_files"] = [str(rules / "*.yaml")]
        if alertmanager is None:
            conf.pop("alerting", None)
        else:
            conf["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [alertmanager]
        (job,) = [j for j in conf["scrape_configs"] if j["job_name"] == "shadow"]
        job["static_configs"][0]["targets"] = targets
        # the data plane's job (`shadow tap --metrics-port`): scraped where given, else left out (a
        # target nobody runs would be a tap that is down)
        (tap_job,) = [j for j in conf["scrape_configs"] if j["job_name"] == "shadow-tap"]
        if tap_targets:
            tap_job["static_configs"][0]["targets"] = tap_targets
        else:
            conf["scrape_configs"].remove(tap_job)
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(conf))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__([_exe("prometheus", "prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp / 'data'}",
                          f"--web.listen-address=127.0.0.1:{self.port}"], tmp / "prometheus.log")

    def ready(self) -> bool:
        self.alive()
        try:
            return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """An instant query, now or `at` (Unix time)."""
        params: dict[str, Any] = {"query": expr} if at is None else {"query": expr, "time": at}
        r = httpx.get(self.url + "/api/v1/query", params=params, timeout=10)
        body: dict[str, Any] = r.json()
        return body


class Alertmanager(_Process):
    """deploy/alertmanager/alertmanager.yml with every webhook pointed at `webhook` and short
    grouping waits (test timing); clustering off."""

    def __init__(self, tmp: Path, webhook: str) -> None:
        conf = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
        for r in conf["receivers"]:
            for w in r.get("webhook_configs", []):
                w["url"] = webhook
        conf["route"].update(group_wait="1s", group_interval="1s")
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(conf))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        super().__init__([_exe("prometheus-alertmanager", "prometheus-alertmanager"),
                          f"--config.file={tmp / 'alertmanager.yml'}", f"--storage.path={tmp / 'am'}",
                          f"--web.listen-address={self.address}", "--cluster.listen-address="],
                         tmp / "alertmanager.log")

    def ready(self) -> bool:
        self.alive()
        try:
            return httpx.get(f"http://{self.address}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


class Webhook:
    """Collects Alertmanager webhook notifications (JSON bodies) on loopback."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with hook.lock:
                    hook.received.append(body)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def firing(self, alertname: str) -> list[dict[str, Any]]:
        with self.lock:
            return [a for body in self.received for a in body["alerts"]
                    if a["status"] == "firing" and a["labels"]["alertname"] == alertname]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on loopback: decodes every POST /v1/traces (protobuf)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.posts: list[tuple[str, str]] = []  # (path, content type)
        self.requests: list[Any] = []
        self.lock = threading.Lock()
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                with rx.lock:
                    rx.posts.append((self.path, str(self.headers.get("Content-Type"))))
                    rx.requests.append(req)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[dict[str, str], Any]]:
        """(resource attributes, span) for every span received so far."""
        with self.lock:
            out = []
            for req in self.requests:
                for rs in req.resource_spans:
                    res = {a.key: a.value.string_value for a in rs.resource.attributes}
                    out += [(res, s) for ss in rs.scope_spans for s in ss.spans]
            return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def traced_serve_process(rx: OtlpReceiver, serve_args: list[str], env: dict[str, str],
                         slots: int) -> Iterator[dict[str, Any]]:
    """A plain simulated fleet (2 decode ranks) and `shadow serve --slots SLOTS SERVE_ARGS` as a
    process exporting spans to `rx` (OTEL_* variables only, plus `env`); yields its ready line.
    On exit SIGTERM (which flushes the spans) and a clean exit is asserted."""
    import os
    import signal
    import sys

    from shadow.fleet import FleetConfig
    from tests.harness import FleetThread

    full_env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200",
                **env}
    with FleetThread(FleetConfig(prefill=0, decode=2, slots=slots, base_port=0, time_scale=0.05)) as fleet:
        args = [sys.executable, "-m", "shadow", "serve", "--slots", str(slots), *serve_args]
        for g, url in enumerate(fleet.decode_urls):
            args += ["--upstream", f"d{g}={url}"]
        proc = subprocess.Popen(args, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.strip():  # it ended before its ready line: say why (its stderr)
                _, err = proc.communicate(timeout=60)
                raise AssertionError(f"shadow serve exited {proc.returncode} before its ready line: "
                                     f"{err[-2000:]}")
            yield json.loads(line)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-2000:]
