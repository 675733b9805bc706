"""Builds the active proxy's routing pieces from its `ActiveConfig`: the decode `Ledger`, the
`Dispatcher` over it (its pool rounds traced in `spans` when given), the `PrefillChooser` and the
`KvPoller` that scrapes the prefillers' KV usage (no targets when `kv_backpressure` is off).
Pure construction: nothing is started here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shadow.active.dispatcher import DispatchConfig, Dispatcher
from shadow.active.ledger import Ledger, LoadSource
from shadow.active.metrics import ActiveMetrics
from shadow.active.prefill import KvPoller, PrefillChooser
from shadow.active.proxyconfig import ActiveConfig
from shadow.contracts.modes import ModeSource
from shadow.core.cost import RouteCost
from shadow.core.routers import Router
from shadow.telemetry.tracing import RoutingSpans


@dataclass
class Routing:
    """The pieces `ActiveProxy` routes with."""

    ledger: Ledger
    dispatcher: Dispatcher
    prefill: PrefillChooser
    poller: KvPoller


def build_routing(
    config: ActiveConfig,
    metrics: ActiveMetrics,
    modes: ModeSource,
    source: LoadSource,
    clock: Callable[[], float],
    router_factory: Callable[[str], Router] | None,
    spans: RoutingSpans | None,
    cost: Callable[[], RouteCost] | None,
) -> Routing:
    """The ledger, dispatcher, prefill chooser and KV poller for `config` (see module docstring)."""
    names = list(config.decode)
    ledger = Ledger(len(names), config.slots, config.transfer_cap, ahead=config.dispatch_ahead)
    dispatcher = Dispatcher(
        DispatchConfig(names, config.slots, config.transfer_cap, config.pool_ttl_s, config.tick_s,
                       config.bypass, config.br),
        ledger,
        source,
        metrics,
        modes,
        clock,
        router_factory,
        cost,
    )
    if spans is not None:
        dispatcher.spans = spans
    prefill = PrefillChooser(config.prefill, metrics, pause_at=config.kv_pause, resume_at=config.kv_resume,
                             rule=config.prefill_rule)
    targets = {
        n: config.prefill_metrics.get(n, u.rstrip("/") + "/metrics")
        for n, u in config.prefill.items()
        if config.kv_backpressure
    }
    poller = KvPoller(targets, prefill.update_kv, interval_s=config.kv_poll_s)
    return Routing(ledger, dispatcher, prefill, poller)
