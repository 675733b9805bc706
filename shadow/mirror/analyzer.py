"""The analysis side of the taps: turns copied request/response bytes into normalised events.

Consumes `(ctx, seq, t, payload)` items from the taps' `DropQueue` (see `shadow.dataplane.tap`),
classifies each request as a prefill leg (`kv_transfer_params.do_remote_decode == true`, or a
non-streaming `max_tokens == 1` request with `kv_transfer_params` or on a tap declared prefill) or a
decode leg, pairs P/D legs by the hash of their `X-Request-Id` (the mirror knows a request by that
hash, `contracts.ids`: the id itself is never kept), and emits Arrive/Route (decode placement = the
tap that saw the decode leg), Token (cumulative: one per data frame that advances the count, in the
frames' order, so how the frames were batched does not change the events), Finish and Cancel into
a `Mirror`. Every exception is counted and confined to the item that raised it; an end marker always
produces the request's end event. Prompt text is never kept: a prompt key is a blake2b hash.

Front mode: a tap in front of the router itself (`front_taps`) sees whole client requests; the
decode worker comes from the decision the router exposes in the response — vllm-router's P/D
request id `___prefill_addr_<P>___decode_addr_<D>_<uuid>`, echoed in every chunk's `id` — mapped
to a worker name through `worker_by_addr` (host:port → name).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from shadow.base.ordered import expire
from shadow.contracts.events import Arrive, Cancel, Finish, FinishReason, Route, Token
from shadow.contracts.tapwire import (
    END_CLIENT_CANCEL,
    END_COMPLETE,
    END_RELAY_LOST,
    END_UPSTREAM_CUT,
    END_UPSTREAM_ERROR,
    TapContext,
)
from shadow.mirror.hub import Mirror
from shadow.mirror.keys import KeySecret
from shadow.vllm.sse import DEFAULT_MAX_FRAME, StreamParser, parse_json_body

ROLE_OTHER, ROLE_PREFILL, ROLE_DECODE = "other", "prefill", "decode"
# vllm-router (P/D) names both choices in the request id it sends to workers; vLLM echoes it in `id`.
_VLLM_ROUTER_DECISION = re.compile(rb"___prefill_addr_([^\s\"]+?)___decode_addr_([^\s\"]+?)_[0-9a-f]{32}")


def decode_decision(data: bytes) -> tuple[str, str] | None:
    """(prefill address, decode address) named by a vllm-router P/D request id in `data`, if any."""
    m = _VLLM_ROUTER_DECISION.search(data)
    if m is None:
        return None
    return m.group(1).decode("ascii", "replace"), m.group(2).decode("ascii", "replace")


_LLM_PATHS = ("/completions", "/chat/completions", "/generate")
_FINISH_MAP: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "error": "error",
    "tool_calls": "stop",
    "function_call": "stop",
}


class _Leg:
    __slots__ = (
        "body",
        "body_lost",
        "ended_as",
        "estimate",
        "gaps",
        "last_seq",
        "max_tokens",
        "mid",
        "parser",
        "prompt_known",
        "raw_rid",
        "role",
        "sent_gen",
        "stream",
        "tail",
        "worker",
    )

    def __init__(self, role: str) -> None:
        self.role = role
        self.worker: str | None = None  # where the decode runs (the tap's name, or decoded in front mode)
        self.tail = b""  # front mode: the end of the previous chunk, for a decision split across reads
        self.raw_rid = ""
        self.mid = ""  # the mirrored request id (unique per decode leg)
        self.stream = False
        self.parser: StreamParser | None = None
        self.body: list[bytes] | None = None
        self.body_lost = False
        self.last_seq = 0
        self.sent_gen = 0
        self.max_tokens: int | None = None
        self.prompt_known = False
        self.estimate: int | None = None  # prompt tokens read from the request body (plain mode)
        self.gaps = 0
        self.ended_as = ""  # the end as judged (a client that left after the stream's end: complete)


class _Pair:
    __slots__ = ("decode", "prefill_tap", "prompt", "t_arrive")

    def __init__(self, t_arrive: float, prefill_tap: str) -> None:
        self.t_arrive = t_arrive
        self.prefill_tap = prefill_tap
        self.prompt: int | None = None
        self.decode: tuple[TapContext, _Leg] | None = None


def prompt_key(req: dict[str, Any]) -> str | None:
    """A keyed hash of the prompt under a fresh random secret (use `shadow.mirror.keys.KeySecret`
    for a per-deployment one); the text itself is never kept."""
    return KeySecret().prompt_key(req)


CHAT_MESSAGE_TOKENS = 4  # template tokens per chat message, before calibration


#: What a P/D proxy adds to the client's body in the decode leg, before the KV handle's JSON.
_KV_MEMBER = b',"kv_transfer_params":'


def client_body_bytes(body_len: int, req: dict[str, Any]) -> int:
    """The client's request-body size in bytes (what the vllm-ascend proxy's JSQ rule scores) from
    a decode leg's body of `body_len` bytes, parsed as `req` ({} when not parsed): the leg's size,
    less the `kv_transfer_params` member a P/D proxy appends to the decode leg (as compact JSON, the
    form `shadow router` sends; a proxy that serialises it otherwise leaves a few bytes' error)."""
    kv = req.get("kv_transfer_params")
    if kv is None:
        return body_len
    member = len(_KV_MEMBER) + len(json.dumps(kv, separators=(",", ":"), ensure_ascii=False).encode())
    return max(0, body_len - member)


def estimate_prompt_tokens(req: dict[str, Any]) -> int | None:
    """Prompt tokens read from a request body: exact for token-id prompts, else a word count
    (+ CHAT_MESSAGE_TOKENS per chat message) that `PromptCalibration` scales to the workers' counts."""
    prompt = req.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(x) is int for x in prompt):
        return len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return len(prompt.split())
    messages = req.get("messages")
    if isinstance(messages, list) and messages:
        total = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                texts = [p.get("text") for p in content if isinstance(p, dict)]
                content = " ".join(x for x in texts if isinstance(x, str))
            total += (len(content.split()) if isinstance(content, str) else 0) + CHAT_MESSAGE_TOKENS
        return total
    return None


