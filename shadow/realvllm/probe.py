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
in `vllm/v1/engine/core.py`). On the CPU build the executor runs the model's forward pass inside the
dispatch call (`UniProcExecutor.collective_rpc` with non_block=True runs the method, then wraps its
result in a done Future), so `elapsed_s` covers logits, sampling and their bookkeeping only: not the
forward pass, the scheduling or the output processing. The engine's real step period is the time
between consecutive steps, `interval_s` (measured here on the API server's loop, where a busy loop
can delay or bunch records; their mean over many steps is the engine's), and exactly, per step, on
the engine's own clock, `engine_interval_s`: the shortest inter-token latency vLLM measured for the
requests that decoded in the step (`IterationStats.inter_token_latencies_iter`: engine-core
timestamps of this step's outputs minus the request's previous token's; a request that decoded in
the previous step too has exactly the time between the two steps' outputs). running/waiting/kv_usage
are the scheduler's counts after the step; tokens and preemptions come from the step's
IterationStats.

What the host did to the step: `record()` reads the engine's scheduler statistics
(`/proc/<pid>/schedstat` of the main thread of the process that runs its forward pass — its
`VLLM::Worker`, which the CPU build always starts, else the engine core: `EngineSched` — time on a
CPU, time runnable but waiting for one; `stepsender.EngineSched.poll`, one `pread` of a file kept
open, about a microsecond) at each step,
at the step's record time `t` (`engine_run_s`, `engine_wait_s`, cumulative; the sender thread finds
the engine's process). On a loaded host the wait is most of a step's period, and it is not the
load's cost. The values are exact at `t`, which follows the engine's step by the time its outputs
take to reach this loop: a step's own difference is off by that lag's jitter (records come in
bunches), a window of consecutive steps' is off by the lag's difference between its two ends only
(on the 2-core machine at load 7-13: the records' span of 25 steps was within 1 ms of the engines'
own at the median, 4 ms at p90, bench/vllm_step_cost.py). (A first version read them at each post,
every 100 ms or more, and interpolated: the engine's share of a window came out ±40 %.)

What the engine scheduled into the step: with iteration details, `compute_iteration_details` of
the step's SchedulerOutput (`vllm/v1/utils.py`): prefill ("context") requests are new requests and
cached ones with no output token yet (each chunk of a chunked prefill), their scheduled tokens are
`num_ctx_tokens` (computed tokens only: prefix-cache hits are not scheduled); the other scheduled
requests are `num_generation_requests`; `is_dummy` marks a DP rank's padding step. Without
details, from the step's IterationStats: the computed prompt tokens (`prompt_token_stats.computed`)
and the count of the prefills that completed in the step (their first token: all of a chunked
prompt counts at its last chunk), and the requests that emitted a decode token
(`inter_token_latencies_iter`).
"""

from __future__ import annotations

import atexit
import logging
import time
from typing import Any

from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from shadow.realvllm.probe_metrics import ProbeCollector
from shadow.realvllm.stepsender import StepSender, sample_of, sender_from_env

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
        t = time.monotonic()
        host = sender.sched.poll(engine_idx) if sender.sched is not None else None
        sender.offer(sample_of(t, engine_idx, scheduler_stats, iteration_stats, host))

    def log_engine_initialized(self) -> None:
        """The engines are up: the sender thread looks for their processes now, not at their first
        steps (a burst of steps shorter than a post would otherwise go out without their CPU times)."""
        if self.sender is not None and self.sender.sched is not None:
            self.sender.sched.want(self.engine_indexes)

