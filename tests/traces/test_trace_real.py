"""The real traces shipped in data/traces are the published files (sha256) and load with the row
counts and statistics of their README."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from shadow.traces import detect_format, load_trace, resolve, spread_ties
from shadow.traces.keys import ctx_prompt_key

TRACES = Path(os.environ.get("SHADOW_TRACES_DIR", Path(__file__).resolve().parents[2] / "data" / "traces"))
CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"
CODE = TRACES / "AzureLLMInferenceTrace_code.csv"
MOONCAKE = TRACES / "conversation_trace.jsonl"


@pytest.mark.parametrize(
    ("path", "fmt", "name", "rows", "prompt_mean", "output_mean", "span_s", "rate"),
    [
        (CONV, "azure-csv", "azure-2023-conv", 19_366, 1154.7, 211.1, 3501.7, 5.53),
        (CODE, "azure-csv", "azure-2023-code", 8_819, 2047.8, 27.9, 3435.9, 2.57),
        (MOONCAKE, "mooncake", "mooncake-conversation", 12_031, 12035.1, 342.6, 3537.0, 3.40),
    ],
)
def test_real_trace_matches_readme(
    path: Path,
    fmt: str,
    name: str,
    rows: int,
    prompt_mean: float,
    output_mean: float,
    span_s: float,
    rate: float,
) -> None:
    assert detect_format(str(path)) == fmt
    trace = load_trace(path)
    assert trace.name == name and trace.source == str(path) and not trace.synthetic
    assert len(trace) == rows
    assert trace.mean_prompt_tokens == pytest.approx(prompt_mean, abs=0.05)
    assert trace.mean_output_tokens == pytest.approx(output_mean, abs=0.05)
    assert trace.duration_s == pytest.approx(span_s, abs=0.05)
    assert trace.mean_rate_rps == pytest.approx(rate, abs=0.005)
    assert trace.requests[0].arrival_s == 0.0
    arrivals = trace.arrays()["arrival_s"]
    assert bool(np.all(np.diff(arrivals) >= 0))


def test_azure_conv_details() -> None:
    trace = load_trace(CONV)
    cols = trace.arrays()
    assert int(cols["prompt_tokens"].min()) == 2 and int(cols["prompt_tokens"].max()) == 14_050
    assert int(cols["output_tokens"].max()) == 1000 and int((cols["output_tokens"] == 1000).sum()) == 11
    assert len(np.unique(cols["arrival_s"])) == len(trace)  # no two timestamps are the same
    # 2023-11-16 18:15:46.6805900 -> 18:15:50.9951690: fractions kept to the digit.
    assert trace.requests[1].arrival_s == 4.314579
    first = trace.requests[0]
    assert first.prompt_key == ctx_prompt_key(first.prompt_tokens)


def test_mooncake_details() -> None:
    trace = load_trace(MOONCAKE)
    cols = trace.arrays()
    assert len(np.unique(cols["arrival_s"])) == 1180
    assert int(cols["output_tokens"].min()) == 1 and int(cols["output_tokens"].max()) == 2000
    keys = [r.prompt_key for r in trace.requests]
    assert all(k is not None and len(k) == 16 for k in keys)
    assert len(set(keys)) < len(keys)  # some prompts repeat exactly
    spread = spread_ties(trace, 3.0)
    assert len(np.unique(spread.arrays()["arrival_s"])) == len(trace)
    assert spread.duration_s == pytest.approx(trace.duration_s, abs=3.0)


def test_limit_and_resolve_on_real_files() -> None:
    head = load_trace(CONV, limit=100)
    assert len(head) == 100 and "limit" in head.notes
    full = load_trace(str(CONV))
    assert head.requests == full.requests[:100]
    assert resolve(str(MOONCAKE), limit=10).requests == load_trace(MOONCAKE, limit=10).requests
    assert len(load_trace(CODE, limit=10**9)) == 8_819


def test_shipped_traces_are_the_published_files() -> None:
    """Each file's sha256 is the one data/traces/README.md gives for the published file."""
    readme = (TRACES / "README.md").read_text()
    for path in (CONV, CODE, MOONCAKE):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{path.name}`"))
        assert f"`{digest}`" in row, (path.name, digest)
