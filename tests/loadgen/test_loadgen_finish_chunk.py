"""The finish reason on a chunk of its own with empty content (vLLM sends it when the last step
generates no text, e.g. on EOS) is not a token: not in the token count, the chunk count or the
last-token time.

Seeded bug this kills: a chunk carrying only ``finish_reason`` counted as a generated token."""

from __future__ import annotations

import asyncio

import pytest
from loadgen_helpers import make_trace
from loadgen_stub import StubConfig, StubServer

from shadow.loadgen import LoadOptions, LoadReport, run_load

FINISH_DELAY_S = 0.3


def _run(trace: object, url: str, **options: object) -> LoadReport:
    return asyncio.run(run_load(trace, url, LoadOptions(**options)))  # type: ignore[arg-type]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("usage", [True, False], ids=["usage-chunk", "no-usage"])
def test_finish_only_chunk_is_not_a_token(stub: StubServer, chat: bool, usage: bool) -> None:
    """With and without a usage chunk (without one the count falls back to content chunks)."""
    stub.config = StubConfig(ttft_s=0.02, itl_s=0.005, separate_finish=True, finish_delay_s=FINISH_DELAY_S,
                             usage=usage)
    outputs = [1, 3, 5]
    report = _run(make_trace([(0.0, 4, n, None) for n in outputs]), stub.url, chat=chat)
    assert report.summary.ok == 3
    for res, n in zip(report.results, outputs, strict=True):
        assert res.content_chunks == n, (
            f"{n} tokens streamed plus a finish-only chunk with empty content: counted "
            f"{res.content_chunks} content chunks (the finish-only chunk is not a token)")
        assert res.output_tokens == n, (
            f"{n} tokens streamed, output_tokens={res.output_tokens} "
            f"({'from usage' if usage else 'from content chunks, the finish-only chunk counted?'})")
        assert res.finish_reason == "length", "the finish reason is read from the finish-only chunk"
        assert res.last_token_s is not None and res.first_token_s is not None
        # The finish chunk was sent FINISH_DELAY_S after the last token; the last token is not it
        # (half the delay left for delivery jitter: with the bug the gap is ~0).
        assert res.done_s - res.last_token_s >= FINISH_DELAY_S / 2, (
            f"last token at {res.last_token_s:.3f} s, stream done at {res.done_s:.3f} s: the "
            "finish-only chunk was taken as the last token")
        if n == 1:
            assert res.tpot_s is None, "one token has no time per output token"
    assert report.summary.output_tokens == sum(outputs)
    assert report.summary.output_mismatch == 0


def test_finish_reason_stop_on_an_empty_chunk_without_ignore_eos(stub: StubServer) -> None:
    """The EOS case: the model stops after 3 tokens, the stop arrives on an empty chunk."""
    stub.config = StubConfig(ttft_s=0.02, itl_s=0.005, eos_after=3, separate_finish=True, usage=False)
    report = _run(make_trace([(0.0, 4, 10, None)]), stub.url, ignore_eos=False)
    (res,) = report.results
    assert (res.output_tokens, res.content_chunks, res.finish_reason) == (3, 3, "stop"), (
        f"3 tokens then an empty stop chunk: output_tokens={res.output_tokens}, "
        f"content_chunks={res.content_chunks}, finish_reason={res.finish_reason}")
    assert report.summary.output_mismatch == 1  # asked for 10, got 3
