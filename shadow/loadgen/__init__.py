"""Load generator: replay a trace against any OpenAI-compatible endpoint (``shadow load``).

Requests are sent with the official ``openai`` AsyncOpenAI client, at the trace's arrival times
(optionally scaled), with ``max_tokens`` = the trace's output length plus vLLM's
``ignore_eos``, and synthetic prompts of exactly the trace's prompt length (identical prompt
keys give identical prompts). The run is summarised as TTFT/TPOT/E2E percentiles, throughput
and errors by kind.

Modules: ``prompts`` (prompt text), ``schedule`` (send plan), ``client`` (the SDK client),
``sender`` (one request, timed), ``runner`` (``run_load``), ``report`` (summary, table,
JSON), ``progress`` (progress display).

    report = await run_load(trace, "http://127.0.0.1:8000", LoadOptions(concurrency=64))
"""

from shadow.loadgen.errors import LoadError
from shadow.loadgen.options import LoadOptions
from shadow.loadgen.progress import NullProgress, PlainProgress, ProgressSink, RichProgress, make_progress
from shadow.loadgen.prompts import PromptBuilder, PromptError, TokenCounter, count_words
from shadow.loadgen.report import LoadReport, LoadSummary, render_summary, summarize
from shadow.loadgen.runner import run_load
from shadow.loadgen.schedule import PlannedRequest, plan, trace_rate
from shadow.loadgen.sender import RequestResult

__all__ = [
    "LoadError",
    "LoadOptions",
    "LoadReport",
    "LoadSummary",
    "NullProgress",
    "PlainProgress",
    "PlannedRequest",
    "ProgressSink",
    "PromptBuilder",
    "PromptError",
    "RequestResult",
    "RichProgress",
    "TokenCounter",
    "count_words",
    "make_progress",
    "plan",
    "render_summary",
    "run_load",
    "summarize",
    "trace_rate",
]
