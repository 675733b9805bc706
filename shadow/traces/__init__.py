"""Request traces for replay: loaders (Azure CSV, Mooncake JSONL, generic JSONL/CSV), labelled synthetic
workloads imitating the BalanceRoute paper's traces, and arrival-rate scaling."""

from shadow.traces.generic import write_csv, write_jsonl
from shadow.traces.limits import DEFAULT_LIMITS, TraceLimits
from shadow.traces.loader import FORMATS, detect_format, load_trace
from shadow.traces.model import Trace, TraceError, TraceRequest
from shadow.traces.rate import at_load, estimate_capacity_rps, mean_slot_load_tokens, scale_rate, spread_ties
from shadow.traces.resolve import resolve
from shadow.traces.synthetic import WORKLOADS, synthetic_workload

__all__ = [
    "DEFAULT_LIMITS",
    "FORMATS",
    "WORKLOADS",
    "Trace",
    "TraceError",
    "TraceLimits",
    "TraceRequest",
    "at_load",
    "detect_format",
    "estimate_capacity_rps",
    "load_trace",
    "mean_slot_load_tokens",
    "resolve",
    "scale_rate",
    "spread_ties",
    "synthetic_workload",
    "write_csv",
    "write_jsonl",
]
