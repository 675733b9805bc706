"""Parsing and validation of `/v1/completions` and `/v1/chat/completions` bodies, with vLLM's
error semantics: `ApiError` carries the status and the `{"error": {message, type, param, code}}`.

Defaults as vLLM 0.33: completions `max_tokens` 16; chat `max_completion_tokens`/`max_tokens`
default to the rest of the context (max_model_len − prompt); `temperature` and `top_p` are read
(numbers; default 1.0, vLLM's) but change nothing. Only n = 1 and single prompts are supported
(anything else is a 400 that says so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shadow.fleet.config import FleetConfig
from shadow.fleet.sse import error_body
from shadow.fleet.tokens import PromptError, chat_tokens, output_length, prompt_tokens

ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "ForbiddenError",
    404: "NotFoundError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """An error answered before streaming starts."""

    def __init__(
        self, status: int, message: str, param: str | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or ERROR_TYPES.get(
            status, "BadRequestError" if status < 500 else "InternalServerError"
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)


@dataclass(frozen=True, slots=True)
class GenRequest:
    """A validated generation request."""

    chat: bool
    model: str
    prompt_tokens: int
    max_tokens: int
    target: int  # tokens this request will generate
    natural_finish: str  # finish reason when it reaches `target`
    stream: bool
    include_usage: bool
    continuous_usage: bool
    kv_params: dict[str, Any] | None
    temperature: float = 1.0  # as asked (sampling is not simulated: only the request's spans show it)
    top_p: float = 1.0

    @property
    def remote_prefill(self) -> bool:
        """A decode leg carrying a prefill's KV handle."""
        return bool(self.kv_params) and self.kv_params.get("do_remote_prefill") is True  # type: ignore[union-attr]

    @property
    def remote_decode(self) -> bool:
        """A prefill leg whose KV is to be pulled by a remote decode."""
        return bool(self.kv_params) and self.kv_params.get("do_remote_decode") is True  # type: ignore[union-attr]


def _bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{key} must be a boolean, got {v!r}", key)
    return v


def _int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key} must be an integer, got {v!r}", key)
    return v


def _float(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ApiError(400, f"{key} must be a number, got {v!r}", key)
    return float(v)


def _prompt(body: dict[str, Any], chat: bool, config: FleetConfig) -> tuple[int, str]:
    """The prompt's token count and the text its output length is seeded from; a prompt that is
    empty or fills the context is refused as vLLM refuses it."""
    try:
        if chat:
            p_tokens, seed_text = chat_tokens(body.get("messages"))
        else:
            p_tokens, seed_text = prompt_tokens(body.get("prompt"))
    except PromptError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    if p_tokens < 1:
        raise ApiError(400, "The prompt must not be empty", "prompt")
    if p_tokens >= config.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"your request has {p_tokens} input tokens. Please reduce the length of the input "
            "messages.",
            "messages" if chat else "prompt",
        )
    return p_tokens, seed_text


def _lengths(body: dict[str, Any], chat: bool, config: FleetConfig, p_tokens: int) -> tuple[int, int]:
    """`max_tokens` (chat: `max_completion_tokens` first; default: the rest of the context for chat,
    16 for completions) and `min_tokens`, checked against the context as vLLM checks them."""
    key = "max_tokens"
    max_tokens = None
    if chat:
        max_tokens = _int(body, "max_completion_tokens")
        key = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = config.max_model_len - p_tokens if chat else 16
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", key)
    if p_tokens + max_tokens > config.max_model_len:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
            f"This model's maximum context length is {config.max_model_len} tokens and your "
            f"request has {p_tokens} input tokens "
            f"({max_tokens} > {config.max_model_len} - {p_tokens}).",
            key,
        )
    min_tokens = _int(body, "min_tokens") or 0
    if min_tokens < 0 or min_tokens > max_tokens:
        raise ApiError(
            400, f"min_tokens must be between 0 and max_tokens={max_tokens}, got {min_tokens}", "min_tokens"
        )
    return max_tokens, min_tokens


def parse_request(raw: bytes, *, chat: bool, config: FleetConfig) -> GenRequest:
    """Validate a request body; raise ApiError as vLLM would answer it."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"Invalid JSON in request body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != config.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options")
        if not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = _bool(opts or {}, "include_usage")
    continuous = _bool(opts or {}, "continuous_usage_stats")
    n = _int(body, "n")
    if n is not None and n != 1:
        raise ApiError(400, f"n={n} is not supported by the simulated fleet (only n=1)", "n")
    p_tokens, seed_text = _prompt(body, chat, config)
    max_tokens, min_tokens = _lengths(body, chat, config, p_tokens)
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise ApiError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    seed = _int(body, "seed")
    target, finish = output_length(
        seed_text,
        max_tokens,
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=min_tokens,
        mean_tokens=config.mean_output_tokens,
        seed=seed,
    )
    return GenRequest(
        chat=chat,
        model=config.model,
        prompt_tokens=p_tokens,
        max_tokens=max_tokens,
        target=target,
        natural_finish=finish,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        kv_params=kv,
        temperature=_float(body, "temperature", 1.0),
        top_p=_float(body, "top_p", 1.0),
    )