class PromptCalibration:
    """Tokens per estimated token, learnt from the exact counts workers report (usage).

    Starts at 1.0 (exact for whitespace tokenisers such as the simulated fleet's); each exact
    count moves it by an exponentially weighted average over about `memory` requests."""

    def __init__(self, memory: int = 200) -> None:
        self.ratio = 1.0
        self.weight = 1.0 / memory
        self.observed = 0

    def scale(self, estimate: int) -> int:
        return max(0, round(estimate * self.ratio))

    def observe(self, estimate: int, exact: int) -> None:
        if estimate > 0 and exact >= 0:
            self.observed += 1
            w = max(self.weight, 1.0 / self.observed)
            self.ratio += w * (exact / estimate - self.ratio)


OUTPUT_SOURCES = ("usage", "token_ids", "max_tokens", "chunks", "none")


def output_count(p: StreamParser | None, max_tokens: int | None) -> tuple[int, str]:
    """A finished response's output tokens and what they are counted from (OUTPUT_SOURCES): the
    worker's usage, the chunks' token_ids, `max_tokens` when the response ended for length
    (finish_reason "length": the limit was reached), else the chunks with content, a lower bound
    (vLLM merges several tokens into one chunk when the HTTP side lags)."""
    if p is None:
        return 0, "none"
    source = p.count_source
    if source == "chunks" and p.finish_reason == "length" and max_tokens is not None \
            and p.content_chunks <= max_tokens:
        return max_tokens, "max_tokens"
    return p.generated, source


def _is_llm_path(path: str) -> bool:
    p = path.split("?", 1)[0].rstrip("/")
    return p.endswith(_LLM_PATHS)


class RequestSpans(Protocol):
    """Told when a tap's generation request starts and ends (tracing: telemetry's `TapSpans`); the
    end's reason as the analysis judged it (a client that left after the stream's end: complete)."""

    def started(self, ctx: TapContext, role: str) -> None: ...

    def ended(self, ctx: TapContext, t: float, reason: str, worker: str | None) -> None: ...


