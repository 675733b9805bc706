"""P/D KV handles (NIXL form): a prefill server issues them and holds the KV until the decode
pulls it (claim at decode arrival, release when the decode admits the request) or a TTL passes.

The handle is the prefill response's `kv_transfer_params`: {do_remote_prefill: true,
do_remote_decode: false, remote_engine_id, remote_block_ids, remote_request_id, remote_host,
remote_port, tp_size}. Decode ranks find the issuing store through a `KvDirectory` shared by the
fleet process (engine id → store); a handle from an unknown engine, an unknown or expired
request, mismatching block ids, or one already pulled is a `HandleError` (a 400).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


class HandleError(ValueError):
    """The decode request's kv_transfer_params do not name KV that can be pulled."""


@dataclass(slots=True)
class KvHold:
    key: str
    block_ids: list[int]
    tokens: int
    expires_at: float
    claimed: bool = False


class KvStore:
    """KV held by one prefill server for remote decodes (event-loop time for TTLs)."""

    def __init__(self, engine_id: str, host: str, port: int, *, ttl_s: float, block_size: int) -> None:
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.ttl_s = ttl_s
        self.block_size = block_size
        self.holds: dict[str, KvHold] = {}
        self.up = True
        self.expired = 0
        self.aborted = 0  # holds released because the proxy said nobody will pull them
        self._next_block = 0
        self._keys = itertools.count()

    def issue(self, request_id: str, tokens: int, now: float) -> dict[str, Any]:
        """Hold `tokens` of KV for `request_id`; return the handle (kv_transfer_params)."""
        n_blocks = max(1, -(-tokens // self.block_size))
        start = self._next_block
        self._next_block += n_blocks
        key = f"{request_id}-{next(self._keys)}"
        hold = KvHold(key, list(range(start, start + n_blocks)), tokens, now + self.ttl_s)
        self.holds[key] = hold
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": hold.block_ids,
            "remote_request_id": key,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        }

    def sweep(self, now: float) -> None:
        """Drop unclaimed holds whose TTL passed."""
        dead = [k for k, h in self.holds.items() if not h.claimed and h.expires_at <= now]
        for k in dead:
            del self.holds[k]
        self.expired += len(dead)

    def claim(self, key: Any, block_ids: Any, now: float) -> KvHold:
        self.sweep(now)
        hold = self.holds.get(key) if isinstance(key, str) else None
        if hold is None:
            raise HandleError(f"KV transfer handle {key!r} of engine {self.engine_id} is unknown or expired")
        if hold.claimed:
            raise HandleError(f"KV transfer handle {key!r} was already pulled")
        if block_ids is not None and block_ids != hold.block_ids:
            raise HandleError(f"KV transfer handle {key!r}: remote_block_ids do not match")
        hold.claimed = True
        return hold

    def release(self, hold: KvHold) -> None:
        self.holds.pop(hold.key, None)

    def held_tokens(self) -> int:
        return sum(h.tokens for h in self.holds.values())

    def held_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self.holds.values())

    def reset(self) -> None:
        self.holds.clear()


class KvDirectory:
    """Engine id → store, for every prefill server of the fleet process."""

    def __init__(self) -> None:
        self._stores: dict[str, KvStore] = {}

    def register(self, store: KvStore) -> None:
        self._stores[store.engine_id] = store

    def unregister(self, engine_id: str) -> None:
        self._stores.pop(engine_id, None)

    def claim(self, params: dict[str, Any], now: float) -> tuple[KvStore, KvHold]:
        """Claim the KV named by a decode request's kv_transfer_params (raises HandleError)."""
        engine_id = params.get("remote_engine_id")
        store = self._stores.get(engine_id) if isinstance(engine_id, str) else None
        if store is None or not store.up:
            raise HandleError(f"KV transfer failed: remote engine {engine_id!r} is unknown or unreachable")
        return store, store.claim(params.get("remote_request_id"), params.get("remote_block_ids"), now)
