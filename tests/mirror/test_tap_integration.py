"""Taps on loopback in front of stub vLLM workers: byte identity, faults, disconnects, P/D pairing."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
import uuid
from typing import Any

import httpx
import pytest

from shadow.contracts.events import Cancel, Finish, Route
from shadow.contracts.ids import request_hash
from shadow.contracts.tapwire import TapContext
from shadow.mirror.config import MirrorConfig
from tests.harness import TapThread
from tests.mirror.helpers import dechunk, http_post, raw_request, split_response
from tests.mirror.stub_worker import ThreadServer, create_stub

pytestmark = pytest.mark.integration


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _cases() -> list[tuple[str, str, dict[str, Any]]]:
    chat = [{"role": "user", "content": "hello"}]
    return [
        ("chat-stream", "/v1/chat/completions", {"model": "m", "messages": chat, "stream": True}),
        (
            "chat-usage",
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": chat,
                "stream": True,
                "max_tokens": 5,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            "cmpl-continuous",
            "/v1/completions",
            {
                "model": "m",
                "prompt": "abc " * 20,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        ),
        ("cmpl-plain", "/v1/completions", {"model": "m", "prompt": "x", "stream": True, "max_tokens": 3}),
        ("non-stream", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 4}),
        ("chat-non-stream", "/v1/chat/completions", {"model": "m", "messages": chat}),
        ("status-400", "/v1/completions", {"model": "m", "prompt": "x", "stub": {"status": 400}}),
        (
            "error-event",
            "/v1/completions",
            {"model": "m", "prompt": "x", "stream": True, "stub": {"error_after": 2}},
        ),
        (
            "no-done",
            "/v1/completions",
            {"model": "m", "prompt": "x", "stream": True, "stub": {"no_done": True}},
        ),
        (
            "cut",
            "/v1/chat/completions",
            {"model": "m", "messages": chat, "stream": True, "stub": {"cut_after": 3}},
        ),
        (
            "long",
            "/v1/completions",
            {"model": "m", "prompt": "y" * 20000, "stream": True, "stub": {"tokens": 300}},
        ),
    ]


EXPECTED_END = {
    "chat-stream": ("finish", "stop", 8),
    "chat-usage": ("finish", "length", 5),
    "cmpl-continuous": ("finish", "stop", 8),
    "cmpl-plain": ("finish", "length", 3),
    "non-stream": ("finish", "length", 4),
    "chat-non-stream": ("finish", "stop", 8),
    "status-400": ("finish", "error", None),
    "error-event": ("finish", "error", 2),
    "no-done": ("finish", "stop", 8),
    "cut": ("finish", "cut", 3),
    "long": ("finish", "stop", 300),
}


def _fetch_all(port: int, tag: str) -> dict[str, tuple[int, dict[str, str], bytes]]:
    async def go() -> dict[str, tuple[int, dict[str, str], bytes]]:
        out = {}
        for name, path, body in _cases():
            raw = await raw_request(
                "127.0.0.1", port, http_post(path, json.dumps(body).encode(), rid=f"{tag}-{name}")
            )
            out[name] = split_response(raw)
        for path in ("/v1/models", "/health", "/nope"):
            raw = await raw_request(
                "127.0.0.1", port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
            )
            out[path] = split_response(raw)
        return out

    return asyncio.run(go())


def _ends(t: TapThread) -> dict[str, Any]:
    return t.sync(
        lambda: {ev.request_id: ev for _, ev in t.svc.mirror.recent if isinstance(ev, Finish | Cancel)}
    )


def _metric(t: TapThread, name: str, labels: dict[str, str] | None = None) -> float:
    return t.sync(lambda: t.svc.registry.get_sample_value(name, labels or {})) or 0.0


def _same(direct: tuple[int, dict[str, str], bytes], via: tuple[int, dict[str, str], bytes]) -> bool:
    """The same status, headers and body bytes; of a chunked body the same payload, ended alike:
    the tap writes a chunk per read of the upstream's body, so where a read ends inside one of the
    upstream's chunks (a loaded host) it sends that chunk's bytes as two (as HTTP allows)."""
    if direct[:2] != via[:2]:
        return False
    if direct[1].get("transfer-encoding") == "chunked":
        return dechunk(direct[2]) == dechunk(via[2])
    return direct[2] == via[2]


def _assert_identical(direct: dict[str, Any], via: dict[str, Any]) -> None:
    """Identical for every relayed path (chunked bodies: the same payload, see `_same`); /nope is off
    the allow-list, answered by the tap; the stream the upstream cut gets, after the identical bytes,
    one chunk with an SSE error event (and no terminating chunk, as direct)."""
    assert direct.keys() == via.keys()
    for k in direct:
        if k == "/nope":
            assert via[k][0] == 404 and b"not relayed" in via[k][2], via[k]
            continue
        if k == "cut":
            (status, headers, body), (v_status, v_headers, v_body) = direct[k], via[k]
            assert (status, headers) == (v_status, v_headers) and v_body.startswith(body), k
            size, _, rest = v_body[len(body):].partition(b"\r\n")
            assert rest.startswith(b"data: {\"error\": ") and len(rest) == int(size, 16) + 2, rest
            assert not body.endswith(b"0\r\n\r\n") and not v_body.endswith(b"0\r\n\r\n")
            continue
        assert _same(direct[k], via[k]), (k, direct[k], via[k])


RELAYS = pytest.mark.parametrize("relay", ["thread", "process"])


@RELAYS
def test_client_sees_identical_bytes_and_the_mirror_sees_every_end(relay: str) -> None:
    with (
        ThreadServer(create_stub("d0")) as up,
        TapThread(MirrorConfig({"d0": up.url}, scrape_interval_s=0, relay=relay)) as t,
    ):
        direct = _fetch_all(up.port, "direct")
        via = _fetch_all(_port(t.ready["taps"]["d0"]), "tap")
        _assert_identical(direct, via)
        assert via["chat-stream"][0] == 200 and b"data: [DONE]" in via["chat-stream"][2]
        assert via["status-400"][0] == 400 and via["/nope"][0] == 404
        assert t.wait_for(lambda: t.svc.state.live() == 0 and not len(t.svc.queue))
        ends = _ends(t)
        for name, (kind, reason, gen) in EXPECTED_END.items():
            ev = ends[request_hash(f"tap-{name}")]  # (the mirror knows a request by its id's hash)
            assert ev.kind == kind and ev.reason == reason, (name, ev)
            if gen is not None:
                assert ev.generated == gen, (name, ev)
        routes = t.sync(lambda: [ev for _, ev in t.svc.mirror.recent if isinstance(ev, Route)])
        assert {r.worker for r in routes} == {"d0"}
        cont = [r for r in routes if r.request_id == request_hash("tap-cmpl-continuous") and r.prompt_tokens]
        assert cont and cont[0].prompt_tokens == 20  # learnt from the first chunk's continuous usage
        assert t.sync(lambda: t.svc.mirror.errors) == {}
        assert _metric(t, "shadow_mirror_dropped_total", {"reason": "queue_full"}) == 0


def test_keep_alive_connection_reuse_and_pooled_upstreams() -> None:
    with (
        ThreadServer(create_stub("d0", tokens=4)) as up,
        TapThread(MirrorConfig({"d0": up.url}, scrape_interval_s=0)) as t,
    ):
        bodies = []
        with httpx.Client(base_url=t.ready["taps"]["d0"]) as c, httpx.Client(base_url=up.url) as d:
            for i in range(30):
                body = {"model": "m", "prompt": f"p{i}", "stream": i % 2 == 0, "max_tokens": 4}
                a, b = c.post("/v1/completions", json=body), d.post("/v1/completions", json=body)
                assert (a.status_code, a.content) == (b.status_code, b.content)
                bodies.append(a.content)
        assert t.wait_for(lambda: t.svc.state.live() == 0)
        assert t.sync(lambda: t.svc.state.workers["d0"].finished) == 30
        assert t.svc.taps[0].requests == 30


@RELAYS
def test_analysis_that_raises_or_is_saturated_never_changes_the_bytes(relay: str) -> None:
    def boom(ctx: TapContext, payload: bytes) -> None:
        raise RuntimeError("analysis bug")

    with ThreadServer(create_stub("d0")) as up:
        direct = _fetch_all(up.port, "direct")
        with TapThread(MirrorConfig({"d0": up.url}, scrape_interval_s=0, hook=boom, relay=relay)) as t:
            via = _fetch_all(_port(t.ready["taps"]["d0"]), "tap")
            _assert_identical(direct, via)
            assert t.wait_for(lambda: t.svc.state.live() == 0)
            assert _metric(t, "shadow_mirror_errors_total", {"stage": "analysis"}) > 10
            assert t.sync(lambda: t.svc.state.active()) == 0
        # a one-item hand-off (with a relay process: also an 8 KB socket buffer) and a slow consumer
        cfg = MirrorConfig({"d0": up.url}, scrape_interval_s=0, queue_size=1, pace_s=0.05, relay=relay)
        cfg.queue_bytes = 8192 if relay == "process" else cfg.queue_bytes
        with TapThread(cfg) as t:
            via = _fetch_all(_port(t.ready["taps"]["d0"]), "tap")
            _assert_identical(direct, via)
            assert t.settle(30)  # the relay's counters as of now (a relay process sends them with marks)
            assert _metric(t, "shadow_mirror_dropped_total", {"reason": "queue_full"}) > 10
            assert t.wait_for(lambda: t.svc.state.live() == 0, timeout=10)  # ends are never dropped
            assert _metric(t, "shadow_mirror_stream_gaps_total") > 0


@RELAYS
def test_one_thousand_random_client_disconnects_release_their_slots(relay: str) -> None:
    """Every disconnect ends its mirrored request through the tap's end marker (no reaping: the
    TTL is far away), with no phantoms. Waits on the analysis watermark, not on a clock; how fast
    a release happens is measured by bench/bench_tap_abuse.py, not asserted here."""
    stub = create_stub("d0", tokens=40, step_s=0.005)
    cfg = MirrorConfig({"d0": "http://placeholder"}, scrape_interval_s=0, tick_s=0.05, relay=relay)
    with ThreadServer(stub) as up:
        cfg.upstreams = {"d0": up.url}
        with TapThread(cfg) as t:
            port = _port(t.ready["taps"]["d0"])
            ended: set[str] = set()

            def on_event(ev: Any) -> None:
                if isinstance(ev, Cancel | Finish):
                    ended.add(ev.request_id)

            t.sync(t.svc.mirror.listeners.append, on_event)
            closed: set[str] = set()
            rng = random.Random(7)

            async def one(i: int, sem: asyncio.Semaphore) -> None:
                async with sem:
                    rid = f"dc-{i}"
                    body = json.dumps({"model": "m", "prompt": f"q{i}", "stream": True}).encode()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(http_post("/v1/completions", body, rid=rid, close=False))
                    mode = rng.random()
                    try:
                        if mode < 0.15:
                            pass  # gone before any response byte
                        elif mode < 0.3:
                            await reader.readuntil(b"\r\n\r\n")  # after the head
                        else:
                            want = rng.randint(1, 4000)
                            got = 0
                            while got < want:
                                chunk = await asyncio.wait_for(reader.read(want - got), 5)
                                if not chunk:
                                    break
                                got += len(chunk)
                    finally:
                        closed.add(request_hash(rid))  # (the mirror knows it by its id's hash)
                        if rng.random() < 0.5:
                            writer.transport.abort()
                        else:
                            writer.close()

            async def all_() -> None:
                sem = asyncio.Semaphore(64)
                await asyncio.gather(*(one(i, sem) for i in range(1000)))

            asyncio.run(all_())
            # the relay sees each disconnect and hands an end over; wait until the analysis has
            # consumed everything offered (watermark) and the mirrored state has no request left
            while not t.wait_for(lambda: t.svc.state.active() == 0, timeout=5.0):
                pass  # bounded by the test's timeout, not by a wall-clock guess
            missing = sorted(closed - ended)
            assert not missing, missing[:5]
            assert t.sync(lambda: t.svc.state.workers["d0"].reaped) == 0  # released by ends, not the TTL
            cancels = t.sync(lambda: t.svc.state.workers["d0"].cancelled)
            finished = t.sync(lambda: t.svc.state.workers["d0"].finished)
            assert cancels + finished == 1000 and cancels > 800
            assert t.sync(lambda: t.svc.state.live()) == 0
        deadline = time.monotonic() + 5
        while stub.state.stats.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stub.state.stats.running == 0  # the disconnects reached the worker too


def _pd_proxy(prefill: str, decodes: dict[str, str], n: int, seed: int) -> list[tuple[str, str, int, int]]:
    """A minimal NIXL-style P/D proxy (like vllm-router / the vllm-ascend proxy) over the taps."""
    rng = random.Random(seed)
    out = []
    with httpx.Client(timeout=30) as c:
        for _ in range(n):
            rid = uuid.uuid4().hex
            body = {
                "model": "m",
                "prompt": "w " * rng.randint(1, 200),
                "stream": True,
                "max_tokens": rng.randint(1, 12),
            }
            pre = dict(
                body,
                stream=False,
                max_tokens=1,
                min_tokens=1,
                kv_transfer_params={
                    "do_remote_decode": True,
                    "do_remote_prefill": False,
                    "remote_engine_id": None,
                    "remote_block_ids": None,
                    "remote_host": None,
                    "remote_port": None,
                },
            )
            r = c.post(prefill + "/v1/completions", json=pre, headers={"X-Request-Id": rid})
            r.raise_for_status()
            prompt = r.json()["usage"]["prompt_tokens"]
            name = rng.choice(sorted(decodes))
            dec = dict(body, kv_transfer_params=r.json()["kv_transfer_params"])
            with c.stream(
                "POST", decodes[name] + "/v1/completions", json=dec, headers={"X-Request-Id": rid}
            ) as s:
                raw = b"".join(s.iter_bytes())
            assert raw.endswith(b"data: [DONE]\n\n")
            out.append((rid, name, prompt, min(8, body["max_tokens"])))
    return out


def test_pd_legs_are_paired_and_every_decision_recovered() -> None:
    with (
        ThreadServer(create_stub("p0")) as p0,
        ThreadServer(create_stub("d0")) as d0,
        ThreadServer(create_stub("d1")) as d1,
    ):
        cfg = MirrorConfig({"d0": d0.url, "d1": d1.url}, prefill={"p0": p0.url}, scrape_interval_s=0.1)
        with TapThread(cfg) as t:
            taps = t.ready["taps"]
            truth = _pd_proxy(taps["p0"], {"d0": taps["d0"], "d1": taps["d1"]}, 60, seed=3)
            assert t.wait_for(lambda: t.svc.state.live() == 0 and not len(t.svc.queue))
            recent = t.sync(lambda: [ev for _, ev in t.svc.mirror.recent])
            routes = {ev.request_id: ev for ev in recent if isinstance(ev, Route)}
            arrives = {ev.request_id: ev for ev in recent if ev.kind == "arrive"}
            finishes = {ev.request_id: ev for ev in recent if isinstance(ev, Finish)}
            assert len(routes) == len(truth)  # one mirrored request per P/D pair, none for prefill legs
            for sent, worker, prompt, gen in truth:
                rid = request_hash(sent)  # the mirror knows a request by its id's hash
                assert routes[rid].worker == worker
                assert routes[rid].prompt_tokens == prompt  # from the paired prefill leg
                assert arrives[rid].prompt_tokens == prompt and arrives[rid].t <= routes[rid].t
                assert finishes[rid].generated == gen and finishes[rid].reason in ("stop", "length")
            per = {w: sum(1 for _, x, _, _ in truth if x == w) for w in ("d0", "d1")}
            st_ = httpx.get(t.ready["api"] + "/v1/state").json()
            assert {w: st_["workers"][w]["finished"] for w in per} == per
            assert "p0" not in st_["workers"] and st_["taps"]["p0"]["role"] == "prefill"
            assert _metric(t, "shadow_mirror_legs_total", {"worker": "p0", "leg": "prefill"}) == 60
            assert t.wait_for(lambda: t.svc.reconciler.workers["d0"].last_ok is not None)
            assert st_["phantoms"] == 0


def test_recorded_events_are_valid_ndjson(tmp_path: Any) -> None:

    rec = tmp_path / "events.ndjson"
    with ThreadServer(create_stub("d0", tokens=3)) as up:  # noqa: SIM117 - t needs up.url
        with TapThread(MirrorConfig({"d0": up.url}, record=str(rec), scrape_interval_s=0)) as t:
            with httpx.Client(base_url=t.ready["taps"]["d0"]) as c:
                for i in range(5):
                    c.post(
                        "/v1/completions",
                        json={"model": "m", "prompt": "secret prompt text", "stream": True},
                        headers={"X-Request-Id": f"r{i}"},
                    )
            assert t.wait_for(lambda: t.svc.state.live() == 0)
    lines = [json.loads(x) for x in rec.read_text().splitlines()]
    # compact recording (shadow.mirror.recording): a header, then one line per ended request
    assert lines[0]["type"] == "session" and lines[0]["workers"] == ["d0"]
    r0 = [x for x in lines if x.get("request_id") == request_hash("r0")]  # recorded by the id's hash
    assert len(r0) == 1 and r0[0]["type"] == "request" and r0[0]["worker"] == "d0"
    assert r0[0]["output_tokens"] == 3 and r0[0]["end"] in ("stop", "length")
    assert "secret" not in rec.read_text()


def test_inject_usage_gives_exact_counts_and_clients_see_what_they_asked_for() -> None:
    chat = [{"role": "user", "content": "hello there"}]
    bodies = {
        "plain": {"model": "m", "messages": chat, "stream": True},
        "usage": {"model": "m", "prompt": "abc", "stream": True, "stream_options": {"include_usage": True}},
        "cont": {
            "model": "m",
            "prompt": "abc",
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        "json": {"model": "m", "prompt": "abc", "max_tokens": 3},
    }
    with ThreadServer(create_stub("d0", tokens=6)) as up:
        cfg = MirrorConfig({"d0": up.url}, scrape_interval_s=0, inject_usage=True)
        with TapThread(cfg) as t, httpx.Client() as c:
            for name, body in bodies.items():
                direct = c.post(
                    up.url + "/v1/completions" if "prompt" in body else up.url + "/v1/chat/completions",
                    json=body,
                )
                path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
                via = c.post(t.ready["taps"]["d0"] + path, json=body, headers={"X-Request-Id": f"inj-{name}"})

                # the stub derives response ids from the request bytes, which injection changes
                def norm(b: bytes) -> bytes:
                    return re.sub(rb'"id":"[^"]*"', b'"id":""', b)

                assert (via.status_code, norm(via.content)) == (direct.status_code, norm(direct.content)), (
                    name
                )
            assert t.wait_for(lambda: t.svc.state.live() == 0)
            recent = t.sync(lambda: [ev for _, ev in t.svc.mirror.recent])
            plain = request_hash("inj-plain")
            plain_routes = [ev for ev in recent if isinstance(ev, Route) and ev.request_id == plain]
            assert plain_routes[-1].prompt_tokens is not None  # learnt from injected continuous usage
            fin = next(ev for ev in recent if isinstance(ev, Finish) and ev.request_id == plain)
            assert fin.generated == 6 and fin.reason == "stop"


def test_relay_process_serves_the_taps_and_the_analysis_thread_yields_to_it() -> None:
    """relay="process": the taps' listeners are served by a tap group of their own (not this
    process), the analysis thread here runs at the configured lower priority, and stopping the
    service stops the group it started (`stop_taps`, the default when embedded)."""
    with ThreadServer(create_stub("d0", tokens=5)) as up:
        cfg = MirrorConfig({"d0": up.url}, scrape_interval_s=0, relay="process", analysis_nice=7)
        with TapThread(cfg) as t:
            group = t.svc.link.group
            assert group is not None and group.proc is not None and group.proc.pid != os.getpid()
            (att,) = t.svc.link.attachments
            assert att.attached and att.relay["pid"] not in (os.getpid(), group.proc.pid)
            tid = t.svc.analysis.thread.native_id
            # 7 below the process (capped at 19: a suite run under `nice` starts nearer the floor)
            assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
            raw = asyncio.run(
                raw_request(
                    "127.0.0.1",
                    _port(t.ready["taps"]["d0"]),
                    http_post(
                        "/v1/completions", json.dumps({"model": "m", "prompt": "p", "stream": True}).encode()
                    ),
                )
            )
            assert raw.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in raw
            assert t.wait_for(lambda: t.svc.state.workers["d0"].finished == 1)
            assert t.svc.taps[0].requests == 1  # the relay's counters, as of the sync settle() sent
        assert group.proc.poll() == 0  # stopped (drained) with the service
