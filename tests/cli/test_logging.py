"""Logs: one configuration per process (text or JSON lines, trace ids from the current span),
rate-limited lines for rejected input, a start-up line without secrets, and `shadow serve --active`
under a failed request and a fallback trip: every line parses, each event is one line with its
level and trace id, and the prompt text is in none of them."""

from __future__ import annotations

import argparse
import io
import json
import logging
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from shadow.app import logs
from shadow.base.logthrottle import Throttled
from shadow.commands._service import summary


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    out = io.StringIO()
    try:
        yield out
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])


def _lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_lines_carry_level_logger_time_extra_fields_and_the_span_ids(captured: io.StringIO) -> None:
    logs.configure("info", "json", stream=captured)
    log = logging.getLogger("shadow.test")
    log.debug("below the level")
    log.info("outside a span", extra={"kind": "k1"})
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("s") as span:
        log.warning("inside a span")
        ctx = span.get_span_context()
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("with a traceback")
    first, second, third = _lines(captured)
    assert first["level"] == "info" and first["logger"] == "shadow.test" and first["kind"] == "k1"
    assert first["message"] == "outside a span" and "trace_id" not in first
    assert first["ts"].endswith("Z") and first["ts"][:4].isdigit()
    assert second["trace_id"] == format(ctx.trace_id, "032x")
    assert second["span_id"] == format(ctx.span_id, "016x")
    assert third["level"] == "error" and "RuntimeError: boom" in third["exc"] and "Traceback" in third["exc"]


def test_text_lines_and_bad_settings(captured: io.StringIO) -> None:
    logs.configure("WARNING", "text", stream=captured)
    logging.getLogger("shadow.x").info("hidden")
    logging.getLogger("shadow.x").warning("shown %d", 3, extra={"reason": "r"})
    (line,) = captured.getvalue().splitlines()
    assert " WARNING shadow.x: shown 3 [reason=r]" in line
    with pytest.raises(ValueError, match="--log-level"):
        logs.configure("loud", "text")
    with pytest.raises(ValueError, match="--log-format"):
        logs.configure("info", "xml")


def test_rejections_log_once_per_interval_per_key_and_count_the_rest(captured: io.StringIO) -> None:
    logs.configure("info", "json", stream=captured)
    now = [0.0]
    t = Throttled(logging.getLogger("shadow.t"), interval_s=10.0, clock=lambda: now[0])
    assert t.warning("bad", "rejected %s", "a")
    assert not t.warning("bad", "rejected %s", "b")
    assert not t.warning("bad", "rejected %s", "c")
    assert t.warning("other", "rejected %s", "d")
    now[0] = 10.0
    assert t.warning("bad", "rejected %s", "e")
    got = [(d["message"], d["suppressed"]) for d in _lines(captured)]
    assert got == [("rejected a", 0), ("rejected d", 0), ("rejected e", 2)]


def test_the_start_up_summary_leaves_credentials_out() -> None:
    args = argparse.Namespace(admin_token="s3cret-admin-token-123", forward_token=None, slots=8,
                              upstream=["d0=http://user:pw@10.0.0.5:8000/x"], func=print,
                              admin_token_file="/etc/shadow/s3cret", token_interval=0.5, hf_token="s3cret")
    got = summary(args)
    assert got["admin_token"] == "<redacted>" and got["forward_token"] is None
    assert got["admin_token_file"] == got["hf_token"] == "<redacted>"
    assert got["token_interval"] == 0.5  # a setting about tokens, not a credential
    assert got["upstream"] == ["d0=http://10.0.0.5:8000/x"] and got["slots"] == 8
    assert "func" not in got and "s3cret" not in json.dumps(got) and "pw" not in json.dumps(got)


