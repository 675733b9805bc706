"""The fleet's HTTP servers (raw ASGI): a prefill server, a decode rank, and the optional port
serving all decode ranks. Each serves vLLM's OpenAI endpoints, `/health`, `/v1/models`,
`/metrics` (own registry), `/load`, `/version`, plus `/fleet/faults` (GET/POST) and `/fleet/state`.

Generation path: bounded body read (413) → HTTP fault (4xx/5xx) → validation (400/404) →
KV-handle claim for decode legs (400) → submit to the engine → SSE stream or JSON → the request's
`llm_request` span when the fleet traces (`spans`, see `tracing`). A client disconnect aborts the
request; a crash drops connections without a clean end.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from shadow.base.appserver import AppServer
from shadow.base.security import admin_denied
from shadow.fleet.asgi import (
    BodyTooLarge,
    ClientGone,
    Headers,
    Receive,
    Scope,
    Send,
    StreamCut,
    header,
    read_body,
    send_bytes,
    send_json,
    watch_disconnect,
)
from shadow.fleet.clock import StepClock
from shadow.fleet.config import VLLM_VERSION, FleetConfig
from shadow.fleet.engine import DecodeEngine, EngineDown, Seq
from shadow.fleet.faults import FaultState, StreamFaults, Target, validate_settings
from shadow.fleet.metrics import MetricsSource, StepCollector, VllmCollector, exposition, make_registry
from shadow.fleet.openai_api import ApiError, GenRequest, parse_request
from shadow.fleet.pd import HandleError, KvDirectory, KvStore
from shadow.fleet.prefill import PrefillEngine
from shadow.fleet.sse import DONE, SSE_CONTENT_TYPE, StreamFormat, full_response, stream_error_event
from shadow.fleet.tracing import RequestSpans

METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
GENERATE_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}

# Applies fault settings to a target of the fleet; returns the names of the servers it touched.
ApplyFaults = Callable[[Target, dict[str, float | int | bool]], Awaitable[list[str]]]


class _Emitter:
    """Sends SSE events, applying cut/error stream faults by the count of events sent."""

    def __init__(self, send: Send, faults: StreamFaults) -> None:
        self._send = send
        self._faults = faults
        self.sent = 0

    async def emit(self, events: Sequence[bytes], *, final: bool = False) -> bool:
        """Send `events`; False when an injected error ended the stream (caller stops)."""
        f = self._faults
        out = list(events)
        ended = False
        if f.cut_after or f.error_after:
            out = []
            for ev in events:
                if f.cut_after and self.sent >= f.cut_after:
                    if out:
                        await self._send(
                            {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                        )
                    raise StreamCut
                if f.error_after and self.sent >= f.error_after:
                    out.append(stream_error_event("Simulated fault: engine error mid-stream"))
                    out.append(DONE)
                    ended = True
                    break
                out.append(ev)
                self.sent += 1
        else:
            self.sent += len(out)
        last = final or ended
        await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": not last})
        return not ended


Abort = Callable[[str], None]  # ends a request in its engine, with the reason


def _identity(req: GenRequest, rid: str) -> dict[str, Any]:
    """What names a response, streamed or not: its API (chat or not), id, time, model, prompt size."""
    return {"chat": req.chat, "rid": rid, "created": int(time.time()), "model": req.model,
            "prompt_tokens": req.prompt_tokens}


class _Client:
    """The client of one generation, watched: `gone` once it disconnected (the request is then
    aborted); `release()` stops watching and aborts the request if it has not finished."""

    def __init__(self, receive: Receive, seq: Seq, abort: Abort) -> None:
        self.gone = False
        self._seq = seq
        self._abort = abort
        self._watcher = asyncio.create_task(watch_disconnect(receive, self._disconnected))

    def _disconnected(self) -> None:
        self.gone = True
        self._abort("abort")

    def release(self) -> None:
        self._watcher.cancel()
        if not self._seq.finished:
            self._abort("abort")


class BaseServer:
    """Routing, side endpoints and the generation path common to every server of the fleet."""

    role = "server"

    def __init__(
        self, index: int, config: FleetConfig, port: int, directory: KvDirectory, apply_faults: ApplyFaults
    ) -> None:
        self.index = index
        self.config = config
        self.directory = directory
        self._apply_faults = apply_faults
        self.faults = FaultState()
        self.listener = AppServer(self, config.host, port, lifespan="off", keep_alive_s=5.0)
        self.created = int(time.time())
        self.up = True
        self.spans: RequestSpans | None = None  # vLLM's request spans (None: the fleet does not trace)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.registry = make_registry(
            VllmCollector(config.model, self.metric_sources, config.block_size, config.kv_capacity_tokens),
            StepCollector(self.step_clock, self.metric_sources, lambda s: getattr(s, "load", 0)),
        )

    # -- identity --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"{self.role}/{self.index}"

    @property
    def url(self) -> str:
        return self.listener.url

    # -- to override -----------------------------------------------------------------------------
    def metric_sources(self) -> list[MetricsSource]:
        raise NotImplementedError

    def admit(self, req: GenRequest, scope: Scope, rid: str, now: float) -> tuple[Seq, Callable[[str], None]]:
        """Create and submit the request's Seq; return it and an abort(reason) function."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def step_clock(self) -> StepClock | None:
        """The decode clock whose ground truth this server's /metrics shows (None: none)."""
        return None

    def poke(self) -> None:
        """Re-evaluate stalls after a fault change."""

    def reset_engines(self, now: float) -> None:
        """Crash: drop all requests and state."""

    def restart_engines(self) -> None:
        """Recover: empty engines accept requests again."""

    # -- lifecycle -------------------------------------------------------------------------------
    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def crash(self, duration_s: float | None = None) -> None:
        """Stop listening and drop everything; recover after `duration_s` if it is > 0."""
        if not self.up:
            return
        self.up = False
        await self.listener.crash()
        self.reset_engines(asyncio.get_running_loop().time())
        if duration_s is not None and duration_s > 0:
            self.spawn(self._recover_later(duration_s))

    async def _recover_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.recover()

    async def recover(self) -> None:
        if self.up:
            return
        self.restart_engines()
        await self.listener.start()
        self.up = True

    async def apply(self, settings: dict[str, float | int | bool]) -> None:
        """Apply validated fault settings to this server (crash is scheduled, not awaited)."""
        if settings.get("recover"):
            await self.recover()
        self.faults.apply(settings, asyncio.get_running_loop().time())
        self.poke()
        if "crash_s" in settings:
            self.spawn(self.crash(float(settings["crash_s"])))

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self.up:
            await self.listener.stop(grace_s=1.0)

    # -- ASGI ------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        chat = GENERATE_PATHS.get(path)
        if chat is not None:
            if method != "POST":
                await send_json(send, 405, {"detail": "Method Not Allowed"})
                return
            await self._generate(scope, receive, send, chat)
            return
        if path == "/fleet/faults" and method == "POST":
            await self._post_faults(scope, receive, send)
            return
        getter = {
            "/health": self._health,
            "/v1/models": self._models,
            "/metrics": self._metrics,
            "/load": self._load,
            "/get_load": self._load,
            "/version": self._version,
            "/fleet/faults": self._get_faults,
            "/fleet/state": self._state,
        }.get(path)
        if getter is None:
            await send_json(send, 404, {"detail": "Not Found"})
        elif method not in ("GET", "HEAD"):
            await send_json(send, 405, {"detail": "Method Not Allowed"})
        else:
            await getter(send)

    # -- side endpoints --------------------------------------------------------------------------
    async def _health(self, send: Send) -> None:
        await send_bytes(send, 200, b"", None)

    async def _models(self, send: Send) -> None:
        m = self.config.model
        card = {
            "id": m,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": m,
            "parent": None,
            "max_model_len": self.config.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        await send_json(send, 200, {"object": "list", "data": [card]})

    async def _metrics(self, send: Send) -> None:
        await send_bytes(send, 200, exposition(self.registry), METRICS_CONTENT_TYPE)

    async def _load(self, send: Send) -> None:
        load = sum(s.num_running() + s.num_waiting() for s in self.metric_sources())
        await send_json(send, 200, {"server_load": load})

    async def _version(self, send: Send) -> None:
        await send_json(send, 200, {"version": VLLM_VERSION})

    async def _get_faults(self, send: Send) -> None:
        now = asyncio.get_running_loop().time()
        await send_json(send, 200, {"server": self.name, "up": self.up, "faults": self.faults.to_json(now)})

    async def _state(self, send: Send) -> None:
        await send_json(send, 200, {"server": self.name, "up": self.up, **self.state()})

    async def _post_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        denied = self._control_denied(scope)
        if denied is not None:
            status, message = denied
            await send_json(send, status, ApiError(status, message).body())
            return
        try:
            raw = await read_body(receive, 1 << 20)
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("fault settings must be a JSON object")
            target_text = body.pop("target", None)
            target = Target.parse(target_text) if target_text is not None else Target(self.role, self.index)
            settings = validate_settings(body)
        except (BodyTooLarge, ClientGone):
            return
        except (ValueError, TypeError) as exc:
            await send_json(send, 400, ApiError(400, f"invalid fault request: {exc}").body())
            return
        applied = await self._apply_faults(target, settings)
        if not applied:
            await send_json(send, 404, ApiError(404, f"no fleet server matches target {target}").body())
            return
        await send_json(send, 200, {"applied": applied, "settings": settings})

    def _control_denied(self, scope: Scope) -> tuple[int, str] | None:
        """Fault injection is an admin action: a bearer token, or loopback-only without one."""
        cfg = self.config
        return admin_denied(cfg.host, cfg.control_token, header(scope, b"authorization"), "fault injection")

    # -- generation ------------------------------------------------------------------------------
    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        cfg = self.config
        base = header(scope, b"x-request-id") or uuid.uuid4().hex
        hdrs: Headers = [(b"x-request-id", base.encode("latin-1", "replace"))]
        try:
            raw = await read_body(receive, cfg.max_body_bytes)
        except ClientGone:
            return
        except BodyTooLarge:
            err = ApiError(413, f"Request body too large: the limit is {cfg.max_body_bytes} bytes")
            await send_json(send, 413, err.body(), hdrs)
            return
        status = self.faults.take_http_error()
        if status:
            err = ApiError(status, f"Simulated fault: HTTP {status} from {self.name}")
            await send_json(send, status, err.body(), hdrs)
            return
        now = asyncio.get_running_loop().time()
        spans = self.spans
        arrival = spans.arrived(scope) if spans is not None else None
        rid = ("chatcmpl-" if chat else "cmpl-") + base
        try:
            req = parse_request(raw, chat=chat, config=cfg)
            seq, abort = self.admit(req, scope, rid, now)
        except ApiError as exc:
            await send_json(send, exc.status, exc.body(), hdrs)
            return
        try:
            if req.stream:
                await self._stream(send, receive, seq, req, rid, abort, self.faults.stream, hdrs)
            else:
                await self._respond(send, receive, seq, req, rid, abort, hdrs)
        finally:
            if spans is not None and arrival is not None:
                spans.finished(arrival, req, seq, rid)

    async def _respond(
        self, send: Send, receive: Receive, seq: Seq, req: GenRequest, rid: str, abort: Abort, hdrs: Headers
    ) -> None:
        seq.wake_each_token = False
        client = _Client(receive, seq, abort)
        try:
            while not seq.finished:
                await seq.wait_beyond(seq.generated)
        finally:
            client.release()
        if client.gone or not self.up:
            return
        if seq.finish_reason == "error":
            await send_json(send, 500, ApiError(500, "Internal server error").body(), hdrs)
            return
        body = full_response(
            **_identity(req, rid),
            completion_tokens=seq.generated,
            finish=seq.finish_reason or "abort",
            kv_params=seq.kv_params,
        )
        await send_json(send, 200, body, hdrs)

    async def _stream(
        self,
        send: Send,
        receive: Receive,
        seq: Seq,
        req: GenRequest,
        rid: str,
        abort: Abort,
        faults: StreamFaults,
        hdrs: Headers,
    ) -> None:
        fmt = StreamFormat(
            **_identity(req, rid),
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
        )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", SSE_CONTENT_TYPE), *hdrs],
            }
        )
        client = _Client(receive, seq, abort)
        out = _Emitter(send, faults)
        drop, dup = faults.drop_every, faults.dup_every
        try:
            seen = 0
            role_pending = req.chat
            while True:
                await seq.wait_beyond(seen)
                if client.gone or not self.up:
                    return
                gen, done, reason = seq.generated, seq.finished, seq.finish_reason
                natural = done and reason in ("stop", "length")
                events: list[bytes] = []
                if role_pending:
                    events.append(fmt.role_chunk())
                    role_pending = False
                for k in range(seen + 1, gen + 1):
                    if natural and k == gen:
                        chunk = fmt.token_chunk(k, reason, seq.kv_params)
                    else:
                        chunk = fmt.token_chunk(k)
                    if drop and k % drop == 0:
                        continue
                    events.append(chunk)
                    if dup and k % dup == 0:
                        events.append(chunk)
                seen = gen
                if done and not natural:
                    if reason == "error":
                        events += [stream_error_event("Internal server error"), DONE]
                        await out.emit(events, final=True)
                        return
                    events.append(fmt.finish_only_chunk(reason or "abort", gen, seq.kv_params))
                if done:
                    if req.include_usage:
                        events.append(fmt.usage_chunk(gen))
                    events.append(DONE)
                    await out.emit(events, final=True)
                    return
                if events and not await out.emit(events):
                    abort("error")
                    return
        finally:
            client.release()

    # -- shared helpers --------------------------------------------------------------------------
    def submit_local(
        self, engine: DecodeEngine, req: GenRequest, rid: str, now: float
    ) -> tuple[Seq, Callable[[str], None]]:
        """Queue `req` on a decode engine, claiming the prefill's KV first for a decode leg."""
        if not engine.up:
            raise ApiError(503, f"{self.name}: engine {engine.engine_label} is down")
        source, on_release = "local_compute", None
        if req.remote_prefill:
            assert req.kv_params is not None
            try:
                store, hold = self.directory.claim(req.kv_params, now)
            except HandleError as exc:
                raise ApiError(400, str(exc), "kv_transfer_params") from None
            source = "external_kv_transfer"

            def on_release() -> None:
                store.release(hold)

        seq = Seq(
            rid,
            req.prompt_tokens,
            req.target,
            req.natural_finish,
            req.max_tokens,
            now,
            source=source,
            on_release=on_release,
        )
        try:
            engine.submit(seq)
        except EngineDown:
            seq.release()
            raise ApiError(503, f"{self.name}: engine {engine.engine_label} is down") from None
        loop = asyncio.get_running_loop()

        def abort(reason: str) -> None:
            engine.abort(seq, loop.time(), reason)

        return seq, abort


