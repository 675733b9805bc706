"""The incremental SSE parser: vLLM transcripts, any split, any line ending, malformed input."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.vllm.sse import StreamParser, parse_json_body


def _chat(n: int, *, usage: bool = False, continuous: bool = False, finish: str = "length") -> bytes:
    out = []
    first = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    if continuous:
        first["usage"] = {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}
    out.append(first)
    for i in range(n):
        ch = {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": f" w{i}"},
                    "logprobs": None,
                    "finish_reason": finish if i == n - 1 else None,
                }
            ],
        }
        if continuous:
            ch["usage"] = {"prompt_tokens": 7, "completion_tokens": i + 1, "total_tokens": 8 + i}
        out.append(ch)
    if usage:
        out.append(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n},
            }
        )
    text = "".join(f"data: {json.dumps(o, separators=(',', ':'))}\n\n" for o in out) + "data: [DONE]\n\n"
    return text.encode()


def _completion(n: int) -> bytes:
    frames = []
    for i in range(n):
        frames.append(
            {
                "id": "x",
                "object": "text_completion",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "text": f" t{i}",
                        "logprobs": None,
                        "finish_reason": "stop" if i == n - 1 else None,
                        "stop_reason": None,
                    }
                ],
            }
        )
    frames.append(
        {
            "id": "x",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n},
        }
    )
    return ("".join(f"data: {json.dumps(f)}\n\n" for f in frames) + "data: [DONE]\n\n").encode()


def _summary(p: StreamParser) -> tuple:
    return (
        p.generated,
        p.content_chunks,
        p.frames,
        p.prompt_tokens,
        p.finish_reason,
        p.error,
        p.done,
        p.invalid_json,
        p.oversized,
        p.role_only,
    )


def _feed(data: bytes, cuts: list[int] | None = None, **kw: object) -> StreamParser:
    p = StreamParser(**kw)  # type: ignore[arg-type]
    if cuts is None:
        p.feed(data)
    else:
        prev = 0
        for c in sorted(set(cuts)):
            p.feed(data[prev:c])
            prev = c
        p.feed(data[prev:])
    p.close()
    return p


def test_chat_role_chunk_is_not_a_token_and_done_is_seen() -> None:
    p = _feed(_chat(5))
    assert p.generated == 5 and p.content_chunks == 5 and p.role_only == 1
    assert p.finish_reason == "length" and p.done and not p.error and p.prompt_tokens is None


def test_final_usage_gives_prompt_and_completion_tokens() -> None:
    p = _feed(_chat(4, usage=True))
    assert p.generated == 4 and p.prompt_tokens == 7 and p.usage_chunks == 1


def test_continuous_usage_is_cumulative_and_wins_over_chunk_counting() -> None:
    p = StreamParser()
    data = _chat(6, continuous=True)
    frames = data.split(b"\n\n")
    p.feed(b"\n\n".join(frames[:3]) + b"\n\n")  # role chunk + 2 tokens
    assert p.generated == 2 and p.continuous_usage and p.prompt_tokens == 7
    p.feed(b"\n\n".join(frames[3:]))
    p.close()
    assert p.generated == 6


def test_speculative_chunks_counted_by_usage() -> None:
    chunk = {
        "choices": [{"index": 0, "text": "abc", "finish_reason": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 3},
    }
    p = _feed(f"data: {json.dumps(chunk)}\n\n".encode())
    assert p.content_chunks == 1 and p.generated == 3


def test_completion_stream() -> None:
    p = _feed(_completion(3))
    assert p.generated == 3 and p.prompt_tokens == 5 and p.finish_reason == "stop" and p.done


def test_reasoning_and_tool_calls_count_as_tokens() -> None:
    deltas = [
        {"reasoning": "hmm"},
        {"reasoning_content": "x"},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
        {"content": ""},
        {},
    ]
    data = b"".join(
        f"data: {json.dumps({'choices': [{'index': 0, 'delta': d}]})}\n\n".encode() for d in deltas
    )
    p = _feed(data)
    assert p.content_chunks == 3 and p.role_only == 2


def test_error_event_then_done() -> None:
    data = (
        _chat(2)[: -len(b"data: [DONE]\n\n")]
        + b'data: {"error":{"message":"x","code":500}}\n\ndata: [DONE]\n\n'
    )
    p = _feed(data)
    assert p.error and p.done and p.generated == 2


def test_comments_fields_and_multiline_data() -> None:
    data = (
        b': keep-alive\n\nevent: message\nid: 3\ndata: {"choices":[{"index":0,\n'
        b'data: "text":"a"}]}\n\nretry: 10\n\ndata:[DONE]\n\n'
    )
    p = _feed(data)
    assert p.content_chunks == 1 and p.done and p.invalid_json == 0 and p.frames == 2


def test_invalid_json_is_counted_not_raised() -> None:
    p = _feed(b'data: {nope\n\ndata: [1,2]\n\ndata: "s"\n\n' + _completion(1))
    assert p.invalid_json == 3 and p.generated == 1


def test_oversized_frame_dropped_and_parser_recovers() -> None:
    big = b'data: {"choices":[{"text":"' + b"x" * 5000 + b'"}]}\n\n'
    p = StreamParser(max_frame=1000)
    for i in range(0, len(big), 700):
        p.feed(big[i : i + 700])
    p.feed(_completion(2))
    p.close()
    assert p.oversized == 1 and p.generated == 2 and p.done


def test_truncated_stream_counts_what_arrived() -> None:
    data = _chat(5)
    p = _feed(data[: len(data) // 2])
    assert not p.done and p.finish_reason is None and 0 < p.generated < 5


def test_last_event_without_blank_line_counts_on_close() -> None:
    p = _feed(b'data: {"choices":[{"index":0,"text":"a","finish_reason":"stop"}]}')
    assert p.generated == 1 and p.finish_reason == "stop"


def test_gap_resynchronises_on_next_blank_line() -> None:
    data = _completion(4)
    frames = data.split(b"\n\n")
    p = StreamParser()
    p.feed(frames[0] + b"\n\n" + frames[1][:20])
    p.reset_partial()  # bytes were lost here
    p.feed(frames[2][30:] + b"\n\n" + b"\n\n".join(frames[3:]))
    p.close()
    assert p.invalid_json == 0 and p.done
    assert p.content_chunks == 2 and p.generated == 4  # frames 1-2 lost; the final usage says 4


def test_json_body() -> None:
    body = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}
            ],
            "usage": {"prompt_tokens": 11, "completion_tokens": 1, "total_tokens": 12},
            "kv_transfer_params": {"do_remote_prefill": True},
        }
    ).encode()
    p = parse_json_body(body)
    assert p.prompt_tokens == 11 and p.generated == 1 and p.finish_reason == "length"
    assert p.kv_transfer_params == {"do_remote_prefill": True}
    assert parse_json_body(b"{oops").invalid_json == 1
    assert parse_json_body(b'{"error":{"message":"bad"}}').error
    assert parse_json_body(b'{"object":"error","message":"old style"}').error


_ENDINGS = st.sampled_from([b"\n", b"\r\n", b"\r"])


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 12),
    usage=st.booleans(),
    continuous=st.booleans(),
    eol=_ENDINGS,
    cuts=st.lists(st.integers(0, 5000), max_size=30),
)
def test_any_split_and_line_ending_gives_the_same_result(
    n: int, usage: bool, continuous: bool, eol: bytes, cuts: list[int]
) -> None:
    data = _chat(n, usage=usage, continuous=continuous).replace(b"\n", eol)
    whole = _summary(_feed(data))
    split = _summary(_feed(data, [c % (len(data) + 1) for c in cuts]))
    assert whole == split
    assert whole[0] == n and whole[6] is True


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=300),
            st.sampled_from(
                [
                    b"data: ",
                    b"\n\n",
                    b"\r\n",
                    b"\r",
                    b"data: [DONE]\n\n",
                    b"{",
                    b"}",
                    b":",
                    b'{"choices":[',
                    b'"usage":{"completion_tokens":-3}',
                    b'{"error":null}',
                    b"\xff\xfe",
                ]
            ),
        ),
        max_size=40,
    )
)
def test_garbage_never_raises(pieces: list[bytes]) -> None:
    p = StreamParser(max_frame=512)
    for piece in pieces:
        p.feed(piece)
    p.close()
    assert p.generated >= 0 and p.frames >= 0
    assert len(p._buf) <= 513


_texts = st.lists(
    st.sampled_from([*'ab "\\:{},', '"usage"', '":""', '"finish_reason":null', "é"]), max_size=12
).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    chat=st.booleans(),
    text=_texts,
    finish=st.sampled_from([None, "stop", "length"]),
    usage=st.booleans(),
    compact=st.booleans(),
)
def test_fast_path_agrees_with_full_interpretation(
    chat: bool, text: str, finish: str | None, usage: bool, compact: bool
) -> None:
    choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    obj: dict = {"id": "x", "object": "o", "created": 1, "model": "m", "choices": [choice]}
    if usage:
        obj["usage"] = {"prompt_tokens": 2, "completion_tokens": 1}
    sep = (",", ":") if compact else (", ", ": ")
    fast = StreamParser()
    fast.feed(b"data: " + json.dumps(obj, separators=sep).encode() + b"\n\n")
    slow = StreamParser()
    slow.interpret(obj)
    assert (fast.content_chunks, fast.generated, fast.finish_reason, fast.role_only) == (
        slow.content_chunks,
        slow.generated,
        slow.finish_reason,
        slow.role_only,
    )
