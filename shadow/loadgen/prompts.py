"""Synthetic prompt text of an exact token count, under a pluggable counting rule.

A trace carries prompt *lengths* and, sometimes, a prompt *key* (a hash saying "these requests
share a prompt"), never prompt text. The load generator therefore makes text up:

- the words are drawn from a fixed 4,096-word vocabulary of two-syllable pseudo-words, picked
  by a SHAKE-256 stream over ``(seed, key)``; they never come from real prompt text;
- a request with a prompt key uses the key's word stream, so identical keys give identical
  prompts (and a longer prompt under the same key extends the shorter one: a shared prefix);
  a request without a key gets a stream of its own (its index), so unkeyed prompts differ;
- the text has exactly N tokens under the builder's counting rule. The default rule is
  "whitespace-separated words" (``len(text.split())``), which is the rule of shadow's simulated
  fleet. Any other rule (a real tokenizer, say) can be plugged in as a ``TokenCounter``; the
  builder then searches for the number of words that counts exactly N, and raises
  ``PromptError`` when the rule cannot reach N exactly with this vocabulary;
- chat requests are one user message. Servers add a per-message overhead to the words of a
  chat message (a chat template; shadow's simulated fleet counts 4 tokens per message): with
  ``chat_overhead=k`` the message gets N − k tokens (at least 1) so that the server counts N.
  The default is 0: the message itself has N tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

TokenCounter = Callable[[str], int]
"""A counting rule: the number of prompt tokens a server would count for ``text``."""

_CONSONANTS = "bdfgklmnprstvz"  # 14
_VOWELS = "aeiou"  # 5
# The first 64 consonant-vowel syllables; 64 x 64 = 4,096 two-syllable words.
_SYLLABLES: tuple[str, ...] = tuple(c + v for c in _CONSONANTS for v in _VOWELS)[:64]
VOCABULARY: tuple[str, ...] = tuple(a + b for a in _SYLLABLES for b in _SYLLABLES)
"""The words prompts are made of: 4,096 lower-case two-syllable pseudo-words, no whitespace."""

_VOCAB_ARRAY = np.array(VOCABULARY, dtype=object)
_STREAM_TAG = b"shadow-loadgen/prompt/v1"


class PromptError(ValueError):
    """A prompt of the requested size cannot be built under the counting rule."""


def count_words(text: str) -> int:
    """The default counting rule: whitespace-separated words."""
    return len(text.split())


class PromptBuilder:
    """Builds deterministic prompt text of exactly N tokens under a counting rule.

    ``counter`` is the counting rule (default: whitespace-separated words); ``seed`` shifts
    every word stream, so two runs with different seeds share no prompt text; ``chat_overhead``
    is the number of tokens the server adds to each chat message.
    """

    def __init__(self, counter: TokenCounter = count_words, *, seed: int = 0, chat_overhead: int = 0) -> None:
        if chat_overhead < 0:
            raise ValueError(f"chat overhead must be >= 0, got {chat_overhead}")
        self.counter = counter
        self.seed = int(seed)
        self.chat_overhead = int(chat_overhead)

    def chat_content_tokens(self, n_tokens: int) -> int:
        """Tokens of the single user message's text for a chat prompt of ``n_tokens`` in all."""
        return max(1, n_tokens - self.chat_overhead)

    # -- keys ---------------------------------------------------------------------------------

    @staticmethod
    def stream_key(index: int, prompt_key: str | None) -> str:
        """The word-stream key of a request: its prompt key, else its own index."""
        return f"k:{prompt_key}" if prompt_key is not None else f"i:{index}"

    # -- words --------------------------------------------------------------------------------

    def words(self, key: str, n: int) -> list[str]:
        """The first ``n`` words of ``key``'s deterministic word stream."""
        if n <= 0:
            return []
        material = _STREAM_TAG + b"|" + str(self.seed).encode() + b"|" + key.encode()
        raw = hashlib.shake_256(material).digest(2 * n)
        idx = np.frombuffer(raw, dtype="<u2") & (len(VOCABULARY) - 1)
        out: list[str] = _VOCAB_ARRAY[idx].tolist()
        return out

    # -- text ---------------------------------------------------------------------------------

    def build(self, n_tokens: int, key: str) -> str:
        """Text of exactly ``n_tokens`` tokens under the counting rule, from ``key``'s stream."""
        if n_tokens < 0:
            raise PromptError(f"prompt length must be >= 0, got {n_tokens}")
        if self.counter is count_words:
            return " ".join(self.words(key, n_tokens))
        return self._search(n_tokens, key)

    def build_for(self, index: int, n_tokens: int, prompt_key: str | None) -> str:
        """Prompt text for trace request ``index`` (keyed when ``prompt_key`` is given)."""
        return self.build(n_tokens, self.stream_key(index, prompt_key))

    def _search(self, n_tokens: int, key: str) -> str:
        """Generic rule: smallest word count k whose text counts ``n_tokens`` (counts grow with k)."""

        def text(words: Sequence[str]) -> str:
            return " ".join(words)

        if n_tokens == 0 and self.counter("") == 0:
            return ""
        hi = max(1, n_tokens)
        pool = self.words(key, hi)
        while self.counter(text(pool)) < n_tokens:
            hi *= 2
            pool = self.words(key, hi)
        lo = 0  # counter(text(pool[:lo])) < n_tokens holds for lo = 0 when n_tokens > 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.counter(text(pool[:mid])) < n_tokens:
                lo = mid
            else:
                hi = mid
        candidate = text(pool[:hi])
        got = self.counter(candidate)
        if got != n_tokens:
            raise PromptError(
                f"cannot build a prompt of exactly {n_tokens} tokens under this counting rule "
                f"(closest: {got})"
            )
        return candidate
