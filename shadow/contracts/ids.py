"""A request's id as shadow keeps it: the hash of the `X-Request-Id` it came with, never the id
itself. The taps and the passive capture hash the header as they read it (`dataplane.http1.head_ids`),
so the mirror, its recordings, the API, logs and spans only ever see the hash; the header itself
goes upstream unchanged."""

from __future__ import annotations

import hashlib


def request_hash(request_id: str) -> str:
    """16 hex digits of BLAKE2b-64 of `request_id` (UTF-8): the same in the mirror and on every span
    kind, so that a mirrored request, the taps' spans and the proxy's admission of it match."""
    return hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
