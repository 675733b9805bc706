"""Normalised fleet events: what the mirror produces, what the engine consumes, what `--record` writes.

One event per fact, plain and immutable. `t` is seconds on the producer's clock (monotonic for
live feeds, trace-relative for replays). Request ids are opaque strings (never prompt text);
`worker` is a worker name as configured (e.g. "d0"), mapped to an index by whoever holds the
worker list. `to_dict`/`from_dict` give the NDJSON form published as a JSON Schema.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from importlib import resources
from typing import Any, ClassVar, Literal

#: The most tokens one request can claim (prompt, generated or max_tokens): the longest request any
#: worker could hold. The live mirror drops an event beyond it, a trace or recording loader rejects
#: the row: a step-by-step simulation runs a request for as many steps as its tokens.
MAX_REQUEST_TOKENS = 1 << 21
#: The fields of an event that count tokens (each bounded by MAX_REQUEST_TOKENS).
TOKEN_FIELDS = ("prompt_tokens", "generated", "max_tokens", "tokens")

#: The most step ends one Token carries (`Token.step_ends`; a node passes a Token on when it has them).
MAX_STEP_ENDS = 1024

FinishReason = Literal["stop", "length", "abort", "error", "cut", "reaped", "other"]


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """What every event of one request has: its id and its time."""

    request_id: str
    t: float


@dataclass(frozen=True, slots=True)
class Arrive(RequestEvent):
    """A request reached the router (before any decode placement). `body_bytes`: the size in bytes
    of its request body as the tap saw it (never the body itself; absent from older recordings and
    producers that do not see the body): what the vllm-ascend proxy's JSQ rule scores."""

    kind: ClassVar[str] = "arrive"
    prompt_tokens: int | None = None
    prompt_key: str | None = None
    max_tokens: int | None = None
    body_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Route(RequestEvent):
    """The router placed the request's decode on `worker`."""

    kind: ClassVar[str] = "route"
    worker: str
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Token(RequestEvent):
    """The request's stream advanced to `generated` output tokens in total (cumulative).

    `step_ends`: set only by a node that holds its Tokens (`--token-interval`): the chunks of this
    stream since its previous Token that ended a decode step of its worker as that worker's streams
    show it (`shadow.engine.stepends`), flat as (t, per-token gap in seconds) pairs, at most
    `MAX_STEP_ENDS` of them. A held Token's own gap is a mean over its interval, so a centre takes a
    worker's step ends from these."""

    kind: ClassVar[str] = "token"
    generated: int
    step_ends: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Finish(RequestEvent):
    """The request ended on its worker (normally, or by error / cut / reaping)."""

    kind: ClassVar[str] = "finish"
    reason: FinishReason = "stop"
    generated: int | None = None


@dataclass(frozen=True, slots=True)
class Cancel(RequestEvent):
    """The client went away before the request finished."""

    kind: ClassVar[str] = "cancel"


@dataclass(frozen=True, slots=True)
class Step:
    """A measured decode step: `duration_s` long, ending at `t` (on `worker`, if per worker); an
    engine probe adds its engine index, the scheduler's counts after the step, the tokens it
    generated, the time since that engine's previous busy step, and which clock `duration_s` is.

    What the engine scheduled into the step (probes since the step-cost model; absent from older
    ones): `prefill_tokens` prompt tokens computed in it (chunks of a chunked prefill included; with
    `source` "probe_interval", i.e. without the engine's iteration details, the computed prompt
    tokens of the prefills that completed in it), `prefill_requests` the requests they belong to,
    `decode_requests` the running requests that decoded in it, `iteration` the engine's step index
    (consecutive: a gap is steps the probe did not see), `dummy` a DP rank's padding step (no
    request of its own, run to keep its group's collectives in lockstep), `engine_interval_s` the
    time since the previous step on the engine's own clock (absent when no request decoded in
    both: after idle or a prefill-only step), `engine_run_s`/`engine_wait_s` the seconds the main
    thread of the process that runs the engine's forward pass (its worker where it has one) had run
    on a CPU / waited, runnable, for one since it started (Linux schedstat, read at the step's
    record time; their difference between two steps is the host's share of that span: what the
    engine waited for a CPU)."""

    kind: ClassVar[str] = "step"
    t: float
    duration_s: float
    worker: str | None = None
    engine: int | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    tokens: int | None = None
    preemptions: int | None = None
    interval_s: float | None = None
    source: str | None = None
    prefill_tokens: int | None = None
    prefill_requests: int | None = None
    decode_requests: int | None = None
    iteration: int | None = None
    dummy: bool | None = None
    engine_interval_s: float | None = None
    engine_run_s: float | None = None
    engine_wait_s: float | None = None


