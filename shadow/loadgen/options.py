"""Knobs of a load run (everything except the trace and the target).

Each setting of `shadow load` that is a field here is declared once (`shadow.base.knobs`): its
flag, type, default, help and bound; the command derives its flags from them, and a value out of
its bound is a ValueError naming the flag."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shadow.base.knobs import AT_LEAST_ONE, POSITIVE, Bound, check_knobs, knob
from shadow.loadgen.prompts import PromptBuilder

#: A request's timeout: any number of seconds above 0, inf included (no timeout).
TIMEOUT = Bound(lambda v: v > 0, "> 0 s")


@dataclass(frozen=True)
class LoadOptions:
    """How to replay a trace against an OpenAI-compatible endpoint.

    - ``model``: model name to send; ``None`` means the first id listed by ``GET /v1/models``.
    - ``chat``: use ``/v1/chat/completions`` (one user message) instead of ``/v1/completions``.
    - ``stream``: streaming responses (with ``stream_options.include_usage``), else one body.
    - ``concurrency``: at most this many requests in flight; requests due beyond it wait in
      arrival order. ``None`` means no cap.
    - ``time_scale``: arrival offsets are divided by it (2.0 = twice the trace's rate).
    - ``limit``: replay only the first N requests (by arrival).
    - ``headers``: extra HTTP headers on every request.
    - ``request_id_prefix``: when set, request i carries ``X-Request-Id: <prefix><i>``.
    - ``ignore_eos``: send vLLM's ``ignore_eos`` so each output is exactly ``max_tokens`` long.
    - ``request_timeout_s``: per-request timeout (the whole stream).
    - ``prompt_builder``: how prompt text is made (default: words, seed 0).
    """

    model: str | None = knob(None, "--model", "model name to send (none: the first id from GET /v1/models)")
    api_key: str = knob("EMPTY", "--api-key", "API key sent as a bearer token")
    chat: bool = knob(False, "--chat", "use /v1/chat/completions (one user message) instead of "
                      "/v1/completions")
    stream: bool = True  # `shadow load --stream/--no-stream` (a switch on by default: not a knob)
    concurrency: int | None = knob(None, "--concurrency", "at most C requests in flight; later arrivals "
                                   "wait in order (none: no cap)", AT_LEAST_ONE, type=int, metavar="C")
    # `shadow load`: --time-scale, or --rate-scale (the same), or --rate (then the trace's rate
    # decides); --time-scale is None when not given
    time_scale: float = knob(1.0, "--time-scale", "divide arrival times by X (2 = twice as fast)", POSITIVE,
                             metavar="X", unset_is_none=True)
    limit: int | None = knob(None, "--limit", "replay only the first N requests", AT_LEAST_ONE, type=int,
                             metavar="N")
    headers: Mapping[str, str] = field(default_factory=dict)  # `shadow load --header K=V`, repeatable
    request_id_prefix: str | None = knob(None, "--request-id-prefix",
                                         "send X-Request-Id: P<index> with each request", metavar="P")
    ignore_eos: bool = True  # `shadow load --no-ignore-eos` turns it off (not a knob: the flag negates)
    request_timeout_s: float = knob(600.0, "--timeout", "per-request timeout in seconds", TIMEOUT,
                                    metavar="S")
    prompt_builder: PromptBuilder | None = None

    def __post_init__(self) -> None:
        check_knobs(self)  # every setting within its bound, naming its flag

    def builder(self) -> PromptBuilder:
        """The prompt builder to use (the default one when none was given)."""
        return self.prompt_builder if self.prompt_builder is not None else PromptBuilder()