@pytest.mark.integration
def test_serve_active_logs_a_failed_request_and_a_trip_as_json_lines_without_prompt_text(
    tmp_path: Path,
) -> None:
    """`shadow serve --active --log-format json` (a trip on the first slow decision; every decode
    worker answering 500): each stderr line is a JSON object; each of the 3 failed requests is one
    warning line with the client's trace id, the trip one warning line with its span's trace id; the
    marker prompt appears in no line of any process."""
    from openai import OpenAI

    from tests.telemetry.active_stack import active_stack
    from tests.telemetry.servers import OtlpReceiver, wait_for

    marker = "prompt-marker-" + secrets.token_hex(8)
    trace_id = secrets.token_hex(16)
    rx = OtlpReceiver()
    try:
        with active_stack(tmp_path, mode="active", extra=(
                "--log-format", "json", "--log-level", "info", "--decision-budget", "1e-9",
                "--trip-slow-count", "1"), env={"OTEL_SDK_DISABLED": "false",
                                                "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint}) as stack:
            stack.fleet.inject("decode/*", http_status=500)
            client = OpenAI(base_url=stack.front + "/v1", api_key="unused", max_retries=0, timeout=60)
            model = client.models.list().data[0].id
            for i in range(3):
                with pytest.raises(Exception):  # noqa: B017 - any error answer: the workers fail
                    client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": f"{marker} {i}"}], max_tokens=4,
                        extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
            log = tmp_path / "serve.log"

            def parsed() -> list[dict[str, Any]] | None:
                lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
                failed = [d for d in lines if d["message"].startswith("request failed")]
                trips = [d for d in lines if "-> fallback" in d["message"]]
                return lines if len(failed) >= 3 and trips else None

            lines = wait_for(parsed, 60, "three failed-request lines and a trip line in serve.log")
    finally:
        rx.close()
    failed = [d for d in lines if d["message"].startswith("request failed")]
    assert len(failed) == 3, failed  # one line per failed request
    assert all(d["level"] == "warning" and d["trace_id"] == trace_id for d in failed), failed
    (trip,) = [d for d in lines if "-> fallback" in d["message"]]
    assert trip["level"] == "warning" and trip["reason"] == "decision_slow", trip
    assert len(trip["trace_id"]) == 32 and int(trip["trace_id"], 16) != 0, trip
    (start,) = [d for d in lines if d["message"] == "shadow serve started"]
    assert start["config"]["admin_token"] == "<redacted>", start
    for name in ("serve.log", "router.log"):
        text = (tmp_path / name).read_text()
        assert marker not in text, name


def test_counted_refusals_become_rate_limited_lines_with_what_was_held_back(captured: io.StringIO) -> None:
    """Taps' rejected requests and refused worker pages are counted where they happen; the analysis
    side turns growth into one line per place and reason per interval, each saying how many more."""
    from shadow.mirror.rejectlog import RejectionLog

    logs.configure("info", "json", stream=captured)
    now = [0.0]
    counts = {"d0": {"bad_framing": 0, "busy": 0}}
    rl = RejectionLog("tap", lambda: counts.items(), logging.getLogger("shadow.mirror"), 10.0,
                      clock=lambda: now[0])
    rl.check()
    counts["d0"]["bad_framing"] = 3
    rl.check()
    counts["d0"]["bad_framing"] = 7  # within the interval: held back
    rl.check()
    now[0] = 11.0
    rl.check()
    rl.check()  # nothing new
    got = [(d["message"], d["reason"], d["level"]) for d in _lines(captured)]
    assert got == [("tap d0: 3 refused (bad_framing)", "bad_framing", "warning"),
                   ("tap d0: 4 refused (bad_framing)", "bad_framing", "warning")]


def test_an_isolated_analysis_error_is_counted_and_logged_with_its_traceback_once_per_interval(
    captured: io.StringIO,
) -> None:
    from shadow.mirror.hub import Mirror
    from shadow.mirror.state import MirrorState

    logs.configure("info", "json", stream=captured)
    mirror = Mirror(MirrorState({"d0": "http://127.0.0.1:9"}))
    for _ in range(3):
        try:
            raise KeyError("boom")
        except KeyError:
            mirror.count_error("analysis")
    assert mirror.errors == {"analysis": 3}
    (line,) = _lines(captured)
    assert line["level"] == "warning" and line["stage"] == "analysis"
    assert "KeyError: 'boom'" in line["exc"] and "Traceback" in line["exc"]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_demo_passes_its_log_settings_to_the_shadow_processes(tmp_path: Path) -> None:
    """`shadow demo --log-format json --log-level debug`: the serve, fleet and router it starts log
    JSON lines (every line of their log files parses), debug lines included."""
    import re
    import shutil

    from tests.cli.test_demo_live import _demo

    _, proc, _ = _demo(tmp_path, "--log-format", "json", "--log-level", "debug")
    found = re.search(r"logs in (\S+)", proc.stderr)
    assert found is not None, proc.stderr[-2000:]
    workdir = Path(found.group(1))
    try:
        for name in ("serve", "fleet", "router"):
            lines = [json.loads(x) for x in (workdir / f"{name}.log").read_text().splitlines() if x.strip()]
            assert any(d["message"] == f"shadow {name} started" for d in lines), name
            assert lines[0]["config"]["log_level"] == "debug", name
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
