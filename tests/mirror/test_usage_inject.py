"""--inject-usage request rewriting and response frame stripping."""

from __future__ import annotations

import json

from shadow.dataplane.usage_inject import (
    STRIP_ALL,
    STRIP_CONTINUOUS,
    FrameRewriter,
    inject_request,
    rewrite_frame,
)


def test_inject_request_modes() -> None:
    new, mode = inject_request(b'{"stream":true,"prompt":"\xc3\xa9"}') or (b"", 0)
    assert mode == STRIP_ALL
    assert json.loads(new)["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert json.loads(new)["prompt"] == "é"
    _, mode = inject_request(b'{"stream":true,"stream_options":{"include_usage":true}}') or (b"", 0)
    assert mode == STRIP_CONTINUOUS
    assert (
        inject_request(
            b'{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}'
        )
        is None
    )
    assert inject_request(b'{"stream":false}') is None
    assert inject_request(b"{oops") is None
    assert inject_request(b'{"stream":true,"stream_options":3}') is None


def test_rewrite_frames() -> None:
    chunk = (
        b'data: {"id":"x","choices":[{"index":0,"text":"a"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}'
    )
    assert rewrite_frame(chunk, STRIP_ALL) == b'data: {"id":"x","choices":[{"index":0,"text":"a"}]}'
    assert rewrite_frame(chunk, STRIP_CONTINUOUS) == b'data: {"id":"x","choices":[{"index":0,"text":"a"}]}'
    first = b'data: {"usage":{"completion_tokens":1},"choices":[{"text":"a"}]}'
    assert json.loads(rewrite_frame(first, STRIP_ALL)[6:]) == {"choices": [{"text": "a"}]}  # type: ignore[index]
    final = b'data: {"id":"x","choices":[],"usage":{"completion_tokens":1}}'
    assert rewrite_frame(final, STRIP_ALL) is None
    assert rewrite_frame(final, STRIP_CONTINUOUS) == final
    for same in (b"data: [DONE]", b'data: {"error":{"message":"usage"}}', b"data: {bad usage"):
        assert rewrite_frame(same, STRIP_ALL) == same


def test_frame_rewriter_across_splits() -> None:
    frames = [
        b'data: {"choices":[{"text":"a"}],"usage":{"completion_tokens":1}}',
        b'data: {"choices":[],"usage":{"completion_tokens":1}}',
        b"data: [DONE]",
    ]
    body = b"".join(f + b"\n\n" for f in frames)
    for step in (1, 3, 7, len(body)):
        rw = FrameRewriter(STRIP_ALL)
        out = b"".join(rw.feed(body[i : i + step]) for i in range(0, len(body), step)) + rw.flush()
        assert out == b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'
