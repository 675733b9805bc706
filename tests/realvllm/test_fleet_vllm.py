"""`shadow fleet --engine vllm` on real vLLM servers: the ready line, a real P/D round trip through
the pair it starts, a failed start that names its server, and a stop that leaves no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from shadow.base.procs import shadow_argv
from shadow.realvllm.launcher import nixl_available, processes
from tests.realvllm.conftest import MODEL_NAME, Tier
from tests.realvllm.helpers import completion_tokens, metric, raw_stream, wait_for


def holders(path: Path) -> list[int]:
    """PIDs of live processes with `path` open (every vLLM process inherits its log as stdout)."""
    target = str(path.resolve())
    out = []
    for pid, state, _ in processes():
        if state == b"Z":
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        if any(_link(f"/proc/{pid}/fd/{fd}") == target for fd in fds):
            out.append(pid)
    return out


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:  # the fd closed meanwhile
        return None


def test_ready_line_has_the_simulated_fleets_shape(tier: Tier) -> None:
    ready = tier.pd_ready
    assert sorted(ready) == ["decode", "prefill"]
    assert len(ready["prefill"]) == 1 and len(ready["decode"]) == 1
    for url in ready["prefill"] + ready["decode"]:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/health", timeout=10, trust_env=False).status_code == 200
        models = httpx.get(url + "/v1/models", timeout=10, trust_env=False).json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]


def test_prefill_then_decode_moves_the_kv_instead_of_recomputing_it(tier: Tier) -> None:
    (p_url,), (d_url,) = tier.pd_ready["prefill"], tier.pd_ready["decode"]
    prompt = " ".join(f"w{i % 97}" for i in range(400))  # > 2 blocks of 128 tokens
    nixl = nixl_available(tier.venv)
    params = {"do_remote_decode": True, "do_remote_prefill": False} if nixl else None
    ext_before = metric(d_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    body: dict[str, object] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    p = httpx.post(p_url + "/v1/completions", json=body, timeout=300, trust_env=False)
    assert p.status_code == 200, p.text
    handle = p.json().get("kv_transfer_params")
    if nixl:
        assert handle and handle["remote_block_ids"] and handle["remote_engine_id"], handle
        assert handle["remote_host"] == "127.0.0.1"
    max_tokens = 16
    d_body: dict[str, object] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                 "ignore_eos": True, "temperature": 0, "stream": True,
                                 "stream_options": {"include_usage": True}}
    if handle is not None:
        d_body["kv_transfer_params"] = handle
    r, data = raw_stream(d_url + "/v1/completions", d_body, timeout=300)
    assert r.status_code == 200
    assert completion_tokens(data) == max_tokens
    moved = wait_for(lambda: metric(d_url, "vllm:prompt_tokens_by_source_total",
                                    source="external_kv_transfer") - ext_before, "KV counted as transferred",
                     timeout=30)
    assert moved >= 128, f"only {moved} prompt tokens came over the connector"


def test_a_failed_start_names_the_server_and_leaves_nothing(engine_venv: Path, tmp_path: Path) -> None:
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    logs = tmp_path / "logs"
    done = subprocess.run(
        shadow_argv("fleet", "--engine", "vllm", "--decode", "1", "--model-path", str(bad),
                    "--log-dir", str(logs), "--start-timeout", "600"),
        capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 1, done.stderr
    assert done.stdout == "", "no ready line for a fleet that did not start"
    assert "vLLM server decode/0" in done.stderr and "exited with code" in done.stderr, done.stderr
    log = logs / "decode-0.log"
    assert str(log) in done.stderr
    last = log.read_text().strip().splitlines()[-1]
    assert last in done.stderr, "the error quotes the log's tail"
    assert holders(log) == []


@pytest.mark.stops_tier  # the P/D pair is shared (test_nixlpace, test_active_pd_vllm): this runs last
def test_sigterm_stops_every_server_process(tier: Tier) -> None:
    logs = sorted((tier.logs / "pd").glob("*.log"))
    assert [p.name for p in logs] == ["decode-0.log", "prefill-0.log"]
    assert all(holders(p) for p in logs), "each server runs"
    tier.pd.send_signal(signal.SIGTERM)
    assert tier.pd.wait(120) == 0
    assert [holders(p) for p in logs] == [[], []]
