"""vLLM 0.33 `/metrics` for simulated engines: plain counters updated on the hot path, exposed
through one custom collector per server registry (no global registry, no per-token locking).

Names, types and labels follow vLLM V1 (`model_name`, `engine`); counters are exposed as
`<name>_total` with `_created`, histograms as `_bucket{le}`/`_sum`/`_count`. Times are wall-clock
seconds as a client observes them (the time scale is already applied).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from shadow.base.families import DeclaredCollector, Family

FINISH_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
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


ME = ("model_name", "engine")
RUNNING = Family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                 "requests", ME)
WAITING = Family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                 "requests", ME)
WAITING_BY_REASON = Family("vllm:num_requests_waiting_by_reason", "gauge",
                           "Number of requests waiting, by reason.", "requests", (*ME, "reason"))
KV_USAGE = Family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                  "ratio", ME)
PREEMPTIONS = Family("vllm:num_preemptions_total", "counter",
                     "Cumulative number of preemption from the engine.", "requests", ME)
CACHE_QUERIES = Family("vllm:prefix_cache_queries_total", "counter",
                       "Prefix cache queries, in terms of number of queried tokens.", "tokens", ME)
CACHE_HITS = Family("vllm:prefix_cache_hits_total", "counter",
                    "Prefix cache hits, in terms of number of cached tokens.", "tokens", ME)
PROMPT_TOKENS = Family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                       "tokens", ME)
PROMPT_BY_SOURCE = Family("vllm:prompt_tokens_by_source_total", "counter",
                          "Number of prompt tokens by source.", "tokens", (*ME, "source"))
GENERATION_TOKENS = Family("vllm:generation_tokens_total", "counter",
                           "Number of generation tokens processed.", "tokens", ME)
SUCCESS = Family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
                 "requests", (*ME, "finished_reason"))
TTFT = Family("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
              "seconds", ME, buckets=TTFT_BUCKETS)
ITL = Family("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
             "seconds", ME, buckets=ITL_BUCKETS)
TPOT = Family("vllm:request_time_per_output_token_seconds", "histogram",
              "Histogram of time_per_output_token_seconds per request.", "seconds", ME, buckets=ITL_BUCKETS)
E2E = Family("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.",
             "seconds", ME, buckets=LATENCY_BUCKETS)
QUEUE_TIME = Family("vllm:request_queue_time_seconds", "histogram",
                    "Histogram of time spent in WAITING phase for request.", "seconds", ME,
                    buckets=LATENCY_BUCKETS)
INFERENCE_TIME = Family("vllm:request_inference_time_seconds", "histogram",
                        "Histogram of time spent in RUNNING phase for request.", "seconds", ME,
                        buckets=LATENCY_BUCKETS)
PREFILL_TIME = Family("vllm:request_prefill_time_seconds", "histogram",
                      "Histogram of time spent in PREFILL phase for request.", "seconds", ME,
                      buckets=LATENCY_BUCKETS)
DECODE_TIME = Family("vllm:request_decode_time_seconds", "histogram",
                     "Histogram of time spent in DECODE phase for request.", "seconds", ME,
                     buckets=LATENCY_BUCKETS)
ITERATION_TOKENS = Family("vllm:iteration_tokens_total", "histogram",
                          "Histogram of number of tokens per engine_step.", "tokens", ME,
                          buckets=ITERATION_TOKEN_BUCKETS)
REQUEST_PROMPT = Family("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed.",
                        "tokens", ME)
REQUEST_GENERATION = Family("vllm:request_generation_tokens", "histogram",
                            "Number of generation tokens processed.", "tokens", ME)
REQUEST_MAX_GENERATION = Family("vllm:request_max_num_generation_tokens", "histogram",
                                "Histogram of maximum number of requested generation tokens.", "tokens", ME)
PARAMS_MAX_TOKENS = Family("vllm:request_params_max_tokens", "histogram",
                           "Histogram of the max_tokens request parameter.", "tokens", ME)
PARAMS_N = Family("vllm:request_params_n", "histogram", "Histogram of the n request parameter.",
                  "requests", ME, buckets=N_BUCKETS)
CACHE_CONFIG = Family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", "info",
                      ("block_size", "enable_prefix_caching", "num_gpu_blocks", "kv_cache_size_tokens",
                       "engine"),
                      note="Value 1; vLLM has about 40 labels, these are the double's.")
#: The per-engine histograms, in the order they are exported (token-count ones: buckets by model length).
HISTOGRAMS = (TTFT, ITL, TPOT, E2E, QUEUE_TIME, INFERENCE_TIME, PREFILL_TIME, DECODE_TIME, ITERATION_TOKENS,
              REQUEST_PROMPT, REQUEST_GENERATION, REQUEST_MAX_GENERATION, PARAMS_MAX_TOKENS, PARAMS_N)
#: vLLM's families as the double exports them (what shadow reads from workers), in that order.
VLLM_FAMILIES = (RUNNING, WAITING, WAITING_BY_REASON, KV_USAGE, PREEMPTIONS, CACHE_QUERIES, CACHE_HITS,
                 PROMPT_TOKENS, PROMPT_BY_SOURCE, GENERATION_TOKENS, SUCCESS, *HISTOGRAMS, CACHE_CONFIG)


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
        self.hists: dict[str, Hist] = {f.name: Hist(f.buckets or tok) for f in HISTOGRAMS}
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


class VllmCollector(DeclaredCollector):
    """Yields vLLM-named metric families for the engines that `sources()` returns."""

    families = VLLM_FAMILIES

    def __init__(self, model_name: str, sources: Callable[[], Iterable[MetricsSource]], block_size: int,
                 kv_capacity_tokens: int) -> None:
        self._model = model_name
        self._sources = sources
        self._block_size = block_size
        self._num_blocks = kv_capacity_tokens // block_size

    def collect(self) -> Iterable[Metric]:
        srcs = list(self._sources())
        model = self._model
        yield RUNNING.sampled({(model, s.engine_label): s.num_running() for s in srcs})
        yield WAITING.sampled({(model, s.engine_label): s.num_waiting() for s in srcs})
        yield WAITING_BY_REASON.sampled({(model, s.engine_label, reason): n for s in srcs
                                         for reason, n in (("capacity", s.num_waiting()), ("deferred", 0))})
        yield KV_USAGE.sampled({(model, s.engine_label): s.kv_usage() for s in srcs})

        def counter(fam: Family, values: Callable[[EngineStats], Mapping[str, int]]) -> CounterMetricFamily:
            out = fam.counter_family()
            for s in srcs:
                for key, v in values(s.stats).items():
                    labels = [model, s.engine_label, *([key] if key else [])]
                    out.add_metric(labels, v, created=s.stats.created)
            return out

        yield counter(PREEMPTIONS, lambda st: {"": st.preemptions})
        yield counter(CACHE_QUERIES, lambda st: {"": st.prompt_tokens})
        yield counter(CACHE_HITS, lambda st: {"": 0})
        yield counter(PROMPT_TOKENS, lambda st: {"": st.prompt_tokens})
        yield counter(PROMPT_BY_SOURCE, lambda st: st.prompt_by_source)
        yield counter(GENERATION_TOKENS, lambda st: {"": st.generation_tokens})
        yield counter(SUCCESS, lambda st: st.success)
        for fam in HISTOGRAMS:
            hist = fam.histogram_family()
            for s in srcs:
                h = s.stats.hists[fam.name]
                hist.add_metric([model, s.engine_label], h.cumulative(), h.sum)
            yield hist
        yield CACHE_CONFIG.sampled({(str(self._block_size), "False", str(self._num_blocks),
                                     str(self._block_size * self._num_blocks), s.engine_label): 1.0
                                    for s in srcs})


FLEET_STEPS = Family("shadow_fleet_steps_total", "counter", "Steps of the shared decode clock.", "steps")
FLEET_STEP_SECONDS = Family("shadow_fleet_step_duration_seconds", "histogram",
                            "Wall duration of decode steps.", "seconds")
FLEET_LAST_STEP = Family("shadow_fleet_last_step_seconds", "gauge",
                         "Wall duration of the last decode step.", "seconds")
FLEET_SPREAD_STEPS = Family(
    "shadow_fleet_spread_token_steps_total", "counter",
    "Sum over decode steps of max_g L_g - min_g L_g over live ranks (per step: average spread).",
    "token-steps")
FLEET_LAST_MAX_LOAD = Family("shadow_fleet_last_max_load_tokens", "gauge",
                             "max_g L_g of the last decode step.", "tokens")
FLEET_LOAD = Family("shadow_fleet_load_tokens", "gauge",
                    "KV load L_g: prompt + generated tokens of the rank's running requests.", "tokens",
                    ("engine",))
#: The simulated fleet's ground truth, in the order `StepCollector` yields it.
FLEET_FAMILIES = (FLEET_STEPS, FLEET_STEP_SECONDS, FLEET_LAST_STEP, FLEET_SPREAD_STEPS, FLEET_LAST_MAX_LOAD,
                  FLEET_LOAD)


class ClockView(Protocol):
    """What `StepCollector` reads from the shared step clock."""

    steps: int
    last_step_s: float
    last_max_load: int
    sum_spread: int
    step_hist: Hist


class StepCollector(DeclaredCollector):
    """Ground truth of the simulated barrier clock, for checking what a sidecar infers:
    `shadow_fleet_steps_total`, `shadow_fleet_step_duration_seconds` (histogram),
    `shadow_fleet_last_step_seconds`, `shadow_fleet_last_max_load_tokens`,
    `shadow_fleet_spread_token_steps_total` (Σ over steps of max − min load) and this rank's
    `shadow_fleet_load_tokens` (L_g). Not a vLLM metric: vLLM exposes no step times."""

    families = FLEET_FAMILIES

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
        yield FLEET_STEPS.value(clock.steps)
        h = FLEET_STEP_SECONDS.histogram_family()
        h.add_metric([], clock.step_hist.cumulative(), clock.step_hist.sum)
        yield h
        yield FLEET_LAST_STEP.value(clock.last_step_s)
        yield FLEET_SPREAD_STEPS.value(clock.sum_spread)
        yield FLEET_LAST_MAX_LOAD.value(clock.last_max_load)
        yield FLEET_LOAD.sampled({s.engine_label: self._load(s) for s in self._sources()})


def make_registry(*collectors: object) -> CollectorRegistry:
    """A private registry holding only `collectors`."""
    registry = CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)  # type: ignore[arg-type]
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
