"""A live session recorded by the taps (`--record`) replays offline, with the real routing as a lane."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from openai import OpenAI

from shadow.fleet import FleetConfig
from shadow.mirror.config import MirrorConfig
from shadow.replay import ReplaySetup, run_replay
from shadow.traces import load_trace
from tests.harness import FleetThread, TapThread

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_recorded_session_replays_through_the_engine(tmp_path: Path) -> None:
    rec = tmp_path / "session.ndjson"
    with FleetThread(FleetConfig(prefill=0, decode=2, base_port=0, time_scale=0.1)) as ft:
        decode = {f"d{i}": u for i, u in enumerate(ft.decode_urls)}
        with TapThread(MirrorConfig(decode, record=str(rec), scrape_interval_s=0)) as t:
            sent: Counter[str] = Counter()
            for i in range(12):
                name = f"d{i % 3 % 2}"  # an uneven split: d0 gets 8, d1 gets 4
                client = OpenAI(base_url=t.ready["taps"][name] + "/v1", api_key="none", max_retries=0)
                stream = client.completions.create(
                    model="sim-llm",
                    prompt="w " * (10 + 5 * i),
                    max_tokens=3 + i,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                assert sum(1 for ch in stream if ch.choices) == 3 + i
                sent[name] += 1
            assert t.wait_for(lambda: t.svc.state.live() == 0 and not len(t.svc.queue))
    trace = load_trace(rec)
    assert len(trace) == 12 and not trace.synthetic
    assert Counter(r.worker for r in trace.requests) == sent
    assert sorted(r.output_tokens for r in trace.requests) == [3 + i for i in range(12)]
    assert sorted(r.prompt_tokens for r in trace.requests) == [10 + 5 * i for i in range(12)]
    report = run_replay(trace, ReplaySetup(policies=("jsq", "br0")))
    assert list(report.results) == ["actual", "jsq", "br0"]
    assert report.config["worker_names"] == ["d0", "d1"]
    assert all(r.finished == 12 for r in report.results.values())
