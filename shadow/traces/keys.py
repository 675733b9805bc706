"""Prompt keys: short, stable hashes (16 hex digits of BLAKE2b-64) that identify a prompt without its text.

Two requests share a key exactly when their prompts are treated as identical by ExactMatch:
- `hash_key(text)`: the key of any identifying string;
- `ctx_prompt_key(n)`: the key of the deterministic synthetic prompt of `n` tokens that a replay
  client sends for a text-less trace (Azure), i.e. `hash_key(f"ctx-{n}")` (paper notes, A9);
- `block_key(ids)`: the key of a Mooncake prompt, from its full list of prefix-block hash ids;
- `template_key(j)`: the key of synthetic prompt template `j`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

KEY_DIGEST_BYTES = 8


def hash_key(text: str) -> str:
    """16-hex-digit BLAKE2b digest of `text` (UTF-8)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=KEY_DIGEST_BYTES).hexdigest()


def ctx_prompt_key(prompt_tokens: int) -> str:
    """Key of the deterministic synthetic prompt of `prompt_tokens` tokens: hash_key("ctx-<n>")."""
    return hash_key(f"ctx-{prompt_tokens}")


def block_key(hash_ids: Iterable[int]) -> str:
    """Key of a prompt given its full list of prefix-block hash ids: hash_key of the ids joined by ","."""
    return hash_key(",".join(str(i) for i in hash_ids))


def template_key(template: int) -> str:
    """Key of synthetic prompt template number `template`: hash_key("template-<j>")."""
    return hash_key(f"template-{template}")
