"""The mirror against real vLLM servers: one probe collector per API server (a DP server's page has
the family once, with both engines), output tokens from what the stream carries when the client did
not ask for usage (merged chunks never counted as tokens), and reconciliation of a DP server's page
(the `engine` label) that returns to drift 0 with nothing left draining."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shadow.realvllm.launcher import repo_root
from tests.realvllm.conftest import MODEL_NAME, Tier
from tests.realvllm.helpers import latest_seq, metric, raw_stream, sse_payloads, wait_for
from tests.reportschema import check_report


def _state(api: str) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(f"{api}/v1/state", timeout=10, trust_env=False).json()
    return state


def _finished(api: str, worker: str) -> int:
    return int(_state(api)["workers"].get(worker, {}).get("finished", 0))


def _report(api: str) -> dict[str, Any]:
    report: dict[str, Any] = httpx.get(f"{api}/v1/report", timeout=60, trust_env=False).json()
    check_report(report)  # a real engine's report (probe, twin, cost fit) as the schema says
    return report


def _events_after(api: str, seq: int) -> list[dict[str, Any]]:
    r = httpx.get(f"{api}/v1/events", params={"after": seq, "limit": 100000}, timeout=10, trust_env=False)
    return [json.loads(line) for line in r.text.splitlines()]


PROBE_MODULES = ("probe.py", "probe_metrics.py", "stepsender.py")


def _engine_probe_source(venv: Path) -> dict[str, bytes]:
    """The probe's modules as the engine venv imports them (vLLM runs that code)."""
    code = "import os, shadow.realvllm as r; print(os.path.dirname(os.path.realpath(r.__file__)))"
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    where = Path(done.stdout.strip().splitlines()[-1])
    return {m: (where / m).read_bytes() for m in PROBE_MODULES}


def test_a_dp_servers_page_has_the_probe_family_once_with_both_engines(tier: Tier) -> None:
    here = repo_root() / "shadow" / "realvllm"
    assert _engine_probe_source(tier.venv) == {m: (here / m).read_bytes() for m in PROBE_MODULES}, (
        f"the engine venv {tier.venv} runs another version of shadow's probe than {here}: the probe under "
        f"test is not the one in vLLM (scripts/install-vllm.sh {tier.venv} points it at this tree)")
    url = tier.drop.decode_urls[0]
    body = {"model": MODEL_NAME, "prompt": "dp engines", "max_tokens": 16, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with cf.ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda i: raw_stream(f"{url}/v1/completions", {**body, "prompt": f"dp {i} " * (i + 1)}),
                    range(8)))
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    assert text.count("# TYPE shadow_probe_steps_total counter") == 1, "one collector per API server"
    engines = {s.labels["engine"] for fam in text_string_to_metric_families(text)
               if fam.name == "shadow_probe_steps" for s in fam.samples}
    assert engines == {"0", "1"}
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian's prometheus package, installed by scripts/test.sh) is needed"
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=60, check=False)
    # promtool exits 3 for lint advice (vLLM's names have ':'), 1 when the page does not parse (a
    # family exposed twice: "second HELP line"); only the first is acceptable
    said = checked.stdout + checked.stderr
    assert checked.returncode in (0, 3) and "error while linting" not in said.lower(), said[-2000:]


def test_tokens_without_usage_are_exact_and_a_dp_server_reconciles_to_zero(tier: Tier) -> None:
    """16 concurrent streams through the tap in front of the DP server, the client asking for no
    usage: every mirrored finish has exactly max_tokens (the stream ended for length), counted
    from max_tokens, not from the chunks (which vLLM merges under load); the page's two engines
    are read and summed; at quiescence the drift is 0 and nothing is left draining."""
    api, n, max_tokens = tier.api, 16, 48
    seq = latest_seq(api)
    before = _finished(api, "dp")
    counts_before = _report(api)["output_counts"]["by_source"]
    engine_done = metric(tier.drop.decode_urls[0], "vllm:request_success_total")
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}

    def one(i: int) -> tuple[str | None, int]:
        r, data = raw_stream(f"{tier.dp_tap}/v1/completions", {**body, "prompt": f"tokens {i} " * (2 + i)})
        assert r.status_code == 200
        chunks = [json.loads(p) for p in sse_payloads(data) if p != "[DONE]"]
        assert not any("usage" in c and c["usage"] for c in chunks), "the client asked for no usage"
        return chunks[-1]["choices"][0]["finish_reason"], len(chunks)

    with cf.ThreadPoolExecutor(n) as ex:
        results = list(ex.map(one, range(n)))
    assert [fr for fr, _ in results] == ["length"] * n
    wait_for(lambda: _finished(api, "dp") - before >= n, f"{n} mirrored finishes on dp", timeout=60)
    finishes = [e for e in _events_after(api, seq) if e["type"] == "finish"]
    dp_finishes = [e for e in finishes if e["generated"] == max_tokens]
    assert len(dp_finishes) == n, finishes
    counts = _report(api)["output_counts"]["by_source"]
    assert counts.get("max_tokens", 0) - counts_before.get("max_tokens", 0) == n, counts
    assert counts.get("chunks", 0) == counts_before.get("chunks", 0), counts
    assert metric(tier.drop.decode_urls[0], "vllm:request_success_total") - engine_done == n

    def settled() -> dict[str, Any] | None:
        rec = _state(api)["reconcile"]["dp"]
        return rec if rec["drift_requests"] == 0 and rec["draining"] == 0 and rec["running"] == 0 else None

    rec = wait_for(settled, "drift 0 and nothing draining on the DP server", timeout=60)
    assert sorted(rec["engines"]) == ["0", "1"]
    assert rec["kv_capacity_tokens"] == sum(  # from each engine's cache_config_info
        float(s.labels["kv_cache_size_tokens"]) for fam in text_string_to_metric_families(
            httpx.get(tier.drop.decode_urls[0] + "/metrics", timeout=10, trust_env=False).text)
        if fam.name == "vllm:cache_config_info" for s in fam.samples)