def engine_state(e: DecodeEngine) -> dict[str, Any]:
    return {
        "engine": e.engine_label,
        "up": e.up,
        "running": e.num_running(),
        "waiting": e.num_waiting(),
        "load_tokens": e.load,
        "kv_usage": e.kv_usage(),
    }


class DecodeServer(BaseServer):
    """Decode rank g: one engine of the shared step clock."""

    role = "decode"

    def __init__(
        self,
        index: int,
        config: FleetConfig,
        port: int,
        directory: KvDirectory,
        apply_faults: ApplyFaults,
        on_work: Callable[[], None],
    ) -> None:
        super().__init__(index, config, port, directory, apply_faults)
        self.engine = DecodeEngine.sized(str(index), config, self.faults, on_work)
        self._on_work = on_work
        self.clock: StepClock | None = None

    def metric_sources(self) -> list[MetricsSource]:
        return [self.engine]

    def step_clock(self) -> StepClock | None:
        return self.clock

    def admit(self, req: GenRequest, scope: Scope, rid: str, now: float) -> tuple[Seq, Callable[[str], None]]:
        return self.submit_local(self.engine, req, rid, now)

    def poke(self) -> None:
        self._on_work()

    def reset_engines(self, now: float) -> None:
        self.engine.up = False
        self.engine.reset(now)
        self._on_work()

    def restart_engines(self) -> None:
        self.engine.up = True

    def state(self) -> dict[str, Any]:
        clock = self.clock
        return {
            "engines": [engine_state(self.engine)],
            "clock": None
            if clock is None
            else {
                "steps": clock.steps,
                "last_step_s": clock.last_step_s,
                "last_max_load": clock.last_max_load,
                "model_s": clock.model_s,
                "wall_s": clock.wall_s,
                "behind_dropped_s": clock.behind_dropped_s,
                "behind_max_s": clock.behind_max_s,
                "busy_slot_steps": clock.busy_slot_steps,
                "slot_steps": clock.slot_steps,
            },
        }


