"""Knobs of a load run (everything except the trace and the target)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shadow.loadgen.prompts import PromptBuilder


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

    model: str | None = None
    api_key: str = "EMPTY"
    chat: bool = False
    stream: bool = True
    concurrency: int | None = None
    time_scale: float = 1.0
    limit: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    request_id_prefix: str | None = None
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    prompt_builder: PromptBuilder | None = None

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.time_scale > 0:
            raise ValueError(f"time scale must be > 0, got {self.time_scale}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request timeout must be > 0, got {self.request_timeout_s}")

    def builder(self) -> PromptBuilder:
        """The prompt builder to use (the default one when none was given)."""
        return self.prompt_builder if self.prompt_builder is not None else PromptBuilder()