Event = Arrive | Route | Token | Finish | Cancel | Step

EVENT_TYPES: dict[str, type[Event]] = {cls.kind: cls for cls in (Arrive, Route, Token, Finish, Cancel, Step)}
#: each kind's field names (what `from_dict` accepts besides "type")
EVENT_FIELDS: dict[str, frozenset[str]] = {
    kind: frozenset(f.name for f in fields(cls)) for kind, cls in EVENT_TYPES.items()}


def load_schema() -> dict[str, Any]:
    """The published JSON Schema of one event line (`events.schema.json` beside this module)."""
    text = resources.files("shadow.contracts").joinpath("events.schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def to_dict(event: Event) -> dict[str, Any]:
    """The NDJSON form: {"type": kind, ...fields}, with None fields left out."""
    out: dict[str, Any] = {"type": event.kind}
    out.update({k: v for k, v in asdict(event).items() if v is not None})
    return out


def from_dict(data: dict[str, Any]) -> Event:
    """Parse and validate one NDJSON object; raises ValueError with a one-line reason."""
    if not isinstance(data, dict):
        raise ValueError("event must be a JSON object")
    kind = data.get("type")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown event type {kind!r}")
    known = EVENT_FIELDS[cls.kind]
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name in known:
            if value is not None:
                kwargs[name] = value
        elif name != "type":
            extra = sorted(set(data) - known - {"type"})
            raise ValueError(f"{kind}: unknown field(s) {extra}")
    ends = kwargs.get("step_ends")
    if isinstance(ends, list):  # (JSON's array; the event keeps a tuple: events are immutable)
        kwargs["step_ends"] = tuple(ends)
    try:
        event = cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{kind}: missing field ({exc})") from None
    _validate(event)
    return event


def _validate(event: Event) -> None:
    t = event.t
    if isinstance(t, bool) or not isinstance(t, int | float) or t != t or t in (float("inf"), float("-inf")):
        raise ValueError(f"{event.kind}: t must be a finite number")
    rid = getattr(event, "request_id", None)
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 256):
        raise ValueError(f"{event.kind}: request_id must be a non-empty string of at most 256 characters")
    for name in ("prompt_tokens", "max_tokens", "generated", "body_bytes"):
        value = getattr(event, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{event.kind}: {name} must be an integer >= 0")
    if isinstance(event, Route) and (not isinstance(event.worker, str) or not event.worker):
        raise ValueError("route: worker must be a non-empty string")
    if isinstance(event, Step):
        _validate_step(event)
    if isinstance(event, Token) and event.step_ends is not None:
        _validate_step_ends(event.step_ends)
    if isinstance(event, Finish) and event.reason not in (
        "stop",
        "length",
        "abort",
        "error",
        "cut",
        "reaped",
        "other",
    ):
        raise ValueError(f"finish: unknown reason {event.reason!r}")


def _validate_step_ends(ends: object) -> None:
    if not isinstance(ends, tuple) or len(ends) % 2 or not 0 < len(ends) <= 2 * MAX_STEP_ENDS:
        raise ValueError(f"token: step_ends must be 1 to {MAX_STEP_ENDS} (t, gap) pairs, flat")
    for i, x in enumerate(ends):
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise ValueError("token: step_ends must be finite numbers")
        if i % 2 and not 0 < x < 3600:
            raise ValueError("token: a step end's gap must be in (0, 3600) s")


def _validate_step(event: Step) -> None:
    for name in ("duration_s", "interval_s", "engine_interval_s"):
        d = getattr(event, name)
        if d is None and name != "duration_s":
            continue
        if isinstance(d, bool) or not isinstance(d, int | float) or not (0 <= d < 3600):
            raise ValueError(f"step: {name} must be a number in [0, 3600)")
    for name in ("engine", "running", "waiting", "tokens", "preemptions", "prefill_tokens",
                 "prefill_requests", "decode_requests", "iteration"):
        value = getattr(event, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"step: {name} must be an integer >= 0")
    for name in ("engine_run_s", "engine_wait_s"):
        x = getattr(event, name)
        if x is not None and (isinstance(x, bool) or not isinstance(x, int | float)
                              or not 0 <= x < float("inf")):
            raise ValueError(f"step: {name} must be a finite number >= 0")
    kv = event.kv_usage
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int | float) or not (0 <= kv <= 1)):
        raise ValueError("step: kv_usage must be a number in [0, 1]")
    if event.source is not None and (not isinstance(event.source, str) or not event.source):
        raise ValueError("step: source must be a non-empty string")
    if event.dummy is not None and not isinstance(event.dummy, bool):
        raise ValueError("step: dummy must be a boolean")
