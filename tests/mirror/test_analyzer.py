"""The analysis side in isolation: synthetic tap items in, normalised events out."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

from shadow.contracts.events import Arrive, Cancel, Finish, Route, Token
from shadow.contracts.tapwire import END_CLIENT_CANCEL, END_COMPLETE, END_UPSTREAM_CUT, TapContext
from shadow.mirror.analyzer import Analyzer
from shadow.mirror.hub import Mirror
from shadow.mirror.keys import KeySecret
from shadow.mirror.state import MirrorState

SSE = {"content-type": "text/event-stream; charset=utf-8"}
JSON = {"content-type": "application/json"}


def _sse(n: int, finish: str = "length", extra: dict[str, Any] | None = None) -> list[bytes]:
    out = []
    for i in range(n):
        ch: dict[str, Any] = {
            "choices": [{"index": 0, "text": f"t{i}", "finish_reason": finish if i == n - 1 else None}]
        }
        if extra and i == n - 1:
            ch["choices"][0].update(extra)
        out.append(f"data: {json.dumps(ch)}\n\n".encode())
    return [*out, b"data: [DONE]\n\n"]


class Rig:
    def __init__(self, **kw: Any) -> None:
        self.mirror = Mirror(MirrorState(["d0", "d1"]))
        self.an = Analyzer(self.mirror, clock=lambda: 0.0, **kw)

    def ctx(
        self,
        tap: str,
        body: dict[str, Any] | bytes | None,
        rid: str | None = None,
        path: str = "/v1/completions",
        method: str = "POST",
        t: float = 1.0,
    ) -> TapContext:
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        return TapContext(tap, method, path, rid, raw, len(raw or b""), t)

    def run(
        self,
        ctx: TapContext,
        pieces: list[bytes],
        end: str = END_COMPLETE,
        status: int = 200,
        headers: dict[str, str] | None = None,
        start: bool = True,
    ) -> None:
        items: list[tuple[TapContext, int, float, Any]] = []
        if start:
            items.append((ctx, 0, ctx.t_start, None))
        ctx.status = status
        ctx.resp_headers = headers if headers is not None else SSE
        for p in pieces:
            ctx.seq += 1
            items.append((ctx, ctx.seq, 2.0, p))
        items.append((ctx, -1, 3.0, end))
        self.an.process(items)

    def events(self, rid: str | None = None) -> list[Any]:
        return [ev for _, ev in self.mirror.recent if rid is None or getattr(ev, "request_id", None) == rid]


def test_plain_stream_route_tokens_finish() -> None:
    r = Rig()
    r.run(r.ctx("d0", {"prompt": "secret", "stream": True, "max_tokens": 3}, rid="a"), _sse(3))
    evs = r.events("a")
    assert (
        isinstance(evs[0], Arrive)
        and evs[0].max_tokens == 3
        and evs[0].prompt_key
        and evs[0].prompt_tokens == 1  # plain mode: the body's estimate (one word)
    )
    assert isinstance(evs[1], Route) and evs[1].worker == "d0"
    assert evs[-1] == Finish("a", 3.0, "length", 3)
    assert "secret" not in repr(evs)


def test_cancel_mid_stream_but_finish_when_the_stream_had_ended() -> None:
    r = Rig()
    r.run(r.ctx("d0", {"stream": True}, rid="a"), _sse(5)[:2], end=END_CLIENT_CANCEL)
    assert r.events("a")[-1] == Cancel("a", 3.0)
    r.run(r.ctx("d0", {"stream": True}, rid="b"), _sse(2), end=END_CLIENT_CANCEL)
    assert r.events("b")[-1] == Finish("b", 3.0, "length", 2)
    r.run(r.ctx("d1", {"stream": True}, rid="c"), _sse(4)[:2], end=END_UPSTREAM_CUT)
    assert r.events("c")[-1] == Finish("c", 3.0, "cut", 2)
    assert r.mirror.state.live() == 0


def test_prefill_after_decode_start_adds_the_prompt_and_retries_get_new_ids() -> None:
    r = Rig()
    pre = r.ctx(
        "p0", {"stream": False, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, rid="x"
    )
    dec = r.ctx("d1", {"stream": True, "kv_transfer_params": {"do_remote_prefill": True}}, rid="x")
    r.an.process([(pre, 0, 1.0, None), (dec, 0, 1.1, None)])  # concurrent legs (Mooncake style)
    pre.status, pre.resp_headers = 200, JSON
    body = json.dumps(
        {"choices": [{"text": "a", "finish_reason": "length"}], "usage": {"prompt_tokens": 42}}
    ).encode()
    pre.seq = 1
    r.an.process([(pre, 1, 1.2, body), (pre, -1, 1.3, END_COMPLETE)])
    r.run(dec, _sse(2), start=False)
    routes = [e for e in r.events("x") if isinstance(e, Route)]
    assert [x.prompt_tokens for x in routes] == [None, 42] and {x.worker for x in routes} == {"d1"}
    # the same X-Request-Id again (a retry, or a client re-using ids): a new mirrored request
    r.run(r.ctx("d0", {"stream": True}, rid="x"), _sse(1))
    assert [e.worker for e in r.events("x~2") if isinstance(e, Route)] == ["d0"]
    assert r.mirror.state.workers["d1"].finished == 1 and r.mirror.state.workers["d0"].finished == 1


def test_recompute_moves_the_request_instead_of_finishing_it() -> None:
    r = Rig()
    r.run(r.ctx("d0", {"stream": True}, rid="a"), _sse(2, extra={"stop_reason": "recomputed"}))
    assert r.mirror.state.active("d0") == 1 and not [e for e in r.events("a") if isinstance(e, Finish)]
    r.run(r.ctx("d1", {"stream": True}, rid="a"), _sse(3))
    assert r.mirror.state.outcomes["moved"] == 1 and r.mirror.state.live() == 0
    assert r.mirror.state.workers["d1"].finished == 1


def test_hook_errors_gaps_and_other_paths_are_isolated() -> None:
    calls = []

    def hook(ctx: TapContext, payload: bytes) -> None:
        calls.append(payload)
        if len(calls) == 2:
            raise RuntimeError("bug")

    r = Rig(hook=hook)
    ctx = r.ctx("d0", {"stream": True}, rid="a")
    pieces = _sse(4)
    r.an.process([(ctx, 0, 1.0, None)])
    ctx.status, ctx.resp_headers = 200, SSE
    ctx.seq = 5
    r.an.process(
        [
            (ctx, 1, 2.0, pieces[0]),
            (ctx, 2, 2.0, pieces[1]),
            (ctx, 4, 2.0, pieces[3][:10]),
            (ctx, 5, 2.0, pieces[4]),
            (ctx, -1, 3.0, END_COMPLETE),
        ]
    )
    assert r.mirror.errors == {"analysis": 1} and r.an.gaps == 1
    fin = r.events("a")[-1]
    assert isinstance(fin, Finish) and fin.reason == "other"  # data was lost: the real end is unknown
    r.run(r.ctx("d0", None, method="GET", path="/v1/models"), [b'{"data":[]}'], headers=JSON)
    r.run(r.ctx("d0", None, rid="big"), _sse(1))  # body over the analysis limit: still mirrored
    assert r.mirror.dropped["oversized_body"] == 1 and r.events("big")[-1].reason == "length"
    r.run(r.ctx("d0", b"{nope", rid="bad"), [b"{}"], status=400, headers=JSON)
    assert r.events("bad")[-1].reason == "error" and r.mirror.dropped["invalid_request"] == 1
    assert r.mirror.state.live() == 0


def test_non_stream_decode_and_tokens_are_cumulative() -> None:
    r = Rig()
    body = json.dumps(
        {
            "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4},
        }
    ).encode()
    r.run(
        r.ctx("d0", {"messages": []}, rid="a", path="/v1/chat/completions"),
        [body[:10], body[10:]],
        headers=JSON,
    )
    evs = r.events("a")
    assert [e.kind for e in evs] == ["arrive", "route", "route", "token", "finish"]
    assert evs[2].prompt_tokens == 9 and evs[3] == Token("a", 3.0, 4) and evs[4].generated == 4


def _sse_with_id(rid: str, n: int) -> bytes:
    out = b""
    for i in range(n):
        ch = {
            "id": rid,
            "choices": [{"index": 0, "text": f"t{i}", "finish_reason": "length" if i == n - 1 else None}],
        }
        out += f"data: {json.dumps(ch)}\n\n".encode()
    return out + b"data: [DONE]\n\n"


def test_front_mode_routes_by_the_decision_in_the_response_even_split_across_reads() -> None:
    from shadow.mirror.analyzer import decode_decision

    rid = "cmpl-___prefill_addr_10.0.0.1:8001___decode_addr_127.0.0.1:9002_" + "ab" * 16
    assert decode_decision(rid.encode()) == ("10.0.0.1:8001", "127.0.0.1:9002")
    assert decode_decision(b"cmpl-plain-id") is None
    rig = Rig(front_taps=["router"], worker_by_addr={"127.0.0.1:9001": "d0", "127.0.0.1:9002": "d1"})
    body = _sse_with_id(rid, 3)
    cut = body.index(b"decode_addr_") + 5  # the decision straddles two reads
    rig.run(rig.ctx("router", {"prompt": "x", "stream": True}, rid="r1"), [body[:cut], body[cut:]])
    routes = [e for e in rig.events() if isinstance(e, Route)]
    assert [r.worker for r in routes] == ["d1"]
    assert isinstance(rig.events()[-1], Finish)
    assert rig.mirror.state.workers["d1"].finished == 1


def test_front_mode_without_a_decision_is_counted_and_still_ends() -> None:
    rig = Rig(front_taps=["router"], worker_by_addr={})
    rig.run(rig.ctx("router", {"prompt": "x", "stream": True}, rid="r2"), _sse(2))
    assert not [e for e in rig.events() if isinstance(e, Route)]
    assert isinstance(rig.events()[-1], Finish)
    assert rig.mirror.dropped.get("no_routing_decision") == 1
    assert rig.mirror.state.live() == 0


def test_retry_counters_expire_with_the_pairing_ttl() -> None:
    rig = Rig(pair_ttl_s=5.0)
    rig.run(rig.ctx("d0", {"prompt": "x", "stream": True}, rid="same", t=1.0), _sse(2))
    rig.run(rig.ctx("d0", {"prompt": "x", "stream": True}, rid="same", t=2.0), _sse(2))
    assert [e.request_id for e in rig.events() if isinstance(e, Route)] == ["same", "same~2"]
    rig.an.tick(now=100.0)  # both legs started long before: their retry counter is forgotten
    assert not rig.an._decode_legs
    rig.run(rig.ctx("d0", {"prompt": "x", "stream": True}, rid="other", t=101.0), _sse(2))
    assert rig.an._decode_legs["other"][0] == 1


def _chunk(text: str, *, finish: str | None = None, token_ids: list[int] | None = None) -> bytes:
    """A completions chunk as vLLM 0.32 sends it (token_ids null unless return_token_ids)."""
    ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
          "prompt_token_ids": None, "token_ids": token_ids}
    return f"data: {json.dumps({'object': 'text_completion', 'choices': [ch]})}\n\n".encode()


def test_output_tokens_of_merged_chunks_come_from_what_the_stream_carries_never_the_chunk_count() -> None:
    """vLLM merges tokens into one chunk when the HTTP side lags: 3 chunks carrying 7 tokens."""
    r = Rig()
    merged = [_chunk(" 1 2 3"), _chunk(" 4 5"), _chunk(" 6 7", finish="length"), b"data: [DONE]\n\n"]
    # no usage, ended for length: max_tokens is the count
    r.run(r.ctx("d0", {"prompt": "p", "stream": True, "max_tokens": 7}, rid="len"), merged)
    assert r.events("len")[-1] == Finish("len", 3.0, "length", 7)
    # return_token_ids: the chunks list their tokens (also when the request stopped early)
    ids = [_chunk(" 1 2 3", token_ids=[1, 2, 3]), _chunk(" 4", token_ids=[4]),
           _chunk(" 5 6", finish="stop", token_ids=[5, 6]), b"data: [DONE]\n\n"]
    r.run(r.ctx("d0", {"prompt": "p", "stream": True, "max_tokens": 50}, rid="ids"), ids)
    assert r.events("ids")[-1] == Finish("ids", 3.0, "stop", 6)
    # nothing but text, stopped early: the chunk count is all there is, counted as a lower bound
    stop = [_chunk(" 1 2"), _chunk(" 3", finish="stop"), b"data: [DONE]\n\n"]
    r.run(r.ctx("d1", {"prompt": "p", "stream": True, "max_tokens": 50}, rid="low"), stop)
    assert r.events("low")[-1] == Finish("low", 3.0, "stop", 2)
    # a client that left mid-stream: a cancel, no finished response to count
    r.run(r.ctx("d1", {"prompt": "p", "stream": True, "max_tokens": 50}, rid="gone"), stop[:1],
          end=END_CLIENT_CANCEL)
    assert r.events("gone")[-1] == Cancel("gone", 3.0)
    assert r.an.output_counts == {("d0", "max_tokens"): 1, ("d0", "token_ids"): 1, ("d1", "chunks"): 1}


def test_prompt_token_ids_give_the_engine_count_in_plain_mode() -> None:
    r = Rig()
    first = {"object": "text_completion", "choices": [
        {"index": 0, "text": " 9", "finish_reason": None, "prompt_token_ids": list(range(11)),
         "token_ids": [9]}]}
    body = [f"data: {json.dumps(first)}\n\n".encode(), _chunk(" 8", finish="length", token_ids=[8]),
            b"data: [DONE]\n\n"]
    r.run(r.ctx("d0", {"prompt": "three words here", "stream": True, "max_tokens": 2}, rid="a"), body)
    routes = [ev for ev in r.events("a") if isinstance(ev, Route)]
    assert routes[-1].prompt_tokens == 11  # the engine's count replaces the body's estimate (3)
    assert r.events("a")[-1] == Finish("a", 3.0, "length", 2)


def test_arrive_carries_the_client_body_size_never_the_body() -> None:
    import orjson

    r = Rig()
    client = {"model": "m", "prompt": "secret words", "stream": True, "max_tokens": 3}
    plain = orjson.dumps(client)
    r.run(r.ctx("d0", plain, rid="a"), _sse(3))
    arrive = r.events("a")[0]
    assert isinstance(arrive, Arrive) and arrive.body_bytes == len(plain)
    assert "secret" not in repr(arrive)
    # P/D: the decode leg is the client's body plus the KV handle `shadow router` appends (orjson,
    # compact): the Arrive still says the client's body size, what the router scored.
    kv = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1, 2, 3], "x": "é"}
    leg = orjson.dumps({**client, "kv_transfer_params": kv})
    r.run(r.ctx("d1", leg, rid="b"), _sse(2))
    arrive = r.events("b")[0]
    assert isinstance(arrive, Arrive) and arrive.body_bytes == len(plain)
    # a body too large to keep: its size still counts
    big = TapContext("d0", "POST", "/v1/completions", "c", None, 9_000_000, 1.0)
    r.run(big, _sse(1))
    arrive = r.events("c")[0]
    assert isinstance(arrive, Arrive) and arrive.body_bytes == 9_000_000


def test_the_events_do_not_depend_on_how_the_items_were_batched() -> None:
    """A stream's Token comes where its frame is (one per frame that advances the count), so the
    same items in one batch, one at a time or split anywhere give the same events in the same
    order — also a stream whose last frames and end share a batch (before, its last chunk's Token
    was dropped when they did)."""
    def items(rig: Rig) -> list[tuple[TapContext, int, float, Any]]:
        streams = [rig.ctx(f"d{k % 2}", {"prompt": "p", "stream": True}, rid=f"s{k}", t=1.0 + k / 10)
                   for k in range(6)]
        out: list[tuple[TapContext, int, float, Any]] = []
        pieces = {k: _sse(3 + k) for k in range(6)}
        for ctx in streams:
            out.append((ctx, 0, ctx.t_start, None))
            ctx.resp_headers = SSE
            ctx.status = 200
        t = 2.0
        for i in range(10):  # interleaved frames, one per stream per step, as a relay sends them
            for k, ctx in enumerate(streams):
                if i < len(pieces[k]):
                    t += 0.001
                    out.append((ctx, i + 1, t, pieces[k][i]))
                elif i == len(pieces[k]):
                    ctx.seq = i
                    out.append((ctx, -1, t, END_COMPLETE))
        return out

    def run(cuts: list[int]) -> list[Any]:
        rig = Rig(prompt_key_fn=KeySecret(bytes(32)).prompt_key)  # one secret: the same prompt keys
        got: list[Any] = []
        rig.mirror.listeners.append(got.append)
        xs = items(rig)
        bounds = [0, *sorted(cuts), len(xs)]
        for a, b in itertools.pairwise(bounds):
            rig.an.process(xs[a:b])
        return got

    whole = run([])
    assert sum(isinstance(e, Token) for e in whole) == sum(3 + k for k in range(6))  # ([DONE] adds none)
    n = len(items(Rig()))
    assert run(list(range(1, n))) == whole
    rng = random.Random(7)
    for _ in range(20):
        assert run(rng.sample(range(1, n), rng.randrange(1, 8))) == whole
