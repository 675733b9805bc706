"""Labelled synthetic workloads that imitate the BalanceRoute paper's two traces (paper notes 6.2, 6.9).

Each is drawn from `numpy.random.default_rng(seed)` (same seed and n give the same trace), has
`synthetic=True`, a name ending in " (synthetic)", and notes saying what it imitates and that it is
NOT a real trace. Arrivals are Poisson at a base rate; replays rescale them with `at_load`.
`n` changes the whole sample (lengths are rescaled to the target means over the n requests); use
`Trace.limit` for a prefix of the standard workload."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from shadow.traces.keys import ctx_prompt_key, template_key
from shadow.traces.model import Trace, TraceRequest

WORKLOADS: tuple[str, ...] = ("paper-azure", "paper-templates")
SYNTHETIC_SUFFIX = " (synthetic)"

# Base Poisson rate, about the saturation rate of a G=8, B=64 fleet at ≈ 60 ms steps; replays
# rescale arrivals with `at_load`, so this only sets the trace's own clock.
BASE_RATE_RPS = 8.0

AZURE_REQUESTS = 10_000
AZURE_PROMPT_MEAN = 4652.0
AZURE_PROMPT_SIGMA = 0.4
AZURE_PROMPT_RANGE = (16, 7999)
AZURE_OUTPUT_FLOOR = 1000
AZURE_OUTPUT_EXTRA_MEAN = 52.0
AZURE_OUTPUT_CAP = 1500

TEMPLATE_REQUESTS = 8000
TEMPLATE_COUNT = 200
TEMPLATE_ZIPF_S = 1.1
TEMPLATE_PROMPT_MEAN = 3197.0
TEMPLATE_PROMPT_SIGMA = 0.8
TEMPLATE_PROMPT_RANGE = (16, 32768)
TEMPLATE_OUTPUT_MEAN = 1185.0
TEMPLATE_OUTPUT_SIGMA = 0.1
TEMPLATE_OUTPUT_SPREAD = 0.8
TEMPLATE_OUTPUT_RANGE = (1, 16384)


def fit_mean(raw: NDArray[np.float64], target: float, lo: int, hi: int) -> NDArray[np.int64]:
    """Integers round(raw·c) clipped to [lo, hi], with the scale c chosen so their mean is ≈ target."""
    scale = target / float(raw.mean())
    values = np.clip(np.rint(raw * scale), lo, hi)
    for _ in range(100):
        mean = float(values.mean())
        if abs(mean / target - 1.0) < 1e-4:
            break
        scale *= target / mean
        values = np.clip(np.rint(raw * scale), lo, hi)
    return values.astype(np.int64)


def poisson_arrivals(rng: np.random.Generator, n: int, rate_rps: float) -> NDArray[np.float64]:
    """n Poisson arrival times at `rate_rps`, the first at 0.0."""
    times: NDArray[np.float64] = np.cumsum(rng.exponential(1.0 / rate_rps, size=n))
    times -= times[0]
    return times


def _paper_azure(rng: np.random.Generator, n: int) -> list[TraceRequest]:
    """"paper-azure": 10,000 requests like the paper's Azure-2024 conversation set filtered to output
    > 1000 (mean prompt 4,652, mean output 1,052). Prompt: LogNormal(σ=0.4), clipped to [16, 7,999]
    and rescaled so the sample mean is 4,652 (±0.01%); 7,999 is the 2024 trace's published prompt
    maximum, so about 7% of prompts sit at that cap. Output: 1,000 + Geometric(mean 52), capped at
    1,500 (the 2024 output maximum). prompt_key = `ctx_prompt_key(prompt_tokens)`: the replay client
    sends a deterministic synthetic prompt per length (A9).
    """
    arrivals = poisson_arrivals(rng, n, BASE_RATE_RPS)
    prompts = fit_mean(rng.lognormal(0.0, AZURE_PROMPT_SIGMA, size=n), AZURE_PROMPT_MEAN, *AZURE_PROMPT_RANGE)
    extra = rng.geometric(1.0 / AZURE_OUTPUT_EXTRA_MEAN, size=n)
    outputs = np.minimum(AZURE_OUTPUT_FLOOR + extra, AZURE_OUTPUT_CAP)
    keys = {p: ctx_prompt_key(p) for p in np.unique(prompts).tolist()}
    return [
        TraceRequest(t, p, o, keys[p])
        for t, p, o in zip(arrivals.tolist(), prompts.tolist(), outputs.tolist(), strict=True)
    ]


def _paper_templates(rng: np.random.Generator, n: int) -> list[TraceRequest]:
    """"paper-templates": 8,000 requests like the paper's proprietary trace (mean prompt 3,197, mean
    output 1,185): K=200 templates with Zipf(1.1) popularity; template j has a fixed prompt length
    (LogNormal, σ=0.8, clipped to [16, 32,768]) and outputs LogNormal(μ_j, 0.1) with μ_j ~ N(·, 0.8)
    across templates (heavy-tailed marginal, clipped to [1, 16,384]); both rescaled to the target
    means over the sample. prompt_key = `template_key(j)`.
    """
    arrivals = poisson_arrivals(rng, n, BASE_RATE_RPS)
    weights = 1.0 / np.arange(1, TEMPLATE_COUNT + 1, dtype=np.float64) ** TEMPLATE_ZIPF_S
    template_prompt = rng.lognormal(0.0, TEMPLATE_PROMPT_SIGMA, size=TEMPLATE_COUNT)
    template_mu = rng.normal(0.0, TEMPLATE_OUTPUT_SPREAD, size=TEMPLATE_COUNT)
    templates = rng.choice(TEMPLATE_COUNT, size=n, p=weights / weights.sum())
    noise = rng.standard_normal(size=n)
    prompts = fit_mean(template_prompt[templates], TEMPLATE_PROMPT_MEAN, *TEMPLATE_PROMPT_RANGE)
    outputs = fit_mean(
        np.exp(template_mu[templates] + TEMPLATE_OUTPUT_SIGMA * noise),
        TEMPLATE_OUTPUT_MEAN,
        *TEMPLATE_OUTPUT_RANGE,
    )
    keys = [template_key(j) for j in range(TEMPLATE_COUNT)]
    return [
        TraceRequest(t, p, o, keys[j])
        for t, p, o, j in zip(
            arrivals.tolist(), prompts.tolist(), outputs.tolist(), templates.tolist(), strict=True
        )
    ]


AZURE_NOTES = (
    "SYNTHETIC: imitates the BalanceRoute paper's Azure-2024 conversation set (10,000 requests with "
    "output > 1000; mean prompt 4,652, mean output 1,052). It is NOT the real Azure-2024 trace, which "
    "is not available here. Prompt LogNormal(σ=0.4) clipped to [16, 7999], output 1000 + "
    "Geometric(mean 52) capped at 1500, Poisson arrivals; prompt_key = key of a synthetic prompt of "
    "prompt_tokens tokens (A9)."
)
TEMPLATE_NOTES = (
    "SYNTHETIC: imitates the BalanceRoute paper's proprietary production trace (8,000 requests; mean "
    "prompt 3,197, mean output 1,185) with 200 Zipf(1.1) prompt templates, per-template output "
    "LogNormal(μ_j, 0.1). It is NOT a real trace (and NOT the real Azure-2024 trace); Poisson "
    "arrivals; prompt_key = template id hash."
)


def synthetic_workload(name: str, *, seed: int = 0, n: int | None = None) -> Trace:
    """The synthetic workload `name` (see WORKLOADS; a trailing " (synthetic)" is accepted), drawn with
    `seed` (int >= 0); `n` requests (default: the paper's count). Bad arguments raise ValueError."""
    base = name.removesuffix(SYNTHETIC_SUFFIX)
    if base not in WORKLOADS:
        raise ValueError(f"unknown synthetic workload {name!r} (known: {', '.join(WORKLOADS)})")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    default = AZURE_REQUESTS if base == "paper-azure" else TEMPLATE_REQUESTS
    count = default if n is None else n
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    rng = np.random.default_rng(seed)
    if base == "paper-azure":
        requests, notes = _paper_azure(rng, count), AZURE_NOTES
    else:
        requests, notes = _paper_templates(rng, count), TEMPLATE_NOTES
    return Trace(
        name=base + SYNTHETIC_SUFFIX,
        requests=tuple(requests),
        source=f"synthetic_workload({base!r}, seed={seed}, n={count})",
        synthetic=True,
        notes=notes,
    )
