"""Prompt construction: exact token counts, key determinism, pluggable counting rules."""

from __future__ import annotations

import pytest

from shadow.loadgen import PromptBuilder, PromptError, count_words
from shadow.loadgen.prompts import VOCABULARY


def test_vocabulary_is_4096_distinct_single_words() -> None:
    assert len(VOCABULARY) == len(set(VOCABULARY)) == 4096
    assert all(w and w.isalpha() and w.islower() and len(w.split()) == 1 for w in VOCABULARY)


@pytest.mark.parametrize("n", [1, 2, 7, 128, 5000])
def test_exact_word_count(n: int) -> None:
    text = PromptBuilder().build(n, "k:abc")
    assert count_words(text) == n
    assert text == text.strip() and "  " not in text


def test_zero_tokens_is_empty_text() -> None:
    assert PromptBuilder().build(0, "x") == ""
    with pytest.raises(PromptError):
        PromptBuilder().build(-1, "x")


def test_identical_keys_identical_text_different_keys_differ() -> None:
    a, b = PromptBuilder(), PromptBuilder()
    assert a.build_for(0, 64, "hash-1") == b.build_for(99, 64, "hash-1")
    assert a.build_for(0, 64, "hash-1") != a.build_for(0, 64, "hash-2")
    # a longer prompt under the same key extends the shorter one (shared prefix)
    assert a.build_for(1, 80, "hash-1").startswith(a.build_for(0, 64, "hash-1") + " ")


def test_unkeyed_requests_get_their_own_text() -> None:
    b = PromptBuilder()
    texts = {b.build_for(i, 32, None) for i in range(50)}
    assert len(texts) == 50
    assert b.build_for(3, 32, None) == PromptBuilder().build_for(3, 32, None)  # deterministic
    # an unkeyed request never collides with a key that happens to look like an index
    assert b.build_for(3, 32, None) != b.build_for(0, 32, "3")


def test_seed_changes_every_prompt() -> None:
    assert PromptBuilder(seed=0).build_for(0, 32, "k") != PromptBuilder(seed=1).build_for(0, 32, "k")


def test_custom_counting_rule_is_exact() -> None:
    def chars_over_4(text: str) -> int:  # a crude "4 characters per token" rule
        return (len(text) + 3) // 4

    b = PromptBuilder(counter=chars_over_4)
    for n in (1, 5, 33, 400):
        assert chars_over_4(b.build(n, "key")) == n


def test_unreachable_count_raises_one_line_error() -> None:
    b = PromptBuilder(counter=lambda text: 2 * len(text.split()))  # only even counts exist
    assert b.build(6, "k").count(" ") == 2
    with pytest.raises(PromptError, match="exactly 7 tokens") as err:
        b.build(7, "k")
    assert "\n" not in str(err.value)


def test_agrees_with_the_simulated_fleet_counting_rule() -> None:
    tokens = pytest.importorskip("shadow.fleet.tokens")
    b = PromptBuilder(chat_overhead=getattr(tokens, "CHAT_MESSAGE_OVERHEAD", 4))
    for n in (1, 9, 300):
        text = b.build_for(0, n, "key")
        assert tokens.prompt_tokens(text)[0] == n
        message = b.build_for(0, b.chat_content_tokens(n + b.chat_overhead), "key")
        assert tokens.chat_tokens([{"role": "user", "content": message}])[0] == n + b.chat_overhead
