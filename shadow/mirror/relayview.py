"""Views, in the analysis process, of a relay process's taps and hand-off (read from its marks).

`RemoteTap` answers what the metrics, `/v1/state` and the service read from a `Tap` (name, url,
upstream, requests, connect_errors, rejected, connections, inflight()); `RemoteQueue` what they read
from a `DropQueue` (offered, dropped, maxsize, bytes, len). Figures are as of the relay's last mark
(every 0.25 s, and on every sync).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shadow.mirror.channel import ChannelReader
from shadow.mirror.proxy import REJECT_REASONS


class RemoteTap:
    """A tap served by the relay process (see module docstring)."""

    def __init__(self, name: str, upstream: str, host: str, port: int, reader: ChannelReader) -> None:
        self.name = name
        self.upstream = upstream
        self.host = host
        self.port = port
        self._reader = reader

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _get(self, key: str, default: Any = 0) -> Any:
        return self._reader.stats.get("taps", {}).get(self.name, {}).get(key, default)

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
    def connections(self) -> int:
        return int(self._get("connections"))

    def inflight(self) -> int:
        return int(self._get("inflight"))


class RemoteQueue:
    """The hand-off as the analysis process sees it: `offered` = items the relay offered (as of its
    last mark, or more if more arrived), `dropped` = refused when full, len = not yet processed."""

    def __init__(self, reader: ChannelReader, maxsize: int, processed: Callable[[], int]) -> None:
        self._reader = reader
        self.maxsize = maxsize
        self._processed = processed

    @property
    def offered(self) -> int:
        r = self._reader
        return max(r.offered, r.received + r.dropped)

    @property
    def dropped(self) -> int:
        return self._reader.dropped

    @property
    def bytes(self) -> int:
        return int(self._reader.stats.get("pending_bytes", 0))

    def __len__(self) -> int:
        return max(0, self.offered - self.dropped - self._processed())
