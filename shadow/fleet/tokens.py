"""Deterministic tokenisation rules of the simulated fleet (what a load generator can target).

Prompt tokens:
- completions, `prompt` a string: the number of whitespace-separated words (`len(s.split())`),
  so "w w w ... w" with N words is exactly N tokens; `prompt` a list of ints: its length;
  a one-element list of strings counts like its string.
- chat: Σ over messages of (words in its text content + CHAT_MESSAGE_OVERHEAD); content may be
  a string, null, or a list of parts whose `{"type": "text", "text": ...}` parts are counted.
  One user message of N words is N + 4 tokens.

Generated text: every token is TOKEN_TEXT (" tok"), so the completion text of n tokens is
" tok" * n.

Output length: with `ignore_eos` exactly `max_tokens` (finish "length"). Otherwise a draw from an
exponential distribution with mean `mean_output_tokens`, seeded by a BLAKE2b hash of the prompt
text (plus the request's `seed`, when given): n = max(1, ceil(-mean·ln u)), u ∈ (0, 1) from the
hash; raised to `min_tokens`; if it reaches `max_tokens` the request ends with "length" at
`max_tokens`, else with "stop" at n. The same request always produces the same length.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

CHAT_MESSAGE_OVERHEAD = 4
TOKEN_TEXT = " tok"


class PromptError(ValueError):
    """The prompt or messages are malformed (maps to a 400 with `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def count_words(text: str) -> int:
    return len(text.split())


def prompt_tokens(prompt: Any) -> tuple[int, str]:
    """(token count, text used as the output-length seed) of a completions `prompt`."""
    if isinstance(prompt, str):
        return count_words(prompt), prompt
    if isinstance(prompt, list) and prompt:
        if set(map(type, prompt)) == {int}:  # C-speed check: token ids (bools excluded)
            return len(prompt), " ".join(map(str, prompt))
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return count_words(prompt[0]), prompt[0]
        if all(isinstance(p, str) for p in prompt):
            raise PromptError("batched prompts are not supported by the simulated fleet", "prompt")
    raise PromptError(
        "prompt must be a string, a list of token ids or a one-element list of strings", "prompt"
    )


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict):
                raise PromptError("message content parts must be objects", "messages")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise PromptError("text content part needs a string 'text'", "messages")
                parts.append(text)
        return " ".join(parts)
    raise PromptError("message content must be a string, null or a list of parts", "messages")


def chat_tokens(messages: Any) -> tuple[int, str]:
    """(token count, seed text) of a chat `messages` list."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list", "messages")
    total = 0
    texts: list[str] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError("each message must be an object with a string 'role'", "messages")
        text = _content_text(m.get("content"))
        total += count_words(text) + CHAT_MESSAGE_OVERHEAD
        texts.append(f"{m['role']}:{text}")
    return total, "\n".join(texts)


def output_length(
    seed_text: str, max_tokens: int, *, ignore_eos: bool, min_tokens: int, mean_tokens: int, seed: int | None
) -> tuple[int, str]:
    """(number of tokens to generate, finish reason) for a request, deterministically."""
    if ignore_eos:
        return max_tokens, "length"
    h = hashlib.blake2b(seed_text.encode("utf-8", "surrogatepass"), digest_size=8)
    if seed is not None:
        h.update(str(seed).encode())
    u = (int.from_bytes(h.digest(), "big") + 0.5) / 2.0**64
    n = max(1, math.ceil(-mean_tokens * math.log(u)), min_tokens)
    if n >= max_tokens:
        return max_tokens, "length"
    return n, "stop"
