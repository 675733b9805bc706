"""The step probe's family on a vLLM engine's own /metrics, declared here (`FAMILIES`)."""

from __future__ import annotations

from prometheus_client.core import Metric

from shadow.base.families import Family
from shadow.realvllm.stepsender import StepSender

PROBE_STEPS = Family("shadow_probe_steps_total", "counter",
                     "Engine steps the shadow probe handled, by outcome", "steps", ("engine", "outcome"),
                     {"outcome": ("sent", "dropped_full", "dropped_failed", "dropped_closed")})
FAMILIES = (PROBE_STEPS,)


class ProbeCollector:
    """`shadow_probe_steps_total{engine,outcome}` of one engine's sender. It describes nothing, so
    the engines of one API server (one registry) can each register theirs."""

    def __init__(self, sender: StepSender, engine: int) -> None:
        self.sender = sender
        self.engine = str(engine)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        c = self.sender.counts
        counts = {"sent": c.sent, "dropped_full": c.dropped_full, "dropped_failed": c.dropped_failed,
                  "dropped_closed": c.dropped_closed}
        return [PROBE_STEPS.sampled({(self.engine, o): counts[o] for o in PROBE_STEPS.closed("outcome")})]
