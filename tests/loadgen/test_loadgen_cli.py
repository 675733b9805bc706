"""`shadow load` command: arguments, summary output, JSON, exit codes, clean errors, Ctrl-C."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import pytest
from loadgen_stub import StubConfig, StubServer, free_port

import shadow.loadgen as loadgen
from shadow.commands import load as load_cmd
from shadow.loadgen.progress import NullProgress

pytest.importorskip("shadow.traces")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shadow")
    load_cmd.register(parser.add_subparsers(dest="command"))
    return parser


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args))


def _write_trace(path: Path, rows: list[tuple[float, int, int, str | None]]) -> str:
    with path.open("w") as f:
        for a, p, o, k in rows:
            f.write(
                json.dumps({"arrival_s": a, "prompt_tokens": p, "output_tokens": o, "prompt_key": k}) + "\n"
            )
    return str(path)


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _main(["load", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--target",
        "--time-scale",
        "--rate-scale",
        "--limit",
        "--concurrency",
        "--no-stream",
        "--chat",
        "--model",
        "--api-key",
        "--header",
        "--request-id-prefix",
        "--json",
        "exit status",
    ):
        assert option in out


def test_file_trace_summary_and_json(
    stub: StubServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", [(0.0, 6, 3, "a"), (0.1, 6, 3, "a"), (0.2, 9, 2, None)])
    out_json = tmp_path / "out.json"
    rc = _main(
        [
            "load",
            trace,
            "--target",
            stub.url,
            "--time-scale",
            "2",
            "--concurrency",
            "2",
            "--chat",
            "--header",
            "X-Team=blue",
            "--request-id-prefix",
            "cli-",
            "--json",
            str(out_json),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    # stdout is not a terminal here: plain progress lines, then the summary table
    assert "load: sending 3 requests" in captured.out and "load: 3/3 done, 0 failed" in captured.out
    assert "TTFT p50 / p99" in captured.out and "output throughput" in captured.out
    data = json.loads(out_json.read_text())
    assert data["requests"]["ok"] == 3 and data["requests"]["failed"] == 0
    assert data["tokens"]["prompt_sent"] == 21 and data["tokens"]["output"] == 8
    assert data["options"]["chat"] is True and data["options"]["time_scale"] == 2.0
    assert data["options"]["headers"] == ["X-Team"]  # header names only, never values
    assert data["model"] == "stub-model" and data["ttft_s"]["p50"] > 0
    assert {r.headers["x-request-id"] for r in stub.requests} == {"cli-0", "cli-1", "cli-2"}
    assert all(r.headers["x-team"] == "blue" and r.path == "/v1/chat/completions" for r in stub.requests)


def test_synthetic_workload_with_rate(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    stub.config = StubConfig(ttft_s=0.0, itl_s=0.0)
    rc = _main(
        [
            "load",
            "paper-templates",
            "--target",
            stub.url,
            "--limit",
            "3",
            "--rate",
            "50",
            "--quiet",
            "--no-stream",
            "--json",
            "-",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "load:" not in captured.out  # --quiet
    data = json.loads(captured.out[captured.out.index("{\n") :])
    assert data["requests"]["ok"] == 3 and data["options"]["stream"] is False
    assert len(stub.requests) == 3


def test_chat_overhead(stub: StubServer, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", [(0.0, 10, 1, None)])
    rc = _main(
        ["load", trace, "--target", stub.url, "--chat", "--chat-overhead", "4", "--json", "-", "--quiet"]
    )
    assert rc == 0
    (rec,) = stub.requests
    assert len(rec.body["messages"][0]["content"].split()) == 6
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{\n") :])["tokens"]["prompt_sent"] == 10


def test_failed_requests_exit_1(stub: StubServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stub.config = StubConfig(fail_ids={"f1"})
    trace = _write_trace(tmp_path / "t.jsonl", [(0.0, 2, 2, None), (0.0, 2, 2, None)])
    rc = _main(["load", trace, "--target", stub.url, "--request-id-prefix", "f", "--quiet"])
    assert rc == 1
    assert "http_500: 1" in capsys.readouterr().out


def test_unreachable_target_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", [(0.0, 2, 2, None)])
    rc = _main(["load", trace, "--target", f"http://127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("shadow load: error: target unreachable") and err.count("\n") == 1


@pytest.mark.parametrize("spec", ["does-not-exist.jsonl", "BAD"])
def test_bad_trace_one_line_error(spec: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if spec == "BAD":
        spec = str(tmp_path / "bad.jsonl")
        Path(spec).write_text('{"arrival_s": 0, "prompt_tokens": -3, "output_tokens": 1}\n')
    rc = _main(["load", spec, "--target", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("shadow load: error: ") and err.count("\n") == 1


def test_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["load", "paper-azure", "--target", "http://127.0.0.1:9", "--concurrency", "0"]) == 1
    assert _main(["load", "paper-azure", "--target", "http://127.0.0.1:9", "--header", "nokey"]) == 1
    assert _main(["load", "paper-azure", "--target", "localhost:9", "--limit", "1"]) == 1
    errs = capsys.readouterr().err.splitlines()
    assert len(errs) == 3 and all(e.startswith("shadow load: error: ") for e in errs)
    with pytest.raises(SystemExit):
        _main(["load", "paper-azure", "--target", "x", "--time-scale", "2", "--rate-scale", "2"])


def test_ctrl_c_prints_summary_of_what_finished(
    stub: StubServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stub.config = StubConfig(ttft_s=0.01, itl_s=0.01)
    trace = _write_trace(tmp_path / "t.jsonl", [(0.0, 2, 2, None), (0.0, 2, 3000, None), (30.0, 2, 2, None)])

    class CtrlCAfterFirstDone(NullProgress):
        """Ctrl-C once the client has counted the short request done (a condition, not a timer:
        under load the run can take longer than any fixed delay to start)."""

        sent = False

        def update(self, done: int, failed: int, in_flight: int) -> None:
            if done == 1 and in_flight == 1 and not self.sent:  # once: a second Ctrl-C aborts
                self.sent = True
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(loadgen, "make_progress", lambda console, quiet=False: CtrlCAfterFirstDone())
    rc = _main(["load", trace, "--target", stub.url, "--json", str(tmp_path / "o.json"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 130
    assert "interrupted" in out and "cancelled: 1" in out
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["interrupted"] is True
    assert (data["requests"]["ok"], data["requests"]["not_sent"]) == (1, 1)
