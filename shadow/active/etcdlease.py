"""`EtcdLease`: the leader lease on etcd v3 through its JSON gateway (`/v3/...`, served by etcd
3.4+ on its client port) over httpx — the gRPC API's own JSON mapping, so no etcd client library
(the PyPI ones are unmaintained).

acquire: `lease/grant` with the TTL, then a `kv/txn` putting the key (value = holder) with that
lease only if the key's create revision is 0 (it does not exist); on failure the lease is revoked.
renew: `lease/keepalive` (TTL 0 or no TTL in the answer: the lease expired; renewals may
overlap). release: `lease/revoke` (the key goes with it). holder: `kv/range`. Every call is
bounded by `timeout_s`; an unreachable or answering-wrongly etcd is an `EtcdError`, never a hang.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import orjson

from shadow.active.lease import DEFAULT_CALL_TIMEOUT_S


class EtcdError(RuntimeError):
    """etcd could not be reached or answered something unexpected."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class EtcdLease:
    """See module docstring. One instance per replica; not thread-safe (one event loop)."""

    def __init__(self, endpoint: str, key: str, *, timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                 client: httpx.AsyncClient | None = None) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.key = key
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), trust_env=False)
        self.lease_id: str | None = None

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            r = await self.client.post(f"{self.endpoint}/v3/{path}", content=orjson.dumps(body))
        except httpx.HTTPError as exc:
            raise EtcdError(f"etcd {path}: {type(exc).__name__}") from None
        if r.status_code != 200:
            raise EtcdError(f"etcd {path}: HTTP {r.status_code} {r.text[:200]}")
        try:
            # keepalive streams one JSON object per line; the first is the answer to ours
            data = orjson.loads(r.content.split(b"\n", 1)[0])
        except orjson.JSONDecodeError:
            raise EtcdError(f"etcd {path}: not JSON") from None
        if not isinstance(data, dict):
            raise EtcdError(f"etcd {path}: not an object")
        if "error" in data:
            raise EtcdError(f"etcd {path}: {str(data['error'])[:200]}")
        return data

    async def acquire(self, holder: str, ttl_s: float) -> bool:
        grant = await self._call("lease/grant", {"TTL": int(ttl_s)})
        lease = grant.get("ID")
        if lease is None:
            raise EtcdError(f"etcd lease/grant: no ID in {grant}")
        key = _b64(self.key)
        txn = await self._call("kv/txn", {
            "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": key, "value": _b64(holder), "lease": lease}}],
        })
        if txn.get("succeeded"):
            self.lease_id = str(lease)
            return True
        await self._call("lease/revoke", {"ID": lease})
        return False

    async def renew(self) -> bool:
        """Keep our lease alive; several renewals may be in flight at once."""
        lease = self.lease_id
        if lease is None:
            return False
        data = await self._call("lease/keepalive", {"ID": lease})
        result = data.get("result", data)
        ttl = int(result.get("TTL", 0)) if isinstance(result, dict) else 0
        if ttl <= 0:
            if self.lease_id == lease:
                self.lease_id = None
            return False
        return True

    async def release(self) -> None:
        if self.lease_id is not None:
            lease, self.lease_id = self.lease_id, None
            await self._call("lease/revoke", {"ID": lease})

    async def holder(self) -> str | None:
        data = await self._call("kv/range", {"key": _b64(self.key)})
        kvs = data.get("kvs") or []
        if not kvs:
            return None
        return base64.b64decode(kvs[0].get("value", "")).decode(errors="replace")

    async def aclose(self) -> None:
        await self.client.aclose()