class Analyzer:
    """Per-request analysis of tap traffic; `process(batch)`, driven by the tap service. `spans`
    hears of every generation request's start and end (role: prefill, decode or front)."""

    def __init__(
        self,
        mirror: Mirror,
        *,
        prefill_taps: Iterable[str] = (),
        max_body: int = 4 << 20,
        max_frame: int = DEFAULT_MAX_FRAME,
        hook: Callable[[TapContext, bytes], None] | None = None,
        pair_ttl_s: float = 600.0,
        max_pairs: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        front_taps: Iterable[str] = (),
        worker_by_addr: Mapping[str, str] | None = None,
        prompt_key_fn: Callable[[dict[str, Any]], str | None] | None = None,
        spans: RequestSpans | None = None,
    ) -> None:
        self.mirror = mirror
        self.spans = spans
        self.prompt_key = prompt_key_fn if prompt_key_fn is not None else KeySecret().prompt_key
        self.prefill_taps = frozenset(prefill_taps)
        self.front_taps = frozenset(front_taps)
        self.worker_by_addr = dict(worker_by_addr or {})
        self.max_body = max_body
        self.max_frame = max_frame
        self.hook = hook
        self.pair_ttl_s = pair_ttl_s
        self.max_pairs = max_pairs
        self.clock = clock
        self._id_prefix = "tap-" + secrets.token_hex(3)
        self._next_id = 0
        self._pairs: OrderedDict[str, _Pair] = OrderedDict()
        # raw rid -> (decode legs seen, when the last one started); oldest first, expired by tick()
        self._decode_legs: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._recomputed: OrderedDict[str, str] = OrderedDict()  # raw rid -> mirrored id
        self.calibration = PromptCalibration()
        self._now = 0.0  # set by `process` for its batch
        # counters (exported by MirrorCollector)
        self.items = 0
        self.chunks: dict[str, int] = {}
        self.legs: dict[tuple[str, str], int] = {}
        self.ends: dict[tuple[str, str], int] = {}
        self.inflight: dict[str, int] = {}
        self.gaps = 0
        # finished decode legs (not cancelled) by what their output count came from (output_count)
        self.output_counts: dict[tuple[str, str], int] = {}

    def process(self, items: list[tuple[TapContext, int, float, Any]]) -> None:
        mirror = self.mirror
        self._now = self.clock()  # the batch's receive time, for its Token events (one read per batch)
        for item in items:
            self.items += 1
            ctx, seq, t, payload = item
            try:
                leg = ctx.an
                if leg is None:
                    leg = self._start(ctx)
                    if self.spans is not None and leg.role != ROLE_OTHER:
                        self._span_start(ctx, leg)
                if seq > 0:
                    self._data(ctx, leg, seq, t, payload)
                elif seq < 0:
                    self._end(ctx, leg, t, payload)
            except Exception:
                mirror.count_error("analysis")
                if seq < 0:
                    self._end_anyway(ctx, t)
            if seq < 0 and self.spans is not None:
                self._span_end(ctx, t, payload)

    def _span_start(self, ctx: TapContext, leg: _Leg) -> None:
        assert self.spans is not None
        try:
            self.spans.started(ctx, "front" if ctx.tap in self.front_taps else leg.role)
        except Exception:
            self.mirror.count_error("tracing")

    def _span_end(self, ctx: TapContext, t: float, reason: Any) -> None:
        assert self.spans is not None
        leg = ctx.an
        if not isinstance(leg, _Leg) or leg.role == ROLE_OTHER:
            return
        try:
            self.spans.ended(ctx, t, leg.ended_as or str(reason), leg.worker)
        except Exception:
            self.mirror.count_error("tracing")

    def tick(self, now: float) -> None:
        """Expire P/D pairing records whose decode leg never came, and old retry counters."""
        limit = now - self.pair_ttl_s
        expire(self._decode_legs, limit, lambda leg: leg[1])
        unpaired = expire(self._pairs, limit, lambda p: p.t_arrive)
        if unpaired:
            self.mirror.count_drop("unpaired_prefill", unpaired)

    # -- one request -----------------------------------------------------------------------------

    def _new_id(self) -> str:
        self._next_id += 1
        return f"{self._id_prefix}-{self._next_id}"

    def _start(self, ctx: TapContext) -> _Leg:
        if ctx.method != "POST" or not _is_llm_path(ctx.path):
            leg = _Leg(ROLE_OTHER)
            ctx.an = leg
            return leg
        req: dict[str, Any] = {}
        if ctx.body is None:
            self.mirror.count_drop("oversized_body")
        else:
            try:
                obj = json.loads(ctx.body)
                if isinstance(obj, dict):
                    req = obj
                else:
                    self.mirror.count_drop("invalid_request")
            except ValueError:
                self.mirror.count_drop("invalid_request")
        stream = req.get("stream") is True
        kv = req.get("kv_transfer_params")
        max_tokens = req.get("max_tokens", req.get("max_completion_tokens"))
        one = max_tokens == 1 and not stream
        is_prefill = (isinstance(kv, dict) and kv.get("do_remote_decode") is True) or (
            one and (isinstance(kv, dict) or ctx.tap in self.prefill_taps)
        )
        tap = ctx.tap
        raw = ctx.request_id[:200] if ctx.request_id else self._new_id()
        leg = _Leg(ROLE_PREFILL if is_prefill else ROLE_DECODE)
        ctx.an = leg
        leg.raw_rid = raw
        leg.stream = stream
        self.legs[(tap, leg.role)] = self.legs.get((tap, leg.role), 0) + 1
        self.inflight[tap] = self.inflight.get(tap, 0) + 1
        now = self.clock()
        if is_prefill:
            pair = self._pairs.get(raw)
            if pair is None:
                self._pairs[raw] = _Pair(ctx.t_start, tap)
                if len(self._pairs) > self.max_pairs:
                    self._pairs.popitem(last=False)
                    self.mirror.count_drop("unpaired_prefill")
            leg.mid = raw
            return leg
        # decode leg: one mirrored request per leg (a retried or re-used id gets a suffix),
        # except the re-dispatch of a recomputed request, which moves the same request.
        mid = self._recomputed.pop(raw, None)
        if mid is None:
            n = self._decode_legs.pop(raw, (0, 0.0))[0] + 1
            self._decode_legs[raw] = (n, ctx.t_start)
            if len(self._decode_legs) > self.max_pairs:
                self._decode_legs.popitem(last=False)
            mid = raw if n == 1 else f"{raw}~{n}"
        leg.mid = mid
        pair = self._pairs.get(raw)
        prompt = pair.prompt if pair is not None else None
        if pair is not None:
            pair.decode = (ctx, leg)
        t_arr = pair.t_arrive if pair is not None else ctx.t_start
        ok_mt = isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 0
        mt = max_tokens if ok_mt else None
        leg.max_tokens = mt
        mirror = self.mirror
        arrive_prompt = prompt
        if prompt is None and req:
            # Plain mode: the worker reports its count at the end of the stream at best; until
            # then the mirrored load holds the body's estimate (corrected when the count comes).
            leg.estimate = estimate_prompt_tokens(req)
            if leg.estimate is not None:
                arrive_prompt = self.calibration.scale(leg.estimate)
        mirror.emit(Arrive(mid, t_arr, arrive_prompt, self.prompt_key(req) if req else None, mt,
                           client_body_bytes(ctx.body_len, req)), "tap", now)
        leg.prompt_known = prompt is not None
        if tap in self.front_taps:
            return leg  # the route comes with the response (see _decision)
        leg.worker = tap
        mirror.emit(Route(mid, ctx.t_start, tap, prompt), "tap", now)
        return leg

    def _decision(self, ctx: TapContext, leg: _Leg, payload: bytes) -> None:
        """Front mode: find the router's decision in the response and emit the Route."""
        found = decode_decision(leg.tail + payload)
        if found is None:
            leg.tail = payload[-200:]
            return
        leg.tail = b""
        addr = found[1]
        name = self.worker_by_addr.get(addr)
        if name is None:
            self.mirror.count_drop("unknown_decode_address")
            name = addr
        leg.worker = name
        prompt = leg.parser.prompt_tokens if leg.parser is not None else None
        leg.prompt_known = prompt is not None
        self.mirror.emit(Route(leg.mid, ctx.t_start, name, prompt), "tap", self.clock())

    def _data(self, ctx: TapContext, leg: _Leg, seq: int, t: float, payload: bytes) -> None:
        if leg.role == ROLE_OTHER:
            return
        tap = ctx.tap
        self.chunks[tap] = self.chunks.get(tap, 0) + 1
        gap = seq != leg.last_seq + 1
        leg.last_seq = seq
        if self.hook is not None:
            self.hook(ctx, payload)
        if leg.worker is None and leg.role == ROLE_DECODE:
            self._decision(ctx, leg, payload)
        parser = leg.parser
        if parser is None and leg.body is None:
            ctype = ctx.resp_headers.get("content-type", "")
            if "event-stream" in ctype or (leg.stream and not ctype):
                parser = leg.parser = StreamParser(self.max_frame)
            else:
                leg.body = []
        if gap:
            leg.gaps += 1
            self.gaps += 1
            if parser is not None:
                parser.reset_partial()
            else:
                leg.body_lost = True
        if parser is not None:
            parser.feed(payload)
            if leg.role == ROLE_DECODE:
                g = parser.generated
                if g > leg.sent_gen:
                    leg.sent_gen = g
                    self.mirror.emit(Token(leg.mid, t, g), "tap", self._now)
                if not leg.prompt_known and leg.worker is not None and parser.prompt_tokens is not None:
                    self._prompt_learnt(ctx, leg, parser.prompt_tokens, t)
        elif leg.body is not None and not leg.body_lost:
            leg.body.append(payload)
            if sum(map(len, leg.body)) > self.max_body:
                leg.body = []
                leg.body_lost = True
                self.mirror.count_drop("oversized_body")

    def _prompt_learnt(self, ctx: TapContext, leg: _Leg, prompt: int, t: float) -> None:
        """Prompt tokens learnt after the route (plain mode): a repeated Route that adds them."""
        leg.prompt_known = True
        if leg.estimate is not None:
            self.calibration.observe(leg.estimate, prompt)
        if leg.worker is not None:
            self.mirror.emit(Route(leg.mid, ctx.t_start, leg.worker, prompt), "tap", self.clock())

    def _result(self, leg: _Leg) -> StreamParser | None:
        p: StreamParser | None = None
        if leg.parser is not None:
            p = leg.parser
            p.close()
        elif leg.body is not None and not leg.body_lost:
            p = parse_json_body(b"".join(leg.body), self.max_body)
        if p is not None:
            if p.invalid_json:
                self.mirror.count_drop("invalid_json", p.invalid_json)
            if p.oversized:
                self.mirror.count_drop("oversized_frame", p.oversized)
        return p

    def _end(self, ctx: TapContext, leg: _Leg, t: float, reason: str) -> None:
        tap = ctx.tap
        self.ends[(tap, reason)] = self.ends.get((tap, reason), 0) + 1
        if leg.role == ROLE_OTHER:
            return
        self.inflight[tap] = self.inflight.get(tap, 1) - 1
        if ctx.seq != leg.last_seq:  # the copy lost this stream's tail
            leg.gaps += 1
            self.gaps += 1
            leg.last_seq = ctx.seq
            leg.body_lost = True
        if leg.role == ROLE_PREFILL:
            self._end_prefill(ctx, leg, t, reason)
            return
        if leg.worker is None:
            self.mirror.count_drop("no_routing_decision")  # front mode: the router named no worker
        now = self.clock()
        emit = self.mirror.emit
        mid = leg.mid
        pair = self._pairs.get(leg.raw_rid)
        if pair is not None and pair.decode is not None and pair.decode[1] is leg:
            del self._pairs[leg.raw_rid]
        p = self._result(leg)
        gen, source = output_count(p, leg.max_tokens)
        gen = max(leg.sent_gen, gen)
        if p is not None and not leg.prompt_known and p.prompt_tokens is not None:
            self._prompt_learnt(ctx, leg, p.prompt_tokens, t)
        if gen > leg.sent_gen:
            leg.sent_gen = gen
            emit(Token(mid, t, gen), "tap", now)
        if reason in (END_CLIENT_CANCEL, END_RELAY_LOST) and p is not None and (
            p.done or p.finish_reason is not None
        ):
            reason = END_COMPLETE  # the client (or the relay) left after the stream's end: it was whole
        leg.ended_as = reason
        if reason == END_CLIENT_CANCEL:
            emit(Cancel(mid, t), "tap", now)
            return
        fr: FinishReason
        if reason in (END_UPSTREAM_CUT, END_RELAY_LOST):
            fr = "cut"  # the client's stream broke off (upstream, or the relay itself died)
        elif reason == END_UPSTREAM_ERROR or ctx.status >= 400 or (p is not None and p.error):
            fr = "error"
        elif p is None:
            fr = "other"
        elif p.stop_reason == "recomputed":
            self._recomputed[leg.raw_rid] = mid  # the request continues elsewhere: no finish
            if len(self._recomputed) > self.max_pairs:
                self._recomputed.popitem(last=False)
            return
        elif p.finish_reason is not None:
            fr = _FINISH_MAP.get(p.finish_reason, "other")
        elif leg.gaps:
            fr = "other"  # the copy lost data: the real end is unknown
        elif leg.parser is not None and not p.done:
            fr = "cut"  # 200 and a clean close, but neither a finish reason nor [DONE]
        else:
            fr = "other"
        key = (leg.worker or tap, source)
        self.output_counts[key] = self.output_counts.get(key, 0) + 1
        emit(Finish(mid, t, fr, gen), "tap", now)

    def _end_prefill(self, ctx: TapContext, leg: _Leg, t: float, reason: str) -> None:
        pair = self._pairs.get(leg.raw_rid)
        ok = reason == END_COMPLETE and ctx.status < 400
        p = self._result(leg) if ok else None
        if p is None or p.error or p.prompt_tokens is None:
            if not ok or (p is not None and p.error):
                self.mirror.count_drop("prefill_failed")
            return
        if pair is None:
            return
        pair.prompt = p.prompt_tokens
        if pair.decode is not None:  # decode leg started first (concurrent P/D): add the prompt
            dctx, dleg = pair.decode
            if not dleg.prompt_known and not dctx.ended:
                self._prompt_learnt(dctx, dleg, p.prompt_tokens, t)

    def _end_anyway(self, ctx: TapContext, t: float) -> None:
        """After an analysis error on an end marker: still end the mirrored request."""
        leg = ctx.an
        try:
            if isinstance(leg, _Leg) and leg.role == ROLE_DECODE and leg.mid:
                self.mirror.emit(Finish(leg.mid, t, "other", leg.sent_gen or None), "tap", self.clock())
        except Exception:
            self.mirror.count_error("analysis_end")

    def output_summary(self) -> dict[str, Any]:
        """Finished decode responses by what their output count came from (`output_count`), with a
        warning when some were only counted in chunks (a lower bound of their tokens)."""
        by: dict[str, int] = {}
        for (_, source), n in list(self.output_counts.items()):
            by[source] = by.get(source, 0) + n
        out: dict[str, Any] = {"by_source": by}
        total, chunks = sum(by.values()), by.get("chunks", 0)
        if chunks:
            out["warning"] = (
                f"{chunks} of {total} finished responses carried no usage or token_ids and did not end "
                "for length: their output tokens are counted in chunks, a lower bound (vLLM merges "
                "tokens into one chunk under load); clients asking stream_options.include_usage, or "
                "the taps with --inject-usage, make them exact")
        return out
