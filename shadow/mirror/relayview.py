"""Views, in the analysis process, of the taps and hand-off of the relays it is attached to (read
from their hellos and marks).

`RemoteTap` answers what the metrics, `/v1/state` and the service read from a `Tap` (name, url,
upstream, requests, connect_errors, rejected, cut, connections, inflight()); `RemoteQueue` what they
read from a `DropQueue` (offered, dropped, maxsize, bytes, len), summed over every relay. Figures
are as of each relay's last mark (every 0.25 s, and on every sync).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shadow.contracts.tapwire import CUT_REASONS, REJECT_REASONS
from shadow.mirror.channel_reader import ChannelReader


def _reachable(url: str, peer_host: str) -> str:
    scheme, _, rest = url.partition("://")
    host, _, port = rest.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = f"[{peer_host}]" if ":" in peer_host else peer_host
    return f"{scheme}://{host}:{port}"


class RemoteTap:
    """A tap served by a relay process (see module docstring); `reader()` is the reader of the
    relay serving it now (None until one says hello)."""

    def __init__(self, name: str, upstream: str, reader: Callable[[], ChannelReader | None],
                 url: str = "") -> None:
        self.name = name
        self.upstream = upstream
        self._reader = reader
        self._url = url
        self._last: dict[str, Any] = {}

    @property
    def url(self) -> str:
        """Where the tap is reached: its URL as the relay reports it, a wildcard bind address
        (0.0.0.0, ::) replaced by the host the analysis attached to (loopback for a unix socket)."""
        r = self._reader()
        if r is not None:
            for t in r.hello.get("taps", []):
                if t.get("name") == self.name and t.get("url"):
                    self._url = _reachable(str(t["url"]), r.peer_host)
        return self._url

    def _get(self, key: str, default: Any = 0) -> Any:
        r = self._reader()
        stats = r.stats.get("taps", {}).get(self.name) if r is not None else None
        if stats:
            self._last = stats
        return self._last.get(key, default)

    @property
    def requests(self) -> int:
        return int(self._get("requests"))

    @property
    def connect_errors(self) -> int:
        return int(self._get("connect_errors"))

    @property
    def rejected(self) -> dict[str, int]:
        return {**dict.fromkeys(REJECT_REASONS, 0), **self._get("rejected", {})}

    @property
    def cut(self) -> dict[str, int]:
        return {**dict.fromkeys(CUT_REASONS, 0), **self._get("cut", {})}

    @property
    def connections(self) -> int:
        return int(self._get("connections"))

    def inflight(self) -> int:
        return int(self._get("inflight"))


class RemoteQueue:
    """The hand-off as the analysis process sees it, over every reader: `offered` = items the
    relays offered (as of their last marks, or more if more arrived), `dropped` = refused when
    full, len = not yet processed."""

    def __init__(self, readers: Callable[[], list[ChannelReader]], maxsize: int) -> None:
        self._readers = readers
        self.maxsize = maxsize

    @property
    def offered(self) -> int:
        return sum(max(r.offered_total, r.received + r.dropped_total) for r in self._readers())

    @property
    def dropped(self) -> int:
        return sum(r.dropped_total for r in self._readers())

    @property
    def bytes(self) -> int:
        return sum(int(r.stats.get("pending_bytes", 0)) for r in self._readers())

    def __len__(self) -> int:
        return sum(max(0, max(r.offered_total, r.received + r.dropped_total) - r.dropped_total - r.processed)
                   for r in self._readers())
