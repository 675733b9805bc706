"""vLLM 0.33 `/metrics` for simulated engines: plain counters updated on the hot path, exposed
through one custom collector per server registry (no global registry, no per-token locking).

Names, types and labels follow vLLM V1 (`model_name`, `engine`); counters are exposed as
`<name>_total` with `_created`, histograms as `_bucket{le}`/`_sum`/`_count`. Times are wall-clock
seconds as a client observes them (the time scale is already applied).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

FINISH_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exp += 1


def _le(bound: float) -> str:
    """Bucket bound as Prometheus' Go client writes it (1.0, 0.25, 20000.0)."""
    return repr(float(bound))


class Hist:
    """A histogram with weighted observations (one call for many equal samples)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for b, c in zip(self.bounds, self.counts, strict=False):
            acc += c
            out.append((_le(b), float(acc)))
        out.append(("+Inf", float(self.count)))
        return out


class EngineStats:
    """Counters and histograms of one engine since it (re)started."""

    def __init__(self, max_model_len: int) -> None:
        self.created = time.time()
        self.prompt_tokens = 0
        self.prompt_by_source = dict.fromkeys(PROMPT_SOURCES, 0)
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.preemptions = 0
        tok = buckets_1_2_5(max_model_len)
        self.hists: dict[str, Hist] = {
            "vllm:time_to_first_token_seconds": Hist(TTFT_BUCKETS),
            "vllm:inter_token_latency_seconds": Hist(ITL_BUCKETS),
            "vllm:request_time_per_output_token_seconds": Hist(ITL_BUCKETS),
            "vllm:e2e_request_latency_seconds": Hist(LATENCY_BUCKETS),
            "vllm:request_queue_time_seconds": Hist(LATENCY_BUCKETS),
            "vllm:request_inference_time_seconds": Hist(LATENCY_BUCKETS),
            "vllm:request_prefill_time_seconds": Hist(LATENCY_BUCKETS),
            "vllm:request_decode_time_seconds": Hist(LATENCY_BUCKETS),
            "vllm:iteration_tokens_total": Hist(ITERATION_TOKEN_BUCKETS),
            "vllm:request_prompt_tokens": Hist(tok),
            "vllm:request_generation_tokens": Hist(tok),
            "vllm:request_max_num_generation_tokens": Hist(tok),
            "vllm:request_params_max_tokens": Hist(tok),
            "vllm:request_params_n": Hist(N_BUCKETS),
        }
        h = self.hists
        self.ttft = h["vllm:time_to_first_token_seconds"]
        self.itl = h["vllm:inter_token_latency_seconds"]
        self.tpot = h["vllm:request_time_per_output_token_seconds"]
        self.e2e = h["vllm:e2e_request_latency_seconds"]
        self.queue = h["vllm:request_queue_time_seconds"]
        self.inference = h["vllm:request_inference_time_seconds"]
        self.prefill = h["vllm:request_prefill_time_seconds"]
        self.decode = h["vllm:request_decode_time_seconds"]
        self.iteration_tokens = h["vllm:iteration_tokens_total"]
        self.req_prompt = h["vllm:request_prompt_tokens"]
        self.req_generation = h["vllm:request_generation_tokens"]
        self.req_max_generation = h["vllm:request_max_num_generation_tokens"]
        self.req_max_tokens = h["vllm:request_params_max_tokens"]
        self.req_n = h["vllm:request_params_n"]

    def add_prompt(self, tokens: int, source: str) -> None:
        self.prompt_tokens += tokens
        self.prompt_by_source[source] += tokens


class MetricsSource(Protocol):
    """What the collector reads from an engine at scrape time."""

    engine_label: str

    @property
    def stats(self) -> EngineStats: ...

    def num_running(self) -> int: ...

    def num_waiting(self) -> int: ...

    def kv_usage(self) -> float: ...


_HELP = {
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "vllm:request_params_n": "Histogram of the n request parameter.",
}


class VllmCollector:
    """Yields vLLM-named metric families for the engines that `sources()` returns."""

    def __init__(
        self,
        model_name: str,
        sources: Callable[[], Iterable[MetricsSource]],
        block_size: int,
        kv_capacity_tokens: int,
    ) -> None:
        self._model = model_name
        self._sources = sources
        self._block_size = block_size
        self._num_blocks = kv_capacity_tokens // block_size

    def collect(self) -> Iterable[Metric]:
        srcs = list(self._sources())
        base = ["model_name", "engine"]

        def gauge(name: str, doc: str, value: Callable[[MetricsSource], float]) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=base)
            for s in srcs:
                fam.add_metric([self._model, s.engine_label], value(s))
            return fam

        def counter(name: str, doc: str, value: Callable[[EngineStats], float]) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=base)
            for s in srcs:
                fam.add_metric([self._model, s.engine_label], value(s.stats), created=s.stats.created)
            return fam

        def counter_by(
            name: str, doc: str, label: str, values: Callable[[EngineStats], dict[str, int]]
        ) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=[*base, label])
            for s in srcs:
                for key, v in values(s.stats).items():
                    fam.add_metric([self._model, s.engine_label, key], v, created=s.stats.created)
            return fam

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lambda s: s.num_running(),
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda s: s.num_waiting(),
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by reason.",
            labels=[*base, "reason"],
        )
        for s in srcs:
            by_reason.add_metric([self._model, s.engine_label, "capacity"], s.num_waiting())
            by_reason.add_metric([self._model, s.engine_label, "deferred"], 0)
        yield by_reason
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_usage()
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            lambda st: st.preemptions,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            lambda st: st.prompt_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", lambda st: 0
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", lambda st: st.prompt_tokens
        )
        yield counter_by(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            lambda st: st.prompt_by_source,
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            lambda st: st.generation_tokens,
        )
        yield counter_by(
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            lambda st: st.success,
        )
        for name, doc in _HELP.items():
            fam = HistogramMetricFamily(name, doc, labels=base)
            for s in srcs:
                h = s.stats.hists[name]
                fam.add_metric([self._model, s.engine_label], h.cumulative(), h.sum)
            yield fam
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "num_gpu_blocks", "kv_cache_size_tokens",
                    "engine"],
        )
        for s in srcs:
            info.add_metric([str(self._block_size), "False", str(self._num_blocks),
                             str(self._block_size * self._num_blocks), s.engine_label], 1.0)
        yield info


class ClockView(Protocol):
    """What `StepCollector` reads from the shared step clock."""

    steps: int
    last_step_s: float
    last_max_load: int
    sum_spread: int
    step_hist: Hist


class StepCollector:
    """Ground truth of the simulated barrier clock, for checking what a sidecar infers:
    `shadow_fleet_steps_total`, `shadow_fleet_step_duration_seconds` (histogram),
    `shadow_fleet_last_step_seconds`, `shadow_fleet_last_max_load_tokens`,
    `shadow_fleet_spread_token_steps_total` (Σ over steps of max − min load) and this rank's
    `shadow_fleet_load_tokens` (L_g). Not a vLLM metric: vLLM exposes no step times."""

    def __init__(
        self,
        clock: Callable[[], ClockView | None],
        sources: Callable[[], Iterable[MetricsSource]],
        load: Callable[[MetricsSource], int],
    ) -> None:
        self._clock = clock
        self._sources = sources
        self._load = load

    def collect(self) -> Iterable[Metric]:
        clock = self._clock()
        if clock is None:
            return
        yield CounterMetricFamily(
            "shadow_fleet_steps", "Steps of the shared decode clock.", value=clock.steps
        )
        h = HistogramMetricFamily("shadow_fleet_step_duration_seconds", "Wall duration of decode steps.")
        h.add_metric([], clock.step_hist.cumulative(), clock.step_hist.sum)
        yield h
        yield GaugeMetricFamily(
            "shadow_fleet_last_step_seconds",
            "Wall duration of the last decode step.",
            value=clock.last_step_s,
        )
        yield CounterMetricFamily(
            "shadow_fleet_spread_token_steps",
            "Sum over decode steps of max_g L_g - min_g L_g over live ranks (per step: average spread).",
            value=clock.sum_spread,
        )
        yield GaugeMetricFamily(
            "shadow_fleet_last_max_load_tokens",
            "max_g L_g of the last decode step.",
            value=clock.last_max_load,
        )
        load = GaugeMetricFamily(
            "shadow_fleet_load_tokens",
            "KV load L_g: prompt + generated tokens of the rank's running requests.",
            labels=["engine"],
        )
        for s in self._sources():
            load.add_metric([s.engine_label], self._load(s))
        yield load


def make_registry(*collectors: object) -> CollectorRegistry:
    """A private registry holding only `collectors`."""
    registry = CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)  # type: ignore[arg-type]
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
