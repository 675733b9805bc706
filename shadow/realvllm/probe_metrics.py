"""The step probe's family on a vLLM engine's own /metrics, declared here (`FAMILIES`)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import Metric

from shadow.base.families import Family
from shadow.realvllm.stepsender import StepSender

PROBE_STEPS = Family("shadow_probe_steps_total", "counter",
                     "Engine steps the shadow probe handled, by outcome", "steps", ("engine", "outcome"),
                     {"outcome": ("sent", "dropped_full", "dropped_failed", "dropped_closed")})
FAMILIES = (PROBE_STEPS,)


class ProbeCollector:
    """`shadow_probe_steps_total{engine,outcome}` of one API server's sender: one collector for all
    the engines it serves (the DP ranks of one server share its registry, so the family is on the
    page once), every engine listed from the start."""

    def __init__(self, sender: StepSender, engines: Sequence[int]) -> None:
        self.sender = sender
        self.engines = tuple(engines)

    def describe(self) -> list[Metric]:
        return [PROBE_STEPS.family()]

    def collect(self) -> list[Metric]:
        by_engine = self.sender.counts.by_engine
        values: dict[tuple[str, str], float] = {}
        for engine in sorted({*self.engines, *by_engine}):
            c = by_engine.get(engine)
            for outcome in PROBE_STEPS.closed("outcome"):
                values[(str(engine), outcome)] = getattr(c, outcome) if c is not None else 0
        return [PROBE_STEPS.sampled(values)]
