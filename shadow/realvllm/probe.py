"""shadow's step probe: a vLLM stat-logger plugin (entry point group `vllm.stat_logger_plugins`)
that hands every engine step to a `StepSender`, which posts them as `step` events to a shadow
event API. Inert (no thread, no socket) unless SHADOW_PROBE_URL is set. One instance serves every DP engine of
the API server it runs in (an aggregate logger), so its counter family is on /metrics once.

Environment: SHADOW_PROBE_URL (shadow serve's base URL or its /v1/events), SHADOW_PROBE_TOKEN
(serve's --probe-token, which admits step events only, or its events token), SHADOW_PROBE_WORKER
(worker name; `{engine}` becomes the DP engine index), SHADOW_PROBE_QUEUE (queue bound, default
4096), SHADOW_PROBE_FLUSH_MS (default 100).

What the fields are (vLLM 0.32, read from its source): `record()` runs on the API server's event
loop once per EngineCoreOutputs batch carrying SchedulerStats, i.e. once per engine step.
`elapsed_s` is `SchedulerIterationDetails.elapsed_ms / 1000` and only present with
`--enable-logging-iteration-details`: EngineCore times, on its own monotonic clock, the span from
after the model's execute call was dispatched to the end of sampling (`capture_iteration_details`
in `vllm/v1/engine/core.py`). running/waiting/kv_usage are the scheduler's counts after the step;
tokens and preemptions come from the step's IterationStats.
"""

from __future__ import annotations

import atexit
import logging
import time
from typing import Any

from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from shadow.realvllm.probe_metrics import ProbeCollector
from shadow.realvllm.stepsender import StepSample, StepSender, sender_from_env

LOG = logging.getLogger("shadow.probe")


class ShadowStepProbe(AggregateStatLoggerBase):  # type: ignore[misc,unused-ignore]  # vllm is untyped here
    """One stat logger for all the engines of an API server (vLLM makes one instance of an
    aggregate logger, a per-engine one per DP rank): one sender, one collector on /metrics.
    `record()` queues one StepSample (or counts a drop) and returns."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = list(engine_indexes) if engine_indexes else [0]
        self.sender: StepSender | None = None
        try:
            self.sender = sender_from_env()
        except ValueError as exc:
            LOG.error("shadow step probe disabled: %s", exc)
        if self.sender is None:
            return
        self._register_metrics()
        atexit.register(self.sender.close)
        LOG.info("shadow step probe: engine(s) %s post steps to %s", self.engine_indexes, self.sender.url)

    def _register_metrics(self) -> None:
        assert self.sender is not None
        try:
            from prometheus_client import REGISTRY  # vLLM serves this registry on /metrics

            REGISTRY.register(ProbeCollector(self.sender, self.engine_indexes))
        except (ImportError, ValueError) as exc:
            LOG.warning("shadow step probe: no /metrics counter (%s)", exc)

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        sender = self.sender
        if sender is None or scheduler_stats is None:
            return
        details = scheduler_stats.iteration_details
        if details is None and iteration_stats is None:
            return  # a stats update with no step behind it (nothing executed, no output)
        sender.offer(StepSample(
            time.monotonic(), engine_idx,
            details.elapsed_ms / 1000.0 if details is not None else None,
            scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
            scheduler_stats.kv_cache_usage,
            iteration_stats.num_generation_tokens if iteration_stats is not None else 0,
            iteration_stats.num_preempted_reqs if iteration_stats is not None else 0,
        ))

    def log_engine_initialized(self) -> None:
        pass
