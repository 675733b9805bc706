"""Arguments shared by `shadow replay`, `shadow sweep` and `shadow demo`, and their translation."""

from __future__ import annotations

import argparse
from dataclasses import replace

from shadow.core.params import BRParams
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import PrefillConfig
from shadow.replay.experiment import DEFAULT_POLICIES, ReplaySetup, parse_policies
from shadow.traces import DEFAULT_LIMITS, TraceLimits


class Given(argparse.Action):
    """Stores the value and notes that the flag was given (`given(args)`): a recording's settings
    apply to every flag not given."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def given(args: argparse.Namespace) -> set[str]:
    """The destinations of the `Given` flags on the command line."""
    return set(getattr(args, "given", ()))


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace",
        metavar="TRACE|WORKLOAD",
        help="a trace file (Azure CSV, Mooncake JSONL, generic JSONL/CSV with arrival_s, prompt_tokens, "
        "output_tokens[, prompt_key]) or a synthetic workload: paper-azure, paper-templates",
    )
    p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    p.add_argument(
        "--max-trace-lines",
        type=int,
        metavar="N",
        default=DEFAULT_LIMITS.max_lines,
        help=f"refuse a trace or recording of more than N lines (default {DEFAULT_LIMITS.max_lines:,}; "
        "memory grows with the requests read)",
    )
    p.add_argument(
        "--seed", type=int, default=0, action=Given, help="seed for synthetic workloads and random policies"
    )


def add_fleet_args(p: argparse.ArgumentParser, workers: bool = True) -> None:
    if workers:
        p.add_argument(
            "--workers",
            "-G",
            type=int,
            default=None,
            help="decode DP workers G (default 8; a recorded session: its configured workers)",
        )
    p.add_argument(
        "--slots",
        "-B",
        type=int,
        default=64,
        action=Given,
        help="slots (max running requests) per worker (default 64)",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--load",
        type=float,
        metavar="RHO",
        help="rescale arrivals to RHO × estimated capacity (e.g. 1.05 for near saturation)",
    )
    load.add_argument("--rate-scale", type=float, metavar="X", help="multiply the trace's arrival rate by X")
    for term, text in _step_rows():
        p.add_argument(
            f"--step-{term}", type=float, default=getattr(StepTimeModel(), term), action=Given,
            help=f"step model: {text}",
        )
    p.add_argument(
        "--prefill",
        type=int,
        metavar="N",
        default=0,
        help="model N FCFS prefill servers before the pool (0 = requests reach the router at arrival)",
    )


def _step_rows() -> tuple[tuple[str, str], ...]:
    """The step model's terms: the `StepTimeModel` field each `--step-X` fills, and its help."""
    d, recorded = StepTimeModel(), "a recorded session: what its lanes ran with"
    return (
        ("a", f"seconds per KV token of max load (default: {d.a}; {recorded})"),
        ("b", f"fixed seconds per step (default: {d.b}; {recorded})"),
        ("c", f"seconds per running sequence (default: {d.c:g}, the paper's model; {recorded}); "
              "BalanceRoute's policies then balance KV tokens + c/a per sequence (sequences when a = 0)"),
        ("p", f"seconds per prefill token scheduled into a decode step (default: {d.p:g}; {recorded}); "
              "not a per-step load: routing does not weigh it"),
    )


#: The destinations of the step model's flags (a recording's fitted clock gives way to any of them).
STEP_FLAGS = frozenset(f"step_{term}" for term, _ in _step_rows())


def _br_rows() -> tuple[tuple[str, str, type, object, str], ...]:
    """BalanceRoute's options: the flag, the `BRParams` field it fills, its type, default and help."""
    d = BRParams()
    return (
        ("--horizon", "horizon", int, d.horizon, f"BR-H look-ahead H in steps (default {d.horizon})"),
        ("--alpha", "alpha", float, d.alpha, f"BR-H fill reward α (default {d.alpha})"),
        ("--beta", "beta", float, d.beta, f"BR-H overflow penalty β > α (default {d.beta})"),
        ("--gamma", "gamma", float, d.gamma, f"BR-H discount γ (default {d.gamma})"),
        ("--r-max", "r_max", int, d.r_max, f"Stage-2 window R_max, 1–16 (default {d.r_max})"),
        ("--s-greedy", "s_greedy", int, None, "Stage 1 runs while total free slots exceed this (default G)"),
        ("--age", "age_s", float, d.age_s, f"pool aging threshold in seconds (default {d.age_s})"),
    )


def add_br_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("BalanceRoute parameters")
    for name, _, kind, default, text in _br_rows():
        g.add_argument(name, type=kind, action=Given, default=default, help=text)


def br_params(args: argparse.Namespace) -> BRParams:
    return BRParams(**{fills: getattr(args, name[2:].replace("-", "_")) for name, fills, *_ in _br_rows()})


def trace_limits(args: argparse.Namespace) -> TraceLimits:
    """The bounds a trace file is read within (`--max-trace-lines`)."""
    if args.max_trace_lines < 1:
        raise ValueError(f"--max-trace-lines must be >= 1, got {args.max_trace_lines}")
    return replace(DEFAULT_LIMITS, max_lines=args.max_trace_lines)


def step_model(args: argparse.Namespace) -> StepTimeModel:
    """The step model of --step-a/--step-b/--step-c/--step-p (ValueError naming a bad term)."""
    return StepTimeModel(**{term: getattr(args, f"step_{term}") for term, _ in _step_rows()})


def setup_from(args: argparse.Namespace, policies: str | None, workers: int | None = None) -> ReplaySetup:
    prefill = PrefillConfig(servers=args.prefill) if args.prefill else None
    return ReplaySetup(
        workers=workers if workers is not None else (args.workers if args.workers is not None else 8),
        workers_given=workers is None and args.workers is not None,
        slots=args.slots,
        policies=parse_policies(policies) if policies else DEFAULT_POLICIES,
        load=args.load,
        rate_scale=args.rate_scale,
        step=step_model(args),
        prefill=prefill,
        br=br_params(args),
        seed=args.seed,
    )
