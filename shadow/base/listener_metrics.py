"""The metric families of shadow's listeners (`AsgiListener`), collected from their counters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.core import Metric

from shadow.base.families import Family, SourceCollector
from shadow.base.listener import REJECT_REASONS, AsgiListener

L = ("listener",)
LISTENER_REQUESTS = Family("shadow_listener_requests_total", "counter",
                           "Requests served by each of shadow's own listeners (api, active).", "requests", L)
LISTENER_REJECTED = Family(
    "shadow_listener_rejected_total", "counter",
    "Requests or connections a listener (api, active) refused or cut, by reason (bad_framing, "
    "head_too_large, header_timeout, body_timeout, body_too_large, idle_timeout, upgrade, busy, "
    "evicted_idle, app_error, app_cut, drain_cut, linger_cut).", "requests", ("listener", "reason"),
    values={"reason": REJECT_REASONS})
LISTENER_CONNECTIONS = Family("shadow_listener_connections", "gauge",
                              "Client connections open on each listener.", "connections", L)

FAMILIES = (LISTENER_REQUESTS, LISTENER_REJECTED, LISTENER_CONNECTIONS)


class ListenerCollector(SourceCollector[Mapping[str, AsgiListener]]):
    """The counters of its listeners (name -> listener; read at each collection, so listeners added
    later are exported too)."""

    families = FAMILIES

    def collect(self) -> Iterable[Metric]:
        ls = dict(self.source)
        yield LISTENER_REQUESTS.sampled({n: ln.requests for n, ln in ls.items()})
        rejected = {(n, k): v for n, ln in ls.items() for k, v in list(ln.rejected.items())}
        yield LISTENER_REJECTED.sampled(rejected)
        yield LISTENER_CONNECTIONS.sampled({n: ln.connections for n, ln in ls.items()})
