"""vLLM's OpenAI wire format (as vLLM 0.32 sends it): SSE chunks, usage objects, full responses
and error bodies.

Framing: one `data: <compact JSON>\\n\\n` per event, `data: [DONE]\\n\\n` at the end (also after an
error event). Completion chunks: `text_completion` with `text`, `logprobs`, `finish_reason`,
`stop_reason`, `prompt_token_ids`, `token_ids`; chat chunks: `chat.completion.chunk` with a
role-only first delta (`{"role":"assistant","content":""}`, plus top-level `prompt_token_ids` and
`prompt_text`), then content deltas with `token_ids`; `finish_reason` only on the last token chunk;
`usage` on every chunk with continuous_usage_stats, and a usage-only chunk with `"choices": []`
and `system_fingerprint` before [DONE] with include_usage. Usage keys in vLLM's order:
prompt_tokens, total_tokens, completion_tokens. (Checked against a real vLLM server's stream by
tests/realvllm/test_wire_double.py.)
"""

from __future__ import annotations

import json
from typing import Any

from shadow.fleet.tokens import TOKEN_TEXT

DONE = b"data: [DONE]\n\n"
SSE_CONTENT_TYPE = b"text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = b"application/json"
SYSTEM_FINGERPRINT = "vllm-0.32.0-5a1d0f11"  # vLLM: "vllm-<version>-<8 hex of its config>"


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def event(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class StreamFormat:
    """Builds the SSE events of one streamed request (completion or chat)."""

    def __init__(
        self,
        *,
        chat: bool,
        rid: str,
        created: int,
        model: str,
        prompt_tokens: int,
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.continuous = include_usage and continuous_usage
        self._head: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        # The common token chunk never changes without continuous usage: build it once.
        self._plain_token = None if self.continuous else event(self._token_obj(None, None, 0))

    def _choice(self, finish: str | None) -> dict[str, Any]:
        if self.chat:
            c: dict[str, Any] = {
                "index": 0,
                "delta": {"content": TOKEN_TEXT},
                "logprobs": None,
                "finish_reason": finish,
            }
            if finish is not None:
                c["stop_reason"] = None
            c["token_ids"] = None
            return c
        return {
            "index": 0,
            "text": TOKEN_TEXT,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }

    def _token_obj(self, finish: str | None, kv_params: dict[str, Any] | None, n_done: int) -> dict[str, Any]:
        obj = dict(self._head)
        obj["choices"] = [self._choice(finish)]
        if self.continuous:
            obj["usage"] = usage(self.prompt_tokens, n_done)
        if kv_params is not None:
            obj["kv_transfer_params"] = kv_params
        return obj

    def role_chunk(self) -> bytes:
        obj = dict(self._head)
        obj["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        if self.continuous:
            obj["usage"] = usage(self.prompt_tokens, 0)
        obj["prompt_token_ids"] = None
        obj["prompt_text"] = None
        return event(obj)

    def token_chunk(
        self, n_done: int, finish: str | None = None, kv_params: dict[str, Any] | None = None
    ) -> bytes:
        """The chunk carrying token number `n_done` (1-based); `finish` on the last one."""
        if self._plain_token is not None and finish is None and kv_params is None:
            return self._plain_token
        return event(self._token_obj(finish, kv_params, n_done))

    def finish_only_chunk(self, finish: str, n_done: int, kv_params: dict[str, Any] | None) -> bytes:
        """A chunk with empty text that only carries `finish_reason` (e.g. abort before a token)."""
        obj = self._token_obj(finish, kv_params, n_done)
        choice = obj["choices"][0]
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return event(obj)

    def usage_chunk(self, completion_tokens: int) -> bytes:
        obj = dict(self._head)
        obj["choices"] = []
        obj["usage"] = usage(self.prompt_tokens, completion_tokens)
        obj["system_fingerprint"] = SYSTEM_FINGERPRINT
        return event(obj)


def stream_error_event(message: str, err_type: str = "InternalServerError", code: int = 500) -> bytes:
    return event(error_body(message, err_type, code))


def full_response(
    *,
    chat: bool,
    rid: str,
    created: int,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    finish: str,
    kv_params: dict[str, Any] | None,
) -> dict[str, Any]:
    """The non-streaming response body (vLLM serialises every field, unset ones as null)."""
    text = TOKEN_TEXT * completion_tokens
    choice: dict[str, Any]
    if chat:
        choice = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
        obj_type = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }
        obj_type = "text_completion"
    body: dict[str, Any] = {
        "id": rid,
        "object": obj_type,
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": {**usage(prompt_tokens, completion_tokens), "prompt_tokens_details": None,
                  "completion_tokens_details": None},
    }
    if chat:
        body["prompt_logprobs"] = None
        body["prompt_token_ids"] = None
        body["prompt_text"] = None
    body["kv_transfer_params"] = kv_params
    body["ec_transfer_params"] = None
    body["metrics"] = None
    return body