class DpFrontServer(BaseServer):
    """One port for all decode ranks: `X-data-parallel-rank` picks the rank, else the least loaded."""

    role = "dp"

    def __init__(
        self,
        config: FleetConfig,
        port: int,
        directory: KvDirectory,
        apply_faults: ApplyFaults,
        ranks: Sequence[DecodeServer],
    ) -> None:
        super().__init__(0, config, port, directory, apply_faults)
        self.ranks = list(ranks)

    def metric_sources(self) -> list[MetricsSource]:
        return [r.engine for r in self.ranks if r.engine.up]

    def step_clock(self) -> StepClock | None:
        return self.ranks[0].clock if self.ranks else None

    def admit(self, req: GenRequest, scope: Scope, rid: str, now: float) -> tuple[Seq, Callable[[str], None]]:
        text = header(scope, b"x-data-parallel-rank")
        if text is not None:
            try:
                rank = int(text)
            except ValueError:
                raise ApiError(400, f"invalid X-data-parallel-rank {text!r}") from None
            if not 0 <= rank < len(self.ranks):
                raise ApiError(400, f"data_parallel_rank {rank} is out of range [0, {len(self.ranks)})")
            engine = self.ranks[rank].engine
        else:
            live = [r.engine for r in self.ranks if r.engine.up] or [self.ranks[0].engine]
            engine = min(live, key=lambda e: e.num_running() + e.num_waiting())
        return self.submit_local(engine, req, rid, now)

    def state(self) -> dict[str, Any]:
        return {"engines": [engine_state(r.engine) for r in self.ranks]}


