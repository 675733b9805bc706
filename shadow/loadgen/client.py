"""The official ``openai`` AsyncOpenAI client, set up for load generation.

The load generator sends every request with the official SDK, exactly as a user's client
would. The SDK is imported here, lazily, so ``shadow.loadgen`` imports without it; when it is
missing, ``require_openai`` raises a ``LoadError`` saying how to install it.

Set-up choices: no SDK retries (a retry would hide an error and distort latencies), a
connection pool at least as large as the concurrency cap (so the pool never queues requests
the scheduler already released), and the per-request timeout as the read timeout.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from shadow.loadgen.errors import LoadError

_PROBE_TIMEOUT_S = 5.0
_MIN_POOL = 1000
_UNCAPPED_POOL = 10_000


def require_openai() -> ModuleType:
    """The ``openai`` module, or a ``LoadError`` with the install hint."""
    try:
        import openai
    except ImportError as exc:  # pragma: no cover - exercised only without the SDK installed
        raise LoadError(
            "the official openai client is required to send requests: pip install openai"
        ) from exc
    return openai


def normalize_base_url(target: str) -> str:
    """The API base URL for ``target``: a scheme is required, ``/v1`` is appended unless present.

    ``http://host:8000`` and ``http://host:8000/v1`` both give ``http://host:8000/v1``.
    """
    parts = urlsplit(target.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise LoadError(f"target must be an http(s) URL such as http://127.0.0.1:8000, got {target!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path = f"{path}/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _http_client(openai: ModuleType, max_connections: int) -> Any:
    """An SDK-default async HTTP client with a larger pool, or ``None`` to keep the SDK's own."""
    factory = getattr(openai, "DefaultAsyncHttpxClient", None)
    if factory is None:
        return None
    # The SDK builds on httpx (1.x) or httpx2 (3.x): take Limits from the package it uses.
    for base in type.mro(factory):
        if base.__name__ == "AsyncClient":
            pkg = sys.modules.get(base.__module__.split(".")[0])
            limits_cls = getattr(pkg, "Limits", None)
            if limits_cls is None:
                return None
            return factory(
                limits=limits_cls(max_connections=max_connections, max_keepalive_connections=max_connections)
            )
    return None


def make_client(
    base_url: str,
    *,
    api_key: str = "EMPTY",
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
    concurrency: int | None = None,
) -> Any:
    """An ``openai.AsyncOpenAI`` client for ``base_url`` (no retries, pool >= concurrency)."""
    openai = require_openai()
    pool = _UNCAPPED_POOL if concurrency is None else max(_MIN_POOL, concurrency + 16)
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key=api_key,
        default_headers=dict(headers or {}),
        timeout=timeout_s,
        max_retries=0,
        http_client=_http_client(openai, pool),
    )


def _cause(exc: BaseException) -> str:
    """The innermost cause of ``exc`` as one short line."""
    inner: BaseException = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    text = " ".join(str(inner).split()) or type(inner).__name__
    return text[:200]


async def resolve_model(client: Any, base_url: str, model: str | None) -> str:
    """The model to send: ``model`` if given, else the first id of ``GET /v1/models``.

    Also a reachability probe: a target that cannot be connected to raises ``LoadError``. A
    target without ``/v1/models`` is accepted when a model name was given.
    """
    openai = require_openai()
    try:
        page = await client.with_options(timeout=_PROBE_TIMEOUT_S).models.list()
    except openai.APIConnectionError as exc:
        raise LoadError(f"target unreachable: {base_url} ({_cause(exc)})") from exc
    except openai.APIStatusError as exc:
        if model:
            return model
        raise LoadError(
            f"GET {base_url}/models failed with HTTP {exc.status_code}; pass --model NAME"
        ) from exc
    except openai.APIError as exc:  # a reply that is not an OpenAI-style model list
        if model:
            return model
        raise LoadError(f"GET {base_url}/models: {_cause(exc)}; pass --model NAME") from exc
    if model:
        return model
    ids = [m.id for m in getattr(page, "data", [])]
    if not ids:
        raise LoadError(f"{base_url}/models lists no model; pass --model NAME")
    return str(ids[0])
