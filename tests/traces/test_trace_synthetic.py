"""Synthetic workloads: labelled, on target, reproducible from a seed; `resolve` dispatch."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

import numpy as np
import pytest

from shadow.traces import WORKLOADS, resolve, synthetic_workload
from shadow.traces.keys import ctx_prompt_key


def test_workload_names() -> None:
    assert WORKLOADS == ("paper-azure", "paper-templates")


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_paper_azure_targets(seed: int) -> None:
    trace = synthetic_workload("paper-azure", seed=seed)
    assert len(trace) == 10_000 and trace.synthetic
    assert trace.name == "paper-azure (synthetic)"
    assert "NOT the real Azure-2024 trace" in trace.notes and f"seed={seed}" in trace.source
    assert trace.mean_prompt_tokens == pytest.approx(4652, rel=0.01)
    assert trace.mean_output_tokens == pytest.approx(1052, rel=0.01)
    cols = trace.arrays()
    assert int(cols["output_tokens"].min()) > 1000 and int(cols["output_tokens"].max()) <= 1500
    assert int(cols["prompt_tokens"].min()) >= 16 and int(cols["prompt_tokens"].max()) <= 7999
    assert trace.requests[0].arrival_s == 0.0 and bool(np.all(np.diff(cols["arrival_s"]) >= 0))
    gaps = np.diff(cols["arrival_s"])
    assert float(gaps.std() / gaps.mean()) == pytest.approx(1.0, abs=0.1)  # Poisson
    assert all(r.prompt_key == ctx_prompt_key(r.prompt_tokens) for r in trace.requests[:500])


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_paper_templates_targets(seed: int) -> None:
    trace = synthetic_workload("paper-templates", seed=seed)
    assert len(trace) == 8000 and trace.synthetic
    assert trace.name == "paper-templates (synthetic)" and "NOT a real trace" in trace.notes
    assert trace.mean_prompt_tokens == pytest.approx(3197, rel=0.01)
    assert trace.mean_output_tokens == pytest.approx(1185, rel=0.01)
    by_key: defaultdict[str | None, list[int]] = defaultdict(list)
    prompts: defaultdict[str | None, set[int]] = defaultdict(set)
    for r in trace.requests:
        by_key[r.prompt_key].append(r.output_tokens)
        prompts[r.prompt_key].add(r.prompt_tokens)
    assert None not in by_key and len(by_key) <= 200
    assert all(len(lengths) == 1 for lengths in prompts.values())  # a template has one prompt length
    top_key, top_count = Counter(r.prompt_key for r in trace.requests).most_common(1)[0]
    assert 0.15 < top_count / len(trace) < 0.28  # Zipf(1.1) over 200: the top template has ≈ 21 %
    top = np.asarray(by_key[top_key], dtype=np.float64)
    assert float(top.std() / top.mean()) < 0.15  # outputs are predictable from the template
    outputs = trace.arrays()["output_tokens"]
    assert float(np.percentile(outputs, 99)) > 2.5 * float(np.median(outputs))  # heavy tail


@pytest.mark.parametrize("name", WORKLOADS)
def test_reproducible_from_seed(name: str) -> None:
    assert synthetic_workload(name, seed=3) == synthetic_workload(name, seed=3)
    assert synthetic_workload(name, seed=3).requests != synthetic_workload(name, seed=4).requests
    small = synthetic_workload(name + " (synthetic)", seed=3, n=500)
    assert len(small) == 500 and "n=500" in small.source


def test_bad_arguments() -> None:
    bad_calls: tuple[Callable[[], object], ...] = (
        lambda: synthetic_workload("paper-nothing"),
        lambda: synthetic_workload("paper-azure", seed=-1),
        lambda: synthetic_workload("paper-azure", n=0),
    )
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


def test_resolve_synthetic_is_a_prefix_of_the_full_workload() -> None:
    full = synthetic_workload("paper-templates", seed=2)
    head = resolve("paper-templates", seed=2, limit=100)
    assert head.requests == full.requests[:100] and head.synthetic
    assert resolve("paper-azure", seed=5) == synthetic_workload("paper-azure", seed=5)