class PrefillServer(BaseServer):
    """Prefill server i: FCFS P/D prefills issuing KV handles; other requests served locally."""

    role = "prefill"

    def __init__(
        self, index: int, config: FleetConfig, port: int, directory: KvDirectory, apply_faults: ApplyFaults
    ) -> None:
        super().__init__(index, config, port, directory, apply_faults)
        self.kv = KvStore(
            self._new_engine_id(), config.host, port, ttl_s=config.kv_ttl_s, block_size=config.block_size
        )
        self.engine = PrefillEngine(config, self.faults, self.kv)

    def _new_engine_id(self) -> str:
        return f"prefill-{self.index}-{uuid.uuid4().hex[:12]}"

    def register(self) -> None:
        """Publish the KV store (call once the port is known)."""
        self.kv.port = self.listener.port
        self.directory.register(self.kv)

    def metric_sources(self) -> list[MetricsSource]:
        return [self.engine]

    def admit(self, req: GenRequest, scope: Scope, rid: str, now: float) -> tuple[Seq, Callable[[str], None]]:
        if not req.remote_decode:
            return self.submit_local(self.engine.local, req, rid, now)
        self._release_aborted(req.kv_params)
        if not self.engine.up:
            raise ApiError(503, f"{self.name} is down")
        seq = Seq(rid, req.prompt_tokens, 1, "length", req.max_tokens, now)
        self.engine.submit_prefill(seq)
        loop = asyncio.get_running_loop()

        def abort(reason: str) -> None:
            self.engine.abort(seq, loop.time())

        return seq, abort

    def _release_aborted(self, kv: dict[str, Any] | None) -> None:
        """Free KV a proxy gave up on (`aborted_request`: handle ids, as vllm-ascend's proxy sends)."""
        aborted = (kv or {}).get("aborted_request")
        if isinstance(aborted, list):
            for key in aborted[:4096]:
                hold = self.kv.holds.get(key) if isinstance(key, str) else None
                if hold is not None and not hold.claimed:
                    self.kv.release(hold)
                    self.kv.aborted += 1

    def poke(self) -> None:
        self.engine.poke()

    def reset_engines(self, now: float) -> None:
        self.engine.up = False
        self.kv.up = False
        self.engine.local.up = False
        self.engine.reset(now)
        self.engine.poke()

    def restart_engines(self) -> None:
        self.directory.unregister(self.kv.engine_id)
        self.kv.engine_id = self._new_engine_id()  # a restarted engine has a new identity
        self.kv.up = True
        self.directory.register(self.kv)
        self.engine.up = True
        self.engine.local.up = True

    def state(self) -> dict[str, Any]:
        e = self.engine
        return {
            "engines": [engine_state(e.local)],
            "prefill_queue": len(e.queue),
            "prefilling": e.current is not None,
            "kv_engine_id": self.kv.engine_id,
            "kv_holds": len(self.kv.holds),
            "kv_held_tokens": self.kv.held_tokens(),
            "kv_expired": self.kv.expired,
            "kv_aborted": self.kv.aborted,
        }
