"""``run_load`` against shadow's real simulated fleet (vLLM-compatible, loopback, fast steps)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from loadgen_helpers import make_trace

from shadow.loadgen import LoadOptions, PromptBuilder, run_load
from tests.harness import FleetThread

fleet_mod = pytest.importorskip("shadow.fleet")
tokens_mod = pytest.importorskip("shadow.fleet.tokens")

pytestmark = pytest.mark.timeout(60)

ROWS = [
    (0.0, 12, 5, "sys-a"),
    (0.02, 30, 8, None),
    (0.04, 12, 3, "sys-a"),
    (0.06, 7, 6, "sys-b"),
    (0.08, 50, 4, None),
]


@pytest.fixture(scope="module")
def decode_url() -> Iterator[str]:
    config = fleet_mod.FleetConfig(prefill=0, decode=1, base_port=0, time_scale=0.25, slots=4)
    with FleetThread(config) as ft:
        yield ft.decode_urls[0]


@pytest.mark.parametrize("chat", [False, True])
def test_fleet_counts_exactly_the_trace_sizes(decode_url: str, chat: bool) -> None:
    overhead = tokens_mod.CHAT_MESSAGE_OVERHEAD if chat else 0
    options = LoadOptions(chat=chat, concurrency=3, prompt_builder=PromptBuilder(chat_overhead=overhead))
    report = asyncio.run(run_load(make_trace(ROWS), decode_url, options))
    s = report.summary
    assert s.ok == len(ROWS) and s.failed == 0, report.results
    assert report.model == "sim-llm"
    for res, (_, prompt, output, _key) in zip(report.results, ROWS, strict=True):
        assert res.server_prompt_tokens == prompt == res.prompt_tokens  # the fleet counted what we meant
        assert res.output_tokens == output and res.finish_reason == "length"
        assert res.ttft_s is not None and res.ttft_s > 0
    assert s.server_prompt_tokens == s.prompt_tokens_sent == sum(r[1] for r in ROWS)
    assert s.output_tokens == sum(r[2] for r in ROWS) and s.output_mismatch == 0
    assert s.max_in_flight <= 3
    assert s.tpot_s["p50"] is not None and s.tpot_s["p50"] > 0
