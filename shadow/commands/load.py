"""`shadow load TRACE|WORKLOAD --target URL`: replay a trace against an OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shadow.base.knobs import POSITIVE, argument, knob_values, knobs
from shadow.commands._help import add_command
from shadow.loadgen.options import LoadOptions
from shadow.loadgen.prompts import PromptBuilder

if TYPE_CHECKING:
    from shadow.contracts.traces import TraceLike
    from shadow.loadgen import LoadReport, ProgressSink

DESCRIPTION = """\
Replay a request trace (or a labelled synthetic workload) against any OpenAI-compatible
endpoint (vLLM, vllm-router, SGLang, shadow's simulated fleet...), with the official openai
client, at the trace's arrival times. Each request asks for exactly the trace's output length
(max_tokens, plus vLLM's ignore_eos) with a synthetic prompt of exactly the trace's prompt
length (whitespace-separated words; identical prompt keys give identical prompts). Prints a
progress bar and a summary: requests ok/failed by error kind, TTFT P50/P99, TPOT P50/P95,
end-to-end latency, output tokens/s, prompt tokens sent.

exit status: 0 all requests ok, 1 some failed or the run could not start (target unreachable,
bad trace), 130 interrupted (Ctrl-C prints the summary of what finished)."""

EPILOG = """\
examples:
  shadow load paper-azure --target http://127.0.0.1:8000 --limit 200 --time-scale 4
  shadow load traces/conv.csv --target http://router:8000 --concurrency 64 --chat --json out.json
  shadow load paper-templates --target http://127.0.0.1:8000 --request-id-prefix run7-"""


def register(subparsers: Any) -> None:
    """Add the `load` sub-command. The settings that are `LoadOptions` fields are declared there
    (`shadow.base.knobs`) and their flags derived from them (`--time-scale` in the pace group, with
    --rate-scale and --rate); the others are this command's own: `--target` (required, the run's
    endpoint), `--seed` and `--chat-overhead` (the prompt builder's, `--seed` the synthetic
    workload's too), `--stream/--no-stream` and `--no-ignore-eos` (switches on by default: a knob's
    switch is off by default), `--rate-scale` and `--rate` (other ways to say the time scale),
    `--header` (repeatable), `--json` and `--quiet` (the command's output)."""
    summary = "replay a trace against an OpenAI-compatible endpoint (load generator)"
    p = add_command(subparsers, "load", summary, DESCRIPTION, EPILOG)
    p.add_argument("trace", metavar="TRACE|WORKLOAD", help="trace file path or synthetic workload name")
    p.add_argument(
        "--target", required=True, metavar="URL", help="server base URL; /v1 is appended if absent"
    )
    pace = p.add_mutually_exclusive_group()
    for f, k in sorted(knobs(LoadOptions), key=lambda fk: fk[1].dest == "time_scale"):
        # add_knobs, with --time-scale last: in the pace group, beside --rate-scale and --rate
        (pace if k.dest == "time_scale" else p).add_argument(k.flag, dest=k.dest, **argument(f, k))
    pace.add_argument(
        "--rate-scale",
        type=float,
        metavar="X",
        help="multiply the arrival rate by X (same as --time-scale X)",
    )
    pace.add_argument(
        "--rate", type=float, metavar="RPS", help="rescale arrivals to a mean of RPS requests per second"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed for synthetic workloads and prompt words (default 0)"
    )
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=LoadOptions.stream,
        help="stream responses (default) or not; TTFT/TPOT need streaming",
    )
    p.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="K=V",
        help="extra HTTP header on every request (repeatable)",
    )
    p.add_argument(
        "--chat-overhead",
        type=int,
        default=0,
        metavar="K",
        help="tokens the server adds per chat message; the message gets N-K words so the server "
        "counts N (shadow's simulated fleet: 4; default 0)",
    )
    p.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="do not send ignore_eos: true"
    )
    p.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT ('-' for stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run)


def options_from_args(args: argparse.Namespace) -> LoadOptions:
    """The run's options before the trace is known: every setting from its flag (`--time-scale` not
    given: `--rate-scale`, else the field's default; `--rate` rescales it once the trace is read),
    the switches and headers from theirs. ValueError naming the flag."""
    given = {name: v for name, v in knob_values(args, LoadOptions).items() if v is not None}
    if args.rate_scale is not None:
        if not POSITIVE.ok(args.rate_scale):
            raise ValueError(f"--rate-scale must be {POSITIVE.asks}, got {args.rate_scale}")
        given["time_scale"] = args.rate_scale
    if args.rate is not None and not POSITIVE.ok(args.rate):
        raise ValueError(f"--rate must be {POSITIVE.asks}, got {args.rate}")
    return LoadOptions(
        **given, stream=args.stream, ignore_eos=args.ignore_eos, headers=_headers(args.header),
        prompt_builder=PromptBuilder(seed=args.seed, chat_overhead=args.chat_overhead),
    )


def _fail(message: str) -> int:
    print(f"shadow load: error: {message}", file=sys.stderr)
    return 1


def _headers(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--header must be K=V, got {item!r}")
        out[key.strip()] = value.strip()
    return out


async def _run_with_sigint(
    trace: TraceLike, target: str, options: LoadOptions, progress: ProgressSink
) -> LoadReport:
    """Run the load; the first Ctrl-C stops it gracefully (summary of what finished), a second aborts."""
    from shadow.loadgen import run_load

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix or not main thread
        installed = False
    try:
        return await run_load(trace, target, options, progress=progress, stop=stop)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


def run(args: argparse.Namespace) -> int:
    """Resolve the trace, run the load, print the summary; see the exit status in --help."""
    from rich.console import Console

    from shadow.loadgen import LoadError, make_progress, render_summary, trace_rate

    try:
        from shadow.traces import TraceError, resolve
    except ImportError as exc:  # pragma: no cover - only while shadow.traces is missing
        return _fail(f"trace support is not available ({exc})")

    try:
        options = options_from_args(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        trace = resolve(args.trace, seed=args.seed, limit=options.limit)
    except (TraceError, ValueError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{args.trace}: {exc.strerror or exc}")

    if args.rate is not None:
        base = trace_rate(trace, options.limit)
        if base <= 0:
            return _fail("--rate needs a trace whose arrivals span some time")
        try:
            options = dataclasses.replace(options, time_scale=args.rate / base)
        except ValueError as exc:
            return _fail(str(exc))

    console = Console()
    progress = make_progress(console, quiet=args.quiet)
    try:
        report = asyncio.run(_run_with_sigint(trace, args.target, options, progress))
    except LoadError as exc:
        return _fail(str(exc))

    console.print(render_summary(report))
    if args.json:
        text = json.dumps(report.to_dict(), indent=2)
        if args.json == "-":
            print(text)
        else:
            try:
                Path(args.json).write_text(text + "\n", encoding="utf-8")
            except OSError as exc:
                return _fail(f"cannot write {args.json}: {exc.strerror or exc}")
    if report.interrupted:
        return 130
    return 0 if report.summary.failed == 0 else 1
