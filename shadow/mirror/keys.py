"""Prompt keys: a keyed hash (HMAC-SHA256, 64 bits shown) of the prompt with a per-deployment
secret, so that keys from two deployments differ and a known prompt cannot be confirmed by anyone
who only reads the event API. The prompt text is never kept."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

SECRET_BYTES = 32


def load_or_create_secret(path: str | Path) -> bytes:
    """The secret kept in `path` (hex); created with mode 0600 when missing."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        p.parent.mkdir(parents=True, exist_ok=True)
        text = secrets.token_hex(SECRET_BYTES)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(text + "\n")
        return bytes.fromhex(text)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{p}: not a hex secret") from None
    if len(secret) < 16:
        raise ValueError(f"{p}: secret shorter than 16 bytes")
    return secret


def default_secret_path() -> Path:
    """$SHADOW_KEY_FILE, else $XDG_STATE_HOME/shadow/prompt-key (default ~/.local/state)."""
    env = os.environ.get("SHADOW_KEY_FILE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "shadow" / "prompt-key"


class KeySecret:
    """`prompt_key(request_json)` → 16 hex digits, or None without a prompt; secret None = random."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(SECRET_BYTES)

    def prompt_key(self, req: dict[str, Any]) -> str | None:
        src = req.get("messages", req.get("prompt"))
        if src is None:
            return None
        try:
            canon = json.dumps(src, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError):
            return None
        mac = hmac.new(self._secret, canon.encode("utf-8", "surrogatepass"), hashlib.sha256)
        return mac.hexdigest()[:16]
