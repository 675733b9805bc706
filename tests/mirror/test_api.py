"""Event API, published JSON Schema, emitter."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from shadow.contracts.events import (
    Arrive,
    Cancel,
    Finish,
    Route,
    Step,
    Token,
    from_dict,
    load_schema,
    to_dict,
)
from shadow.mirror.api import create_app, parse_event
from shadow.mirror.emitter import Emitter
from shadow.mirror.hub import Mirror, event_dict
from shadow.mirror.metrics import MirrorCollector
from shadow.mirror.state import MirrorState

SCHEMA = load_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

rids = st.text(min_size=1, max_size=40)
ts = st.floats(-1e9, 1e9, allow_nan=False, allow_infinity=False)
nn = st.integers(0, 10**9)
step_ends = st.lists(st.tuples(ts, st.floats(1e-9, 3599.9)), min_size=1, max_size=5).map(
    lambda pairs: tuple(x for pair in pairs for x in pair))
events = st.one_of(
    st.builds(Arrive, rids, ts, st.none() | nn, st.none() | st.text(max_size=20), st.none() | nn),
    st.builds(Route, rids, ts, st.text(min_size=1, max_size=10), st.none() | nn),
    st.builds(Token, rids, ts, nn, st.none() | step_ends),
    st.builds(
        Finish,
        rids,
        ts,
        st.sampled_from(["stop", "length", "abort", "error", "cut", "reaped", "other"]),
        st.none() | nn,
    ),
    st.builds(Cancel, rids, ts),
    st.builds(Step, ts, st.floats(0, 3599.9, allow_nan=False), st.none() | st.text(max_size=10)),
)


def _valid(obj: Any) -> bool:
    return VALIDATOR.is_valid(obj)


def _accepted(obj: Any) -> bool:
    try:
        parse_event(obj)
        return True
    except ValueError:
        return False


@settings(max_examples=300, deadline=None)
@given(events)
def test_every_valid_event_validates_against_the_schema(ev: Any) -> None:
    d = to_dict(ev)
    assert d == event_dict(ev)
    line = json.loads(json.dumps(d))  # the NDJSON form (a tuple is a JSON array)
    assert _valid(line), d
    assert _accepted(line)


_MUTATIONS = [
    lambda d: {k: v for k, v in d.items() if k != "t"},
    lambda d: {k: v for k, v in d.items() if k != "request_id"} if "request_id" in d else {**d, "t": "x"},
    lambda d: {**d, "extra": 1},
    lambda d: {**d, "type": "bogus"},
    lambda d: {**d, "t": None},
    lambda d: {**d, "t": "1.0"},
    lambda d: {**d, "t": True},
    lambda d: {**d, "request_id": ""} if "request_id" in d else {**d, "duration_s": -1},
    lambda d: {**d, "request_id": "x" * 257} if "request_id" in d else {**d, "duration_s": 3600},
    lambda d: {**d, "request_id": 5} if "request_id" in d else {**d, "worker": 5},
    lambda d: {**d, "generated": -1} if d["type"] in ("token", "finish") else {**d, "type": 3},
    lambda d: {**d, "generated": True} if d["type"] == "token" else {**d, "t": [1]},
    lambda d: {**d, "reason": "exploded"} if d["type"] == "finish" else {**d, "t": {}},
    lambda d: {**d, "worker": ""} if d["type"] == "route" else {**d, "t": "now"},
    lambda d: {**d, "prompt_tokens": 1.5} if d["type"] in ("arrive", "route") else {**d, "t": "z"},
    lambda d: {**d, "prompt_key": 7} if d["type"] == "arrive" else {**d, "t": "y"},
    lambda d: {**d, "step_ends": []} if d["type"] == "token" else {**d, "t": "w"},
    lambda d: {**d, "step_ends": [1.0, "0.06"]} if d["type"] == "token" else {**d, "t": "v"},
    lambda d: {**d, "step_ends": [1.0, 0.06] * 1025} if d["type"] == "token" else {**d, "t": "u"},
]


@settings(max_examples=300, deadline=None)
@given(events, st.sampled_from(range(len(_MUTATIONS))))
def test_invalid_events_are_rejected_by_both_schema_and_api(ev: Any, i: int) -> None:
    bad = _MUTATIONS[i](to_dict(ev))
    assert not _valid(bad), bad
    assert not _accepted(bad), bad


def _app(max_body: int = 1 << 20) -> tuple[Any, Mirror, CollectorRegistry, dict[str, int]]:
    mirror = Mirror(MirrorState(["d0", "d1"], ttl_s=5))
    reg = CollectorRegistry()
    rejected: dict[str, int] = {}
    reg.register(MirrorCollector(mirror, rejected=rejected))
    app = create_app(mirror, reg, rejected=rejected, max_body=max_body, clock=lambda: 0.0)
    return app, mirror, reg, rejected


async def _call(app: Any, method: str, url: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.request(method, url, **kw)


def test_post_events_counts_accepted_and_rejections_by_reason() -> None:
    app, mirror, reg, _ = _app()
    lines = [
        json.dumps(to_dict(Route("a", 0.0, "d0", 5))),
        json.dumps(to_dict(Token("a", 0.1, 2))),
        json.dumps(to_dict(Token("a", 0.1, 2))),  # duplicate: accepted, outcome duplicate
        "{not json",
        "[1, 2]",
        json.dumps({"type": "nope", "t": 0}),
        json.dumps({"type": "token", "t": 0, "request_id": "a"}),
        json.dumps({"type": "token", "t": 0, "request_id": "a", "generated": 1, "x": 1}),
        json.dumps({"type": "route", "t": 0, "request_id": "b", "worker": "zz"}),
        "",
        json.dumps(to_dict(Finish("a", 0.2, "stop", 3))),
    ]
    r = asyncio.run(_call(app, "POST", "/v1/events", content="\n".join(lines).encode()))
    assert r.status_code == 200
    body = r.json()
    assert body["accepted"] == 5
    assert body["rejected"] == {
        "invalid_json": 1,
        "not_object": 1,
        "unknown_type": 1,
        "missing_field": 1,
        "unknown_field": 1,
    }
    assert body["outcomes"] == {"ok": 3, "duplicate": 1, "unknown_worker": 1}
    assert mirror.state.active() == 0 and mirror.state.workers["d0"].finished == 1
    assert reg.get_sample_value("shadow_mirror_events_rejected_total", {"reason": "invalid_json"}) == 1
    assert reg.get_sample_value("shadow_mirror_events_ignored_total", {"reason": "unknown_worker"}) == 1
    assert reg.get_sample_value("shadow_mirror_events_total", {"source": "api", "kind": "route"}) == 2


def test_oversized_body_is_413_and_nothing_applied() -> None:
    app, mirror, _, rejected = _app(max_body=1000)
    line = json.dumps(to_dict(Route("a", 0.0, "d0"))) + "\n"
    r = asyncio.run(_call(app, "POST", "/v1/events", content=(line * 100).encode()))
    assert r.status_code == 413 and mirror.state.active() == 0 and rejected["too_large"] == 1

    async def chunks() -> Any:  # no content-length: the streamed body is bounded too
        for _ in range(100):
            yield line.encode()

    r = asyncio.run(_call(app, "POST", "/v1/events", content=chunks()))
    assert r.status_code == 413 and mirror.state.active() == 0


def test_schema_state_recent_events_and_metrics_endpoints() -> None:
    app, mirror, _, _ = _app()
    mirror.emit(Route("a", 1.0, "d0", 3), "api", 0.0)
    mirror.emit(Token("a", 1.5, 1), "api", 0.0)
    r = asyncio.run(_call(app, "GET", "/v1/events/schema"))
    assert r.json() == SCHEMA
    st_ = asyncio.run(_call(app, "GET", "/v1/state")).json()
    assert st_["workers"]["d0"]["active"] == 1 and st_["workers"]["d0"]["kv_tokens"] == 4
    assert st_["phantoms"] == 0
    r = asyncio.run(_call(app, "GET", "/v1/events?after=1"))
    assert r.headers["x-last-seq"] == "2"
    assert [json.loads(x) for x in r.text.splitlines()] == [to_dict(Token("a", 1.5, 1))]
    m = asyncio.run(_call(app, "GET", "/metrics")).text
    assert 'shadow_mirror_requests_active{worker="d0"} 1.0' in m


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            events.map(lambda e: json.dumps(to_dict(e))),
            st.text(max_size=60),
            st.builds(
                lambda d: json.dumps(d),
                st.dictionaries(
                    st.sampled_from(["type", "t", "request_id", "worker", "generated", "reason", "zz"]),
                    st.one_of(st.none(), st.integers(-3, 3), st.text(max_size=4), st.floats(allow_nan=False)),
                    max_size=5,
                ),
            ),
        ),
        max_size=40,
    )
)
def test_fuzzed_batches_never_fail_and_every_line_is_accounted(lines: list[str]) -> None:
    app, mirror, _, _ = _app()
    body = "\n".join(lines).encode()
    r = asyncio.run(_call(app, "POST", "/v1/events", content=body))
    assert r.status_code == 200
    out = r.json()
    n = sum(1 for ln in body.split(b"\n") if ln.strip())
    assert out["accepted"] + sum(out["rejected"].values()) == n
    assert sum(out["outcomes"].values()) == out["accepted"]
    # every stream then ends: nothing stays active
    for rid in list(mirror.state._live):
        mirror.emit(Finish(rid, 0.0, "stop"), "api", 0.0)
    assert mirror.state.active() == 0 and mirror.state.phantoms(1e9) == 0


def test_emitter_batches_and_never_raises() -> None:
    got: list[list[dict[str, Any]]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path != "/v1/events":
            return httpx.Response(404)
        got.append([json.loads(x) for x in req.content.decode().splitlines()])
        return httpx.Response(200, json={"accepted": len(got[-1]), "rejected": {}})

    async def run() -> Emitter:
        em = Emitter("http://x", batch_size=3, flush_interval_s=0.01, transport=httpx.MockTransport(handler))
        async with em:
            for i in range(7):
                assert em.emit(Token("a", float(i), i))
            # the background flusher posts all 7 before close (a condition; close would flush too)
            deadline = asyncio.get_running_loop().time() + 10
            while em.sent < 7:
                assert asyncio.get_running_loop().time() < deadline, f"flusher posted {em.sent} of 7"
                await asyncio.sleep(0.005)
        return em

    em = asyncio.run(run())
    assert [len(b) for b in got][:2] == [3, 3] and sum(len(b) for b in got) == 7 and em.sent == 7

    def broken(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("down")

    async def run_broken() -> Emitter:
        em = Emitter("http://x/v1/events", transport=httpx.MockTransport(broken), max_buffer=2)
        em.emit(Token("a", 0.0, 1))
        em.emit(Token("a", 0.0, 2))
        assert not em.emit(Token("a", 0.0, 3))  # full
        await em.flush()
        await em.aclose()
        return em

    em = asyncio.run(run_broken())
    assert em.errors == 1 and em.dropped == 3 and em.sent == 0


def test_emitter_feeds_a_real_api_app() -> None:
    app, mirror, _, _ = _app()

    async def run() -> None:
        async with Emitter("http://t", transport=httpx.ASGITransport(app=app)) as em:
            em.emit(Route("a", 0.0, "d1", 2))
            em.emit(Token("a", 0.1, 4))
        assert mirror.state.workers["d1"].kv_tokens == 6

    asyncio.run(run())


def test_event_ingestion_needs_a_token_off_loopback() -> None:
    line = json.dumps(to_dict(Arrive("a", 1.0, 5))) + "\n"

    async def post(app: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/events", content=line, headers=headers or {})

    def app_for(**kw: Any) -> Any:
        return create_app(Mirror(MirrorState(["d0"])), CollectorRegistry(), **kw)

    # Loopback without a token: allowed (the default). Network without a token: refused.
    assert asyncio.run(post(app_for())).json()["accepted"] == 1
    refused = asyncio.run(post(app_for(host="0.0.0.0")))
    assert refused.status_code == 403 and "token" in refused.json()["error"]
    # With a token, it is required wherever the API listens.
    guarded = app_for(host="0.0.0.0", ingest_token="t0k")
    assert asyncio.run(post(guarded)).status_code == 401
    assert asyncio.run(post(guarded, {"Authorization": "Bearer wrong"})).status_code == 401
    ok = asyncio.run(post(guarded, {"Authorization": "Bearer t0k"}))
    assert ok.status_code == 200 and ok.json()["accepted"] == 1


def test_the_probe_token_admits_step_lines_only() -> None:
    """The engine probe's token moves the lanes' clock and nothing else: with it, every line but a
    `step` is rejected (`unauthorized_kind`, counted) and the mirrored state does not change; the
    events token admits every kind; a kind no token guards stays open on loopback only."""
    now = time.monotonic()  # the API's clock (events far from it are dropped)
    lines = [to_dict(Step(now, 0.02, "d0", source="probe")), to_dict(Arrive("a", now, 5)),
             to_dict(Route("a", now, "d0", 5)), to_dict(Token("a", now, 1)),
             to_dict(Finish("a", now, "stop", 1)), to_dict(Cancel("b", now))]
    body = "\n".join(json.dumps(x) for x in lines).encode()

    def post(app: Any, token: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return asyncio.run(_call(app, "POST", "/v1/events", content=body, headers=headers))

    def app_for(**kw: Any) -> tuple[Any, Mirror, CollectorRegistry]:
        mirror = Mirror(MirrorState(["d0"]))
        reg = CollectorRegistry()
        rejected: dict[str, int] = {}
        reg.register(MirrorCollector(mirror, rejected=rejected))
        return create_app(mirror, reg, rejected=rejected, **kw), mirror, reg

    app, mirror, reg = app_for(host="0.0.0.0", ingest_token="ev", probe_token="pr")
    steps_only = post(app, "pr")
    assert steps_only.status_code == 200, steps_only.text
    assert steps_only.json()["accepted"] == 1 and steps_only.json()["rejected"] == {"unauthorized_kind": 5}
    assert mirror.state.live() == 0 and mirror.state.last_step is not None
    assert reg.get_sample_value("shadow_mirror_events_rejected_total", {"reason": "unauthorized_kind"}) == 5
    assert post(app, "ev").json()["accepted"] == 6
    assert post(app).status_code == 401 and post(app, "wrong").status_code == 401
    # an admin token guards the process (events could trip its mode): still steps with the probe's
    app, mirror, _ = app_for(probe_token="pr", token_required=True)
    assert post(app, "pr").json()["accepted"] == 1 and mirror.state.live() == 0
    assert post(app).status_code == 401
    # loopback, only a probe token: the other kinds stay open as before, a step needs its token
    app, _, _ = app_for(probe_token="pr")
    assert post(app).json()["rejected"] == {"unauthorized_kind": 1}
    assert post(app, "pr").json()["accepted"] == 6


def test_step_ends_the_schema_cannot_express_are_refused_with_their_reason() -> None:
    # (t, gap) pairs, flat: an odd count or a gap outside (0, 3600) s passes the schema's array
    # check, not the parser's
    base = {"type": "token", "request_id": "a", "t": 1.0, "generated": 2}
    for ends, why in (([1.0], "pairs"), ([1.0, 0.0], "gap"), ([1.0, -0.5], "gap"), ([1.0, 3600], "gap"),
                      ([float("nan"), 0.1], "finite")):
        with pytest.raises(ValueError, match=why):
            from_dict({**base, "step_ends": ends})
    assert from_dict({**base, "step_ends": [0.9, 0.05]}) == Token("a", 1.0, 2, (0.9, 0.05))
