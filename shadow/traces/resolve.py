"""`resolve`: turn a workload spec from the command line into a Trace, either a synthetic workload
name (see WORKLOADS) or the path of a trace file."""

from __future__ import annotations

import os

from shadow.traces.limits import DEFAULT_LIMITS, TraceLimits
from shadow.traces.loader import load_trace
from shadow.traces.model import Trace, TraceError
from shadow.traces.synthetic import SYNTHETIC_SUFFIX, WORKLOADS, synthetic_workload


def resolve(
    spec: str, *, seed: int = 0, limit: int | None = None, limits: TraceLimits = DEFAULT_LIMITS
) -> Trace:
    """The synthetic workload named `spec` (drawn with `seed`), or the trace file at path `spec`
    (`seed` unused), read within `limits`; `limit` keeps the first requests in both cases (a prefix of
    the full workload).

    Raises TraceError when `spec` is neither a workload name nor a readable trace file.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if spec.removesuffix(SYNTHETIC_SUFFIX) in WORKLOADS and not os.path.exists(spec):
        return synthetic_workload(spec, seed=seed).limit(limit)
    if not os.path.exists(spec):
        raise TraceError.at(
            spec, None, f"no such file, and not a synthetic workload (known: {', '.join(WORKLOADS)})"
        )
    return load_trace(spec, limit=limit, limits=limits)
